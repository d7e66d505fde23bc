"""Literals a regex match must contain: a cheap test that a pattern cannot match a text (issue #28).

Every match of `\\b(?:ignore|forget)\\s+(?:all\\s+)?(?:previous|prior)\\s+instructions` contains one of
{"ignore", "forget"}, one of {"previous", "prior"} and "instructions". `needs` reads these sets (an AND of
ORs) off the parsed pattern; `may_match` tests them with `in` (a C substring search, no regex pass). When it
says no, the pattern has no match in the text; when it says yes, the pattern runs as before:

    literal run "abc"          -> {"abc"}                   must appear
    concatenation              -> the sets of every part    (AND)
    alternation a|b            -> one set of each branch, joined (OR); nothing when a branch needs nothing
    x{m,n} with m >= 1, groups -> the sets of x
    classes, \\s, \\b, x?, x*   -> nothing (they break a literal run)

NOTE: only the pattern's own literals count, compared case-sensitively, so an ignore-case pattern or
group needs nothing here.
"""

from __future__ import annotations

import itertools
import re
import re._constants as K  # the parser's opcodes (the stdlib's own, in this form since 3.11)
import re._parser as P
from typing import Any

Needs = tuple[frozenset[str], ...]  # every set must have one of its strings in the text

_REPEATS = (K.MAX_REPEAT, K.MIN_REPEAT, K.POSSESSIVE_REPEAT)


def needs(pattern: str, flags: int = 0) -> Needs:
    """The literal sets every match of `pattern` contains, most selective first (empty: no test).

    Args:
        pattern: a regular expression, compiled with `flags` where it is used.
        flags: its `re` flags.
    """
    parsed = P.parse(pattern, flags)
    if parsed.state.flags & re.IGNORECASE:  # the flags given and any inline (?i)
        return ()
    return tuple(sorted(set(_seq(parsed.data)), key=_rank, reverse=True))


def heads(pattern: str, flags: int = 0) -> frozenset[str] | None:
    """Literals one of which every match of `pattern` starts with (None: not known from the pattern).

    NOTE: zero-width items at the front (`\\b`, `^`, lookarounds) are skipped: they still decide the match,
    at the position where it starts.
    """
    parsed = P.parse(pattern, flags)
    return None if parsed.state.flags & re.IGNORECASE else _heads(parsed.data)


def may_match(need: Needs, text: str) -> bool:
    """False only when a pattern with these needs cannot match `text`."""
    return all(any(s in text for s in ors) for ors in need)


def _rank(ors: frozenset[str]) -> tuple[int, int]:
    """Selectivity of a set: longer shortest string, then fewer strings, first."""
    return (min(map(len, ors)), -len(ors))


def _seq(items: list[tuple[Any, Any]]) -> list[frozenset[str]]:
    """The sets of a concatenation of parsed items (the parser's (opcode, argument) pairs)."""
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
            out += _seq(av[3].data)
        elif op is K.ATOMIC_GROUP:
            out += _seq(av.data)
        elif op in _REPEATS and av[0] >= 1:  # av = (min, max, items)
            out += _seq(av[2].data)
        elif op is K.BRANCH:  # av = (None, [items of each branch])
            branches = [_seq(b.data) for b in av[1]]
            if all(branches):
                out.append(frozenset().union(*(max(b, key=_rank) for b in branches)))
    if run:
        out.append(frozenset(["".join(run)]))
    return out


_ZERO_WIDTH = (K.AT, K.ASSERT, K.ASSERT_NOT)


def _heads(items: list[tuple[Any, Any]]) -> frozenset[str] | None:
    """The literals a match of a concatenation of parsed items starts with, or None."""
    rest = list(items)
    while rest and rest[0][0] in _ZERO_WIDTH:
        rest.pop(0)
    run = "".join(chr(av) for _, av in itertools.takewhile(lambda it: it[0] is K.LITERAL, rest))
    if run or not rest:
        return frozenset([run]) if run else None
    op, av = rest[0]
    if op is K.SUBPATTERN and not av[1] & re.IGNORECASE:
        return _heads(av[3].data)
    if op in _REPEATS and av[0] >= 1:
        return _heads(av[2].data)
    if op is K.BRANCH:
        branches = [h for b in av[1] if (h := _heads(b.data)) is not None]
        return frozenset().union(*branches) if len(branches) == len(av[1]) else None
    return None
