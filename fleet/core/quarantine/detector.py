"""Detector interface and the shipped prompt-injection detector.

A detector reads a tool result (str or bytes) and returns a `Verdict`. The shipped one scores
categories of attack (see `rules.py`) over several views of the text — normalised, hidden, decoded —
and quarantines when the score reaches 1.0. A match that is only *mentioned* (inside quotes or code,
in a document that discusses attacks) counts a quarter: a security article quoting an injection is
not an injection.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field
from typing import Protocol

from fleet.core.quarantine import rules as R
from fleet.core.quarantine import text as T

THRESHOLD = 1.0
MENTION_FACTOR = 0.25
MENTION_RADIUS = 1500  # how far from a match the "this text discusses attacks" markers may be
STRIDE = 1000  # signals are summed within windows of two adjacent STRIDE-sized buckets
_QUOTED_RE = re.compile(r"\"[^\"\n]{3,400}\"|“[^”\n]{3,400}”|«[^»\n]{3,400}»|„[^“\n]{3,400}“|'[^'\n]{8,400}'|`[^`\n]+`|```.*?```", re.S)
# Reported speech: "phrases such as ...", "attempts to override ..." (only consulted in documents about attacks).
_MENTION_VERB_RE = re.compile(
    r"(?:like|such as|e\.g\.|phrase|string|text|wrote|writes|says|saying|reads|containing|contains|"
    r"(?:attempts?|attempting|tries|trying|try|designed|used|intended|meant|able|seeks?|aims?|wants?)\s+to)\W*$"
)


_NOUN_USE_RE = re.compile(r"\b(?:the|this|that|an|a|my|your|his|her|our|their|each|every|new|previous|looking|blog)\s+$")
QUOTE_CONTEXT = 300  # how close to a quoted span a discussion marker must be for the span to count as a quotation


def unquoted_view(text: str | bytes | bytearray | memoryview) -> str:
    """The normalised text, with every quoted span that sits next to a discussion marker blanked out.

    NOTE: a security article quoting "ignore all previous instructions" is not an injection; the learned
    layer has no notion of quotation, so it reads this view. A marker *inside* the span does not count
    (an attack cannot hide itself by naming itself), and a text without markers is returned unchanged.
    """
    return blank_quotations(T.normalize(T.decode_bytes(text)))


def blank_quotations(norm: str) -> str:
    """`unquoted_view` of a text already normalised (`text.normalize`)."""
    if R.DISCUSSION_MARKERS.search(norm) is None:
        return norm
    # NOTE: a marker starts with one of its heads, and no head holds a space: a marker of `around` starts at a
    # head of `norm` on one side of the joining space. A quote with no head near it skips the search.
    heads = R.DISCUSSION_MARKERS.starts(norm)
    parts, last = [], 0
    for m in _QUOTED_RE.finditer(norm):
        s, e = m.span()
        if heads is not None and not (_any_between(heads, s - QUOTE_CONTEXT, s) or _any_between(heads, e, e + QUOTE_CONTEXT)):
            continue
        around = norm[max(0, s - QUOTE_CONTEXT): s] + " " + norm[e: e + QUOTE_CONTEXT]
        if R.DISCUSSION_MARKERS.search(around) is not None:
            parts += [norm[last:s], '"…"']
            last = e
    return "".join(parts) + norm[last:]


def _any_between(sorted_positions: list[int], lo: int, hi: int) -> bool:
    i = bisect.bisect_left(sorted_positions, lo)
    return i < len(sorted_positions) and sorted_positions[i] < hi


@dataclass(frozen=True, slots=True)
class Verdict:
    """A detector's answer: quarantined or not, why, and how strongly."""

    quarantined: bool
    reasons: list[str] = field(default_factory=list)
    score: float = 0.0  # the rules' score (the layered detector keeps this meaning)
    learned_score: float | None = None  # P(injection) from the learned layer, None when it did not run
    encoder_score: float | None = None  # P(injection) from the encoder layer, None when it did not run


class Detector(Protocol):
    """Anything with `inspect(text) -> Verdict` is a detector (pluggable)."""

    def inspect(self, text: str | bytes) -> Verdict: ...


