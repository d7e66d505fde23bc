"""Hashed n-gram features for the learned layer: numpy only, deterministic across processes.

A text becomes a list of *feature events*: (position, bucket). Character n-grams of the normalised
text (see `text.normalize`) sit at the character where they start; word n-grams sit at the start of
their first word. The learned layer sums weights of the events that fall inside a window:

    normalised text   i g n o r e _ a l l _ p r e v i o u s ...
    char 3-grams      [ign][gno][nor] ...            one event per start position and n
    word 1/2-grams    [ignore]     [all] [ignore all] ...
    window            |<----------- window_chars ----------->|   stride window_chars // 2

NOTE: Python's `hash()` is salted per process; buckets come from a fixed 64-bit mix instead, so a
model trained on one machine scores the same on every other.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fleet.core.quarantine import text as T
from fleet.core.quarantine.hashing import events, text_word_spans, word_spans

_MUL = np.uint64(0x100000001B3)  # FNV-1a 64-bit prime, used as the polynomial base
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 finaliser
_WORD_RE = re.compile(r"\w+", re.U)


@dataclass(frozen=True, slots=True)
class FeaturizerConfig:
    """How a text is cut into hashed n-grams."""

    num_buckets: int = 1 << 18
    char_ngrams: tuple[int, ...] = (3, 4, 5)
    word_ngrams: tuple[int, ...] = (1, 2)
    max_chars: int = 1 << 20  # NOTE: longer inputs are scored on their first max_chars (the rules read all)
    # "crc32": word n-grams hashed one by one in Python (the model of issue #15); "poly": every n-gram hashed
    # at once with numpy (`hashing.events`, issue #28)
    hashing: str = "crc32"

    def __post_init__(self) -> None:
        assert self.num_buckets > 0 and self.num_buckets & (self.num_buckets - 1) == 0, (
            "num_buckets: a power of two"
        )
        assert all(n >= 1 for n in self.char_ngrams + self.word_ngrams), "n-gram sizes must be >= 1"
        assert self.hashing in ("crc32", "poly"), "hashing: crc32 or poly"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.hashing == "crc32":
            del d["hashing"]  # NOTE: so the digest of the model trained before the key existed is unchanged
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FeaturizerConfig:
        return cls(
            int(d["num_buckets"]),
            tuple(d["char_ngrams"]),
            tuple(d["word_ngrams"]),
            int(d["max_chars"]),
            str(d.get("hashing", "crc32")),
        )


def _mix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * _MIX1  # NOTE: uint64 arithmetic wraps mod 2^64: no mask needed
    h = h ^ (h >> np.uint64(27))
    h = h * _MIX2
    out: np.ndarray = h ^ (h >> np.uint64(31))
    return out


def _char_events(norm: str, cfg: FeaturizerConfig) -> tuple[np.ndarray, np.ndarray]:
    codes = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)  # (L,)
    pos, buckets = [], []
    with np.errstate(over="ignore"):
        for n in cfg.char_ngrams:
            m = len(codes) - n + 1
            if m <= 0:
                continue
            h = np.full(
                m, np.uint64(n), dtype=np.uint64
            )  # seed with n: a 3-gram and a 4-gram never share a hash
            for k in range(n):
                h = h * _MUL + codes[k : k + m]  # (m,), mod 2^64
            pos.append(np.arange(m, dtype=np.int64))
            buckets.append(_mix(h) & np.uint64(cfg.num_buckets - 1))
    if not pos:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(pos), np.concatenate(buckets).astype(np.int64)


def _word_events(norm: str, cfg: FeaturizerConfig) -> tuple[np.ndarray, np.ndarray]:
    # NOTE: findall's words and the numpy word starts are the same runs (`hashing.word_spans` reads `\w` as the
    # regex does); both cost a fraction of a finditer's match objects (issue #28).
    words = [w.encode() for w in _WORD_RE.findall(norm)]
    starts, _ = word_spans(T.code_points(norm))  # (W,)
    assert len(starts) == len(words)
    return _ngram_events(words, starts, len(words), cfg)


def _ngram_events(
    words: list[bytes], starts: np.ndarray, num_first: int, cfg: FeaturizerConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The word n-gram events whose first word is one of the first `num_first` `words` (UTF-8, at `starts`);
    the words after those are there to be read by them."""
    pos: list[np.ndarray] = []
    hashes: list[int] = []
    for n in cfg.word_ngrams:
        seed = zlib.crc32(f"w{n}|".encode())  # NOTE: crc32(a + b) == crc32(b, crc32(a)): the prefix is hashed once
        grams = words if n == 1 else [b" ".join(g) for g in zip(*(words[k:] for k in range(n)), strict=False)]
        grams = grams[:num_first]
        pos.append(starts[: len(grams)])
        hashes += [zlib.crc32(g, seed) for g in grams]
    if not hashes:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    with np.errstate(over="ignore"):
        b = _mix(np.asarray(hashes, dtype=np.uint64) | np.uint64(1 << 40)) & np.uint64(cfg.num_buckets - 1)
    return np.concatenate(pos), b.astype(np.int64)


