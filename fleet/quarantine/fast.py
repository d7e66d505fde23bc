"""The fast layer (issue #28): hashed n-gram embeddings averaged per window -> one hidden layer -> logit.

numpy only at run time (the model is trained by `scripts/train_fast.py`, with torch, offline). A text is
read on `unquoted_view`, cut into blocks of `window_chars // 2` characters; a window is two adjacent
blocks (so windows overlap by half), and the strongest window wins:

    normalised text   i g n o r e _ a l l _ p r e v i o u s ...
    events            char 3/4/5-grams at their first character, word 1/2-grams at their first word
    block k           events whose position is in [k * half, (k + 1) * half)
    window k          blocks k and k + 1:  mean of the events' embeddings -> relu(. W1 + b1) . w2 + b2

The whole text is featurised and scored with array operations: every n-gram hash is a difference of one
prefix sum of code points times powers of an odd base (mod 2^64), and every window's sum of embeddings is
two `np.add.reduceat` block sums added; no Python loop runs per window or per n-gram
(`window_logits_reference` is the loop it must equal).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, Protocol

import numpy as np

from fleet.quarantine.detector import unquoted_view

FAST_NAME = "injection_fast"
_BASE = 0x100000001B3  # odd, so invertible mod 2^64
_INV = pow(_BASE, -1, 1 << 64)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)  # splitmix64 finaliser
_ASCII_WORD = np.array([chr(c).isalnum() or c == 95 for c in range(128)])
_GROUP_BLOCKS = 64  # blocks whose events are gathered at once (~16 KiB of text: a few MB of rows)


@dataclass(frozen=True, slots=True)
class FastConfig:
    """The featurizer and the network's shape."""

    num_buckets: int = 1 << 17
    dim: int = 32
    hidden: int = 32
    char_ngrams: tuple[int, ...] = (3, 4, 5)
    word_ngrams: tuple[int, ...] = (1, 2)
    window_chars: int = 512
    max_chars: int = 1 << 20  # NOTE: longer inputs are scored on their first max_chars

    def __post_init__(self) -> None:
        assert self.num_buckets > 0 and self.num_buckets & (self.num_buckets - 1) == 0, (
            "num_buckets: a power of 2"
        )
        assert self.dim > 0 and self.hidden > 0, "dim, hidden > 0"
        assert all(n >= 1 for n in self.char_ngrams + self.word_ngrams), "n-gram sizes >= 1"
        assert self.window_chars >= 2 and self.window_chars % 2 == 0, "window_chars: even, >= 2"

    @property
    def half(self) -> int:
        return self.window_chars // 2

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FastConfig:
        return cls(
            int(d["num_buckets"]),
            int(d["dim"]),
            int(d["hidden"]),
            tuple(d["char_ngrams"]),
            tuple(d["word_ngrams"]),
            int(d["window_chars"]),
            int(d["max_chars"]),
        )


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


class Hashing(Protocol):
    """What `events` reads of a config (FastConfig, or the learned layer's FeaturizerConfig)."""

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
    w = _word_mask(codes)
    edge = np.diff(np.concatenate(([False], w, [False])).astype(np.int8))
    ws, we = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1)  # word starts, ends (exclusive)
    for k in cfg.word_ngrams:
        m = max(0, len(ws) - k + 1)
        out.append((ws[:m], span_hash(ws[:m], we[k - 1 : k - 1 + m], (1 << 40) | k)))
    return out