class PromptInjectionDetector:
    """Rule-based prompt-injection detector over normalised, hidden and decoded views (multilingual)."""

    def __init__(self, threshold: float = THRESHOLD, max_depth: int = 2, categories: frozenset[str] | None = None) -> None:
        """Args:
            threshold: quarantine when the summed category scores reach it.
            max_depth: how deep hidden and decoded views are re-read.
            categories: the rule set: only these categories count (None: all of `rules.CATEGORIES`).
        """
        self.threshold, self.max_depth = threshold, max_depth
        self.categories = categories

    def inspect(self, text: str | bytes | bytearray | memoryview) -> Verdict:
        """Score `text` and return a Verdict.

        Args:
            text: the tool result (bytes are decoded as UTF-8, or UTF-16 with a BOM).

        Returns:
            Verdict(quarantined = score >= threshold, reasons = the categories that fired, sorted).
        """
        raw = T.decode_bytes(text)
        return self.judge(raw, T.normalize(raw))

    def judge(self, raw: str, norm: str) -> Verdict:
        """`inspect` of a decoded text `raw` whose normalised form `norm` (`text.normalize(raw)`) the caller
        already has: the layered detector normalises a text once for the rules and the model layers."""
        scores = self._score(raw, depth=0, norm=norm)
        if self.categories is not None:
            scores = {c: s for c, s in scores.items() if c in self.categories}
        total = round(sum(scores.values()), 4)
        reasons = sorted(c for c, s in scores.items() if s >= 0.1)
        return Verdict(quarantined=total >= self.threshold, reasons=reasons, score=total)

    # ---- scoring ------------------------------------------------------------------------------------
    def _score(self, raw: str, depth: int, norm: str | None = None) -> dict[str, float]:
        norm = T.normalize(raw) if norm is None else norm
        scores = self._language(norm)
        self._hidden(raw, scores, depth)
        if depth < self.max_depth:
            self._encoded(raw, norm, scores, depth)
            for _, decoded in T.escaped_views(raw):
                # NOTE: the text as the model reads it: each category at the higher of the two readings (a view
                # of the same text, not another payload: added, benign text would count twice)
                for c, w in self._language(T.normalize(decoded)).items():
                    _bump(scores, c, w)
        return scores

    def _language(self, norm: str) -> dict[str, float]:
        """Category scores of the best window: an attack's signals sit together, within ~2000 chars."""
        quoted = [m.span() for m in _QUOTED_RE.finditer(norm)]
        buckets: dict[int, dict[str, float]] = {}
        for rule in R.RULES:
            for m in rule.pattern.finditer(norm):
                w = self._exfil_weight(norm, m, quoted) if rule.exfil else rule.weight
                if w and self._is_mention(norm, m, quoted):
                    w *= MENTION_FACTOR
                _bump(buckets.setdefault(m.start() // STRIDE, {}), rule.category, w)
        for m in R.MARKDOWN_EXFIL.finditer(norm):
            _bump(buckets.setdefault(m.start() // STRIDE, {}), "exfiltration", 1.0)
        for m in R.DECODE_HINT.finditer(norm):
            _bump(buckets.setdefault(m.start() // STRIDE, {}), "encoded_instructions", 0.5)
        return _best_window(buckets)

    @staticmethod
    def _exfil_weight(norm: str, m: re.Match[str], quoted: list[tuple[int, int]]) -> float:
        """An exfiltration verb counts only with something sensitive and a destination nearby."""
        if _NOUN_USE_RE.search(norm[max(0, m.start() - 12): m.start()]) and m.group(0).strip() in ("email", "e-mail", "forward", "post"):
            return 0.0  # NOTE: "ignore this email", "looking forward", "the post": a noun, not an order
        lo, hi = max(0, m.start() - 150), m.end() + 250
        window = norm[lo:hi]
        if R.MENTION_MARKERS.search(norm, max(0, m.start() - MENTION_RADIUS), m.end() + MENTION_RADIUS) is not None:
            # NOTE: in a text about attacks, what a *quotation* names ("send the chat history to this URL")
            # does not confirm a verb outside it ("... made the assistant leak meeting notes").
            window = _blank_quotes(window, lo, m, quoted)
        sensitive = R.SENSITIVE.search(window)
        if sensitive is None or R.DESTINATION.search(window) is None:
            return 0.0
        # NOTE: "send your password reset request to support@..." speaks to a human about their own
        # data; an attack asks the reader to ship someone else's (the conversation, the user's keys).
        own = window[max(0, sensitive.start() - 5): sensitive.start()].endswith("your ")
        return 0.5 if own else 1.0

    @staticmethod
    def _is_mention(norm: str, m: re.Match[str], quoted: list[tuple[int, int]]) -> bool:
        """Quoted or reported speech, near words that show the text is *about* attacks."""
        if R.MENTION_MARKERS.search(norm, max(0, m.start() - MENTION_RADIUS), m.end() + MENTION_RADIUS) is None:
            return False
        i = bisect.bisect_right(quoted, (m.start(), len(norm))) - 1
        inside = i >= 0 and quoted[i][0] <= m.start() and m.end() <= quoted[i][1]
        return inside or _MENTION_VERB_RE.search(norm[max(0, m.start() - 40): m.start()]) is not None

    def _hidden(self, raw: str, scores: dict[str, float], depth: int) -> None:
        n_invisible = T.count_invisible(raw)
        if n_invisible >= 3:
            _bump(scores, "hidden_text", 0.5)
        if T.mixed_script_words(raw) >= 2:
            _bump(scores, "hidden_text", 0.5)
        for segment in T.hidden_segments(raw):
            inner = self._score(segment, depth + 1) if depth < self.max_depth else {}
            if sum(inner.values()) >= 0.5:  # hidden *and* instructive: the attack is what is hidden
                _bump(scores, "hidden_text", 0.5)
                for c, s in inner.items():
                    _bump(scores, c, s)

    def _encoded(self, raw: str, norm: str, scores: dict[str, float], depth: int) -> None:
        for _, decoded in T.decoded_payloads(raw):
            inner = self._score(decoded, depth + 1)
            if sum(inner.values()) >= 0.5:
                _bump(scores, "encoded_instructions", min(1.0, sum(inner.values())))
        if not T.looks_rot13(norm):
            return
        rotated = self._language(T.normalize(T.rot13(raw)))
        strong = sum(s for c, s in rotated.items() if c in ("instruction_override", "system_prompt_leak", "exfiltration"))
        if strong >= 1.0:
            _bump(scores, "encoded_instructions", 1.0)


def _blank_quotes(window: str, lo: int, m: re.Match[str], quoted: list[tuple[int, int]]) -> str:
    """`window` (which starts at `lo`) with the quoted spans that do not hold the match `m` blanked."""
    chars, hi = list(window), lo + len(window)
    # NOTE: the spans are sorted and disjoint, so only the one before the first start >= lo can reach in
    for s, e in quoted[max(0, bisect.bisect_left(quoted, (lo, -1)) - 1):]:
        if s >= hi:
            break
        if e <= lo or s <= m.start() < e:
            continue
        for i in range(max(s, lo) - lo, min(e, hi) - lo):
            chars[i] = " "
    return "".join(chars)


def _best_window(buckets: dict[int, dict[str, float]]) -> dict[str, float]:
    best: dict[str, float] = {}
    for k, bucket in buckets.items():  # window k = buckets k and k+1 (<= 2 * STRIDE chars)
        merged = dict(bucket)
        for c, w in buckets.get(k + 1, {}).items():
            _bump(merged, c, w)
        if sum(merged.values()) > sum(best.values()):
            best = merged
    return best


def _bump(scores: dict[str, float], category: str, weight: float) -> None:
    if weight > scores.get(category, 0.0):
        scores[category] = weight


_DEFAULT: PromptInjectionDetector | None = None


def default_detector() -> PromptInjectionDetector:
    """The shipped prompt-injection detector (shared, stateless)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = PromptInjectionDetector()
    return _DEFAULT
