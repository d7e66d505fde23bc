"""Numpy n-gram hashing for the fast default detector (issue #28): every n-gram of a text hashed at once.

The learned layer's model of issue #15 hashes word n-grams one by one in Python (crc32), which costs about as
much as the rest of the layer. Here every n-gram's hash is a difference of one prefix sum of code points times
powers of an odd base (mod 2^64), then mixed (splitmix64) into a bucket; no Python loop runs per n-gram:

    normalised text   i g n o r e _ a l l _ p r e v i o u s ...
    char n-grams      one event per start position and n          hash(a, b) = (P[b] - P[a]) * base^-a
    word n-grams      one event per first word (\\w runs)          P[i] = sum_{j<i} code[j] * base^j

`features.feature_events` uses it for `FeaturizerConfig(hashing="poly")` (scripts/train_fast.py trains on it).
No shipped model uses it yet: none trained on it beat rules + learned on validation (docs/quarantine_default.md).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fleet.core.quarantine.text import code_points

_BASE = 0x100000001B3  # odd, so invertible mod 2^64
_INV = pow(_BASE, -1, 1 << 64)
_MIX1, _MIX2 = (
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)  # splitmix64 finaliser
_ASCII_WORD = np.array([chr(c).isalnum() or c == 95 for c in range(128)])


def _mix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(30))
    h = h * _MIX1
    h = h ^ (h >> np.uint64(27))
    h = h * _MIX2
    out: np.ndarray = h ^ (h >> np.uint64(31))
    return out


def _powers(base: int, n: int) -> np.ndarray:
    """(n,) uint64: base^0 .. base^(n-1) mod 2^64."""
    p = np.full(n, base, dtype=np.uint64)
    p[0] = 1
    return np.cumprod(p, dtype=np.uint64)


def _word_mask(codes: np.ndarray) -> np.ndarray:
    """(L,) bool: the characters `\\w` matches (alphanumeric or "_")."""
    mask = np.zeros(len(codes), dtype=bool)
    low = codes < 128
    mask[low] = _ASCII_WORD[codes[low]]
    if not low.all():
        hi = codes[~low]
        uniq = np.unique(hi)
        isw = np.array([chr(int(c)).isalnum() for c in uniq], dtype=bool)
        mask[~low] = isw[np.searchsorted(uniq, hi)]
    return mask


def word_spans(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends (exclusive) of the `\\w+` runs of a text's code points (L,): (W,) int64 each."""
    edge = np.diff(np.concatenate(([False], _word_mask(codes), [False])).astype(np.int8))  # (L + 1,)
    return np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)


TEXT_CHUNK = 1 << 16  # characters read at once by `text_word_spans`


def text_word_spans(text: str) -> tuple[np.ndarray, np.ndarray]:
    """`word_spans` of a text's code points, as int32, reading TEXT_CHUNK characters at a time.

    NOTE: the mask is per character, so building it chunk by chunk gives the same runs; each chunk's edges are
    taken against the last character of the chunk before it, so a run crossing a chunk edge is one run. Only
    the spans are kept whole: a 1 MiB text no longer holds its code points (4 bytes each when it is not ASCII)
    nor a mask and its differences for every character (issue #28: the learned layer's peak judging 1 MiB fell
    by about 10 MB, then by 3 MB more). Positions fit int32: texts are cut at max_chars.
    """
    if len(text) <= TEXT_CHUNK:  # NOTE: one chunk, without the pieces' bookkeeping (a 4 KiB result)
        first, last = word_spans(code_points(text))
        return first.astype(np.int32), last.astype(np.int32)
    starts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    before = np.int8(0)  # the character before the chunk is a word character
    for a in range(0, len(text), TEXT_CHUNK):
        mask = _word_mask(code_points(text[a : a + TEXT_CHUNK])).view(np.int8)
        edge = np.diff(mask, prepend=before)  # (chunk,): edge[i] = mask[i] - mask[i - 1]
        starts.append(np.flatnonzero(edge == 1).astype(np.int32) + np.int32(a))
        ends.append(np.flatnonzero(edge == -1).astype(np.int32) + np.int32(a))
        before = mask[-1]
    if before:
        ends.append(np.array([len(text)], dtype=np.int32))
    return np.concatenate(starts), np.concatenate(ends)


class Hashing(Protocol):
    """What `events` reads of a config (the learned layer's `features.FeaturizerConfig`)."""

    @property
    def num_buckets(self) -> int: ...
    @property
    def char_ngrams(self) -> tuple[int, ...]: ...
    @property
    def word_ngrams(self) -> tuple[int, ...]: ...


def events(norm: str, cfg: Hashing) -> list[tuple[np.ndarray, np.ndarray]]:
    """The feature events of a normalised text, one (positions, buckets) pair per n-gram kind.

    Returns:
        [(positions (E_k,) int64 ascending, buckets (E_k,) int64)] for each char n, then each word n.
    """
    codes = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)  # (L,)
    n = len(codes)
    if n == 0:
        return []
    pw, ipw = _powers(_BASE, n + 1), _powers(_INV, n + 1)
    prefix = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(codes * pw[:n], out=prefix[1:])  # hash(a, b) = (prefix[b] - prefix[a]) * base^-a

    def span_hash(a: np.ndarray, b: np.ndarray, salt: int) -> np.ndarray:
        h = (prefix[b] - prefix[a]) * ipw[a] + np.uint64(salt)
        return (_mix(h) & np.uint64(cfg.num_buckets - 1)).astype(np.int64)

    out = []
    for k in cfg.char_ngrams:
        starts = np.arange(max(0, n - k + 1), dtype=np.int64)
        out.append((starts, span_hash(starts, starts + k, k)))
    ws, we = word_spans(codes)  # word starts, ends (exclusive)
    for k in cfg.word_ngrams:
        m = max(0, len(ws) - k + 1)
        out.append((ws[:m], span_hash(ws[:m], we[k - 1 : k - 1 + m], (1 << 40) | k)))
    return out
