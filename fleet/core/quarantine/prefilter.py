"""A regex written as alternatives, matched with fewer passes over the text (issue #28); same matches.

Most of the rules' CPU went into passes of every alternative over every position of a text. Two facts, both
read off the parsed pattern, let most passes go:

    needs   literals every match contains: \\b(?:ignore|forget)\\s+(?:all\\s+)?(?:previous|prior)\\s+instructions
            needs {"ignore", "forget"} and {"pr"} and {"evious", "ior"} and {"instructions"} (an AND of ORs,
            tested with `in`, a C substring search). An alternative that needs what a text lacks cannot
            match there; the alternation without it (the others in their order) gives the same matches.
    heads   literals every match starts with: {"ignore", "forget"}. When the live alternatives all have
            heads that occur rarely, the pattern is matched only where one occurs, not at every position.

    literal "abc"               -> needs {"abc"}                 heads {"abc"}
    concatenation               -> the needs of every part (AND)  the heads of its leading small literal parts
    alternation a|b             -> one set of each branch (OR)    the heads of every branch
    x{m,n} (m >= 1), groups     -> the needs of x                 the heads of x
    classes, \\s, x?, x*         -> nothing                        (end the heads; a class of few literals,
                                                                   x? of literals extend them)

NOTE: only the pattern's own literals count, compared case-sensitively, so an ignore-case pattern or group
needs nothing here.
"""

from __future__ import annotations

import itertools
import re
import re._constants as K  # the parser's opcodes (the stdlib's own, in this form since 3.11)
import re._parser as P
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

Needs = tuple[frozenset[str], ...]  # every set must have one of its strings in the text
Items = list[tuple[Any, Any]]  # a parsed concatenation: the parser's (opcode, argument) pairs

_REPEATS = (K.MAX_REPEAT, K.MIN_REPEAT, K.POSSESSIVE_REPEAT)
_ZERO_WIDTH = (K.AT, K.ASSERT, K.ASSERT_NOT)
_MAX_HEADS = 64  # a longer list of heads is not worth its `find` calls
# A `match` call at one position costs about as much as scanning this many characters (measured, issue #28).
_SCAN_CHARS_PER_MATCH = 32


@dataclass(frozen=True, slots=True)
class Alternation:
    """`regex` = the alternation of `alternatives` (in order) under `flags`, with each one's needs and heads."""

    alternatives: tuple[str, ...]
    flags: int
    regex: re.Pattern[str]
    needs: tuple[Needs, ...]
    heads: tuple[frozenset[str] | None, ...]

    @classmethod
    def of(cls, *alternatives: str, flags: int = 0) -> Alternation:
        return cls(alternatives, flags, _compile(alternatives, flags), tuple(needs(a, flags) for a in alternatives),
                   tuple(heads(a, flags) for a in alternatives))

    def finditer(self, text: str) -> Iterator[re.Match[str]]:
        """The matches of `regex.finditer(text)`, found with fewer passes over `text`."""
        live = [i for i, need in enumerate(self.needs) if may_match(need, text)]
        if not live:
            return iter(())
        regex = self.regex
        if len(live) < len(self.alternatives):
            regex = _compile(tuple(self.alternatives[i] for i in live), self.flags)
        starts = _candidates(text, [self.heads[i] for i in live])
        return regex.finditer(text) if starts is None else _matches_at(regex, text, starts)

    def search(self, text: str) -> re.Match[str] | None:
        """`regex.search(text)`: its first match."""
        return next(self.finditer(text), None)

    def starts(self, text: str) -> list[int] | None:
        """Every position where a match may start (a head occurs there), sorted; None: some heads unknown."""
        return _candidates(text, list(self.heads), most=len(text))


def needs(pattern: str, flags: int = 0) -> Needs:
    """The literal sets every match of `pattern` contains, most selective first (empty: no test).

    Args:
        pattern: a regular expression, compiled with `flags` where it is used.
        flags: its `re` flags.
    """
    parsed = P.parse(pattern, flags)
    if parsed.state.flags & re.IGNORECASE:  # the flags given and any inline (?i)
        return ()
    return tuple(sorted(set(_needs(parsed.data)), key=_rank, reverse=True))


def heads(pattern: str, flags: int = 0) -> frozenset[str] | None:
    """Literals one of which every match of `pattern` starts with (None: not known from the pattern).

    NOTE: zero-width items (`\\\\b`, `^`, lookarounds) are passed over: they decide whether a match starts at a
    position, not what it starts with.
    """
    parsed = P.parse(pattern, flags)
    return None if parsed.state.flags & re.IGNORECASE else _heads(parsed.data)


def may_match(need: Needs, text: str) -> bool:
    """False only when a pattern with these needs cannot match `text`."""
    return all(any(map(text.__contains__, ors)) for ors in need)