def feature_events(
    text: str | bytes | bytearray | memoryview, cfg: FeaturizerConfig
) -> tuple[str, np.ndarray, np.ndarray]:
    """The normalised text and its feature events, sorted by position.

    Args:
        text: the tool result (bytes decoded as in `text.decode_bytes`).
        cfg: the featurizer configuration.

    Returns:
        (norm, positions (E,) int64, buckets (E,) int64), positions ascending.
    """
    norm = normalised(text, cfg)
    return (norm, *norm_events(norm, cfg))


def normalised(text: str | bytes | bytearray | memoryview, cfg: FeaturizerConfig) -> str:
    """The text the events are read from: decoded, cut at `cfg.max_chars`, normalised (`text.normalize`)."""
    return T.normalize(T.decode_bytes(text)[: cfg.max_chars])


def norm_events(norm: str, cfg: FeaturizerConfig) -> tuple[np.ndarray, np.ndarray]:
    """The events of a normalised text: (positions (E,), buckets (E,)), stably sorted by position (at one
    position: the char n-grams by n, then the word n-grams by n)."""
    if cfg.hashing == "poly":
        evs = events(norm, cfg) or [(np.zeros(0, np.int64), np.zeros(0, np.int64))]
        pos, buckets = np.concatenate([p for p, _ in evs]), np.concatenate([b for _, b in evs])
    else:
        cp, cb = _char_events(norm, cfg)
        wp, wb = _word_events(norm, cfg)
        pos, buckets = np.concatenate([cp, wp]), np.concatenate([cb, wb])
    order = np.argsort(pos, kind="stable")
    return pos[order], buckets[order]


def span_events(
    norm: str, cfg: FeaturizerConfig, spans: Iterable[tuple[int, int]]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`norm_events(norm, cfg)` cut to each span [lo, hi) of positions: the same events in the same order, read
    span by span, so that a long text never holds all its events at once (issue #28).

    NOTE: every hash depends on its n-gram's characters alone, not on where it sits: a span's char n-grams come
    from its slice of `norm` (plus the longest n-gram's tail), its word n-grams from the whole text's words that
    start in it (plus the words they read after), so a word longer than a span is read once or twice, not once
    per span. The numpy hashing (no shipped model) reads the whole text once and cuts it.
    """
    whole: tuple[np.ndarray, np.ndarray] | None = None
    words: tuple[np.ndarray, np.ndarray] | None = None  # the whole text's word starts and ends (W,) each
    for lo, hi in spans:
        if lo <= 0 and hi >= len(norm):
            yield norm_events(norm, cfg)
        elif cfg.hashing == "poly":
            whole = whole or norm_events(norm, cfg)
            keep = (whole[0] >= lo) & (whole[0] < hi)
            yield whole[0][keep], whole[1][keep]
        else:
            words = words or text_word_spans(norm)
            yield _span_events(norm, lo, hi, words, cfg)


def _span_events(
    norm: str, lo: int, hi: int, words: tuple[np.ndarray, np.ndarray], cfg: FeaturizerConfig
) -> tuple[np.ndarray, np.ndarray]:
    """The crc32 featurizer's events at positions [lo, hi) (see `span_events`)."""
    cp, cb = _char_events(norm[lo : hi + max(cfg.char_ngrams) - 1], cfg)
    word_starts, word_ends = words
    j0, j1 = (int(j) for j in np.searchsorted(word_starts, [lo, hi]))
    j2 = min(len(word_starts), j1 + max(cfg.word_ngrams) - 1)
    read = [norm[a:b].encode() for a, b in zip(word_starts[j0:j2].tolist(), word_ends[j0:j2].tolist(), strict=True)]
    wp, wb = _ngram_events(read, word_starts[j0:j2], j1 - j0, cfg)
    inside = cp < hi - lo
    pos, buckets = np.concatenate([cp[inside] + lo, wp]), np.concatenate([cb[inside], wb])
    order = np.argsort(pos, kind="stable")  # as norm_events: at one position the char n-grams, then the words'
    return pos[order], buckets[order]


def bag(buckets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sparse binary, L2-normalised vector of one span: (unique buckets (U,), values (U,) = 1 / sqrt(U)).

    NOTE: presence, not counts: a frequent n-gram (" th") must not grow with the span's length, or a long
    benign page outscores a short attack.
    """
    idx = np.unique(buckets)
    return idx.astype(np.int64), np.full(len(idx), 1.0 / np.sqrt(max(1, len(idx))))