def block_sums(norm: str, emb: np.ndarray, cfg: FastConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per block of `cfg.half` characters: the sum of its events' embeddings and how many there are.

    Returns:
        (sums (B, dim) float32, counts (B,) int64), B = max(1, ceil(len(norm) / half)).
    """
    nb = max(1, -(-len(norm) // cfg.half))
    sums = np.zeros((nb, emb.shape[1]), dtype=np.float32)
    counts = np.zeros(nb, dtype=np.int64)
    bounds = np.arange(nb + 1, dtype=np.int64) * cfg.half
    for pos, buckets in events(norm, cfg):
        cut = np.searchsorted(pos, bounds)  # (nb + 1,) the event index where each block starts
        n = np.diff(cut)  # (nb,) events per block
        counts += n
        for g0 in range(0, nb, _GROUP_BLOCKS):  # NOTE: bounds the transient (events x dim) rows
            g1 = min(nb, g0 + _GROUP_BLOCKS)
            full = np.flatnonzero(n[g0:g1]) + g0  # reduceat needs strictly increasing, in-range starts
            if len(full):
                # NOTE: np.take is several times faster than emb[...] here
                rows = np.take(emb, buckets[cut[g0] : cut[g1]], axis=0)
                sums[full] += np.add.reduceat(rows, cut[full] - cut[g0], axis=0)
    return sums, counts


@dataclass(frozen=True, slots=True)
class FastModel:
    """Embeddings (num_buckets, dim), hidden layer (dim, hidden) + (hidden,), output (hidden,) + bias."""

    emb: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: float
    cfg: FastConfig
    threshold: float
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        c = self.cfg
        assert self.emb.shape == (c.num_buckets, c.dim) and self.w1.shape == (c.dim, c.hidden), "shapes"
        assert self.b1.shape == (c.hidden,) and self.w2.shape == (c.hidden,), "shapes"
        assert 0.0 <= self.threshold <= 1.0, "threshold in [0, 1]"

    def _head(self, mean: np.ndarray) -> np.ndarray:
        """(W, dim) window means -> (W,) logits."""
        out: np.ndarray = np.maximum(mean @ self.w1 + self.b1, 0.0) @ self.w2 + self.b2
        return out

    def window_logits_norm(self, norm: str) -> np.ndarray:
        """Logit of every window of an already viewed text (`unquoted_view`), vectorised.

        Returns:
            (num_windows,) float32; one window when the text fits in one block.
        """
        sums, counts = block_sums(norm[: self.cfg.max_chars], self.emb, self.cfg)
        if len(counts) > 1:
            sums, counts = sums[:-1] + sums[1:], counts[:-1] + counts[1:]
        return self._head(sums / np.maximum(counts, 1)[:, None].astype(np.float32))

    def window_logits(self, text: str | bytes | bytearray | memoryview) -> np.ndarray:
        """Logit of every window of `text` (read on `unquoted_view`)."""
        return self.window_logits_norm(unquoted_view(text))

    def score(self, text: str | bytes | bytearray | memoryview) -> float:
        """P(injection) of the strongest window, in [0, 1]."""
        z = float(np.max(self.window_logits(text)))
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def digest(self) -> str:
        """sha256 of everything that decides a score (the weights as shipped, float16)."""
        h = hashlib.sha256()
        for a in (self.emb, self.w1, self.b1, self.w2):
            h.update(a.astype(np.float16).tobytes())
        h.update(json.dumps([self.b2, self.cfg.to_dict(), self.threshold]).encode())
        return h.hexdigest()

    def save(self, stem: str) -> None:
        """Write `<stem>.npz` (float16 weights) and `<stem>.json` (config, bias, threshold, provenance)."""
        f16 = {k: getattr(self, k).astype(np.float16) for k in ("emb", "w1", "b1", "w2")}
        np.savez_compressed(f"{stem}.npz", **f16)
        doc = {"b2": self.b2, "config": self.cfg.to_dict(), "threshold": self.threshold, "meta": self.meta}
        with open(f"{stem}.json", "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True, ensure_ascii=False)
            f.write("\n")

    @classmethod
    def from_parts(cls, arrays: dict[str, np.ndarray], doc: dict[str, Any]) -> FastModel:
        # NOTE: shipped float16, held float32: reduceat over float16 rows into float32 is ~3x slower
        f32 = {k: arrays[k].astype(np.float32) for k in ("emb", "w1", "b1", "w2")}
        return cls(
            f32["emb"],
            f32["w1"],
            f32["b1"],
            f32["w2"],
            float(doc["b2"]),
            FastConfig.from_dict(doc["config"]),
            float(doc["threshold"]),
            dict(doc.get("meta", {})),
        )


def window_logits_reference(model: FastModel, norm: str) -> np.ndarray:
    """The loop `FastModel.window_logits_norm` must equal: each window's events gathered one by one."""
    cfg, norm = model.cfg, norm[: model.cfg.max_chars]
    evs = [(int(p), int(b)) for pos, bk in events(norm, cfg) for p, b in zip(pos, bk, strict=True)]
    nb = max(1, -(-len(norm) // cfg.half))
    spans = [(0, cfg.half)] if nb == 1 else [(k * cfg.half, (k + 2) * cfg.half) for k in range(nb - 1)]
    out = []
    for lo, hi in spans:
        rows = [model.emb[b].astype(np.float32) for p, b in evs if lo <= p < hi]
        mean = np.sum(rows, axis=0) / len(rows) if rows else np.zeros(cfg.dim, np.float32)
        out.append(float(model._head(mean[None, :])[0]))
    return np.asarray(out, dtype=np.float32)


@lru_cache(maxsize=4)
def load_fast(name: str = FAST_NAME) -> FastModel:
    """The shipped fast model `name` from `fleet/quarantine/model/` (cached: it is read-only)."""
    root = resources.files("fleet.quarantine") / "model"
    doc = json.loads((root / f"{name}.json").read_text())
    with resources.as_file(root / f"{name}.npz") as path, np.load(path) as npz:
        arrays = {k: np.asarray(npz[k]) for k in npz.files}
    return FastModel.from_parts(arrays, doc)