@lru_cache(maxsize=512)
def _compile(alternatives: tuple[str, ...], flags: int) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{a})" for a in alternatives), flags)


def _candidates(text: str, starts_with: list[frozenset[str] | None], most: int | None = None) -> list[int] | None:
    """The positions where one of the heads occurs, sorted; None when there are more than `most` (default:
    when scanning the text is cheaper than matching at each) or some heads are unknown."""
    known = [h for h in starts_with if h is not None]
    if len(known) < len(starts_with):
        return None
    out: set[int] = set()
    most = len(text) // _SCAN_CHARS_PER_MATCH if most is None else most
    for s in set().union(*known):
        i = text.find(s)
        while i >= 0:
            out.add(i)
            if len(out) > most:
                return None
            i = text.find(s, i + 1)
    return sorted(out)


def _matches_at(regex: re.Pattern[str], text: str, starts: list[int]) -> Iterator[re.Match[str]]:
    """`regex.finditer(text)` when its matches can start only at `starts` (and none is empty: heads are not).

    NOTE: `regex.match(text, i)` sees the text before `i` (`\\b`, `^` and lookbehinds read it), as a search does.
    """
    end = 0
    for i in starts:
        if i >= end and (m := regex.match(text, i)) is not None:
            end = m.end()
            yield m


def _rank(ors: frozenset[str]) -> tuple[int, int]:
    """Selectivity of a set: fewer strings, then a longer shortest string, first (fewer `in` tests on benign
    text: 212 per 4 KiB against 261 the other way round, issue #28)."""
    return (-len(ors), min(map(len, ors)))


def _needs(items: Items) -> list[frozenset[str]]:
    """The sets of a concatenation of parsed items."""
    out: list[frozenset[str]] = []
    run: list[str] = []
    for op, av in items:
        if op is K.LITERAL:
            run.append(chr(av))
            continue
        if run:
            out.append(frozenset(["".join(run)]))
            run = []
        if op is K.SUBPATTERN and not av[1] & re.IGNORECASE:  # av = (group, add flags, del flags, items)
            out += _needs(av[3].data)
        elif op is K.ATOMIC_GROUP:
            out += _needs(av.data)
        elif op in _REPEATS and av[0] >= 1:  # av = (min, max, items)
            out += _needs(av[2].data)
        elif op is K.BRANCH:  # av = (None, [items of each branch])
            branches = [_needs(b.data) for b in av[1]]
            if all(branches):
                out.append(frozenset().union(*(max(b, key=_rank) for b in branches)))
    if run:
        out.append(frozenset(["".join(run)]))
    return out


def _heads(items: Items) -> frozenset[str] | None:
    """The heads of a concatenation: its leading parts that match a few literals only, spelled out."""
    prefixes = {""}
    for item in items:
        opts = _strings([item])
        if opts is None or len(prefixes) * len(opts) > _MAX_HEADS:
            if prefixes == {""}:  # the first part that consumes text: its own heads
                return _item_heads(*item)
            break
        prefixes = {p + s for p in prefixes for s in opts}
    return None if "" in prefixes else frozenset(prefixes)


def _item_heads(op: Any, av: Any) -> frozenset[str] | None:
    """The heads of one parsed item that is not a small set of literals."""
    if op is K.SUBPATTERN and not av[1] & re.IGNORECASE:
        return _heads(av[3].data)
    if op in _REPEATS and av[0] >= 1:
        return _heads(av[2].data)
    if op is K.BRANCH:
        branches = [h for b in av[1] if (h := _heads(b.data)) is not None]
        return frozenset().union(*branches) if len(branches) == len(av[1]) else None
    return None


def _strings(items: Items) -> set[str] | None:
    """Every string a concatenation of parsed items matches, when that is a few literals (else None).

    Zero-width items count as "": the set may hold strings they would refuse, never miss one they allow.
    """
    out = {""}
    for op, av in items:
        opts: set[str] | None = None
        if op in _ZERO_WIDTH:
            opts = {""}
        elif op is K.LITERAL:
            opts = {chr(av)}
        elif op is K.IN and all(o is K.LITERAL for o, _ in av):
            opts = {chr(c) for _, c in av}
        elif op is K.SUBPATTERN and not av[1] & re.IGNORECASE:
            opts = _strings(av[3].data)
        elif op is K.BRANCH:
            branches = [s for b in av[1] if (s := _strings(b.data)) is not None]
            opts = set().union(*branches) if len(branches) == len(av[1]) else None
        elif op in _REPEATS and av[1] <= 2 and (body := _strings(av[2].data)) is not None:
            opts = {"".join(t) for n in range(av[0], av[1] + 1) for t in itertools.product(body, repeat=n)}
        if opts is None or len(out) * len(opts) > _MAX_HEADS:
            return None
        out = {a + b for a in out for b in opts}
    return out

