"""The learned layer: hashed n-grams + logistic regression, scored over sliding windows (CPU, numpy).

The model ships inside the package (`model/injection_lr.npz` weights, `model/injection_lr.json`
featurizer, threshold and corpus provenance) and is reproduced by `scripts/train_detector.py`.
Nothing is downloaded at run time.

A long tool result is scored window by window and the strongest window wins, because an injection
is a short span inside an otherwise ordinary page: averaged over the whole page it would fade.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import numpy as np

from fleet.core.quarantine.features import FeaturizerConfig, bag, feature_events, normalised, span_events

MODEL_NAME = "injection_lr"
SPAN_WINDOWS = 32  # windows scored at once (about 8 KiB of text at the shipped 512-char windows; 64 cost ~1 MB more)


@dataclass(frozen=True, slots=True)
class LearnedModel:
    """Weights (num_buckets,), bias, featurizer, window and the validation-chosen threshold."""

    weights: np.ndarray
    bias: float
    featurizer: FeaturizerConfig
    window_chars: int
    threshold: float
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.weights.shape == (self.featurizer.num_buckets,), "one weight per bucket"
        assert self.window_chars > 0 and 0.0 <= self.threshold <= 1.0

    def window_logits(self, text: str | bytes | bytearray | memoryview) -> np.ndarray:
        """Logit of every window of `text` (at least one: an empty text scores the bias alone).

        Returns:
            (num_windows,) float64: w . bag(window) + bias, bag = binary L2-normalised (features.bag).
        """
        norm = normalised(text, self.featurizer)
        starts = window_starts(len(norm), self.window_chars)  # (num_windows,)
        # NOTE: SPAN_WINDOWS windows at a time, from the events of their span of text only: a long text's arrays
        # stay the size of one span (a fresh process judging 1 MiB peaked at 397 MB RSS before, 54 MB after, issue
        # #28). Each window sums the same events in the same order, so the logits are bit-identical.
        groups = [(i, min(i + SPAN_WINDOWS, len(starts))) for i in range(0, len(starts), SPAN_WINDOWS)]
        spans = [(int(starts[i]), int(starts[j - 1]) + self.window_chars) for i, j in groups]
        out = np.empty(len(starts))
        for (i, j), (pos, buckets) in zip(groups, span_events(norm, self.featurizer, spans), strict=True):
            out[i:j] = self._logits(starts, i, j, pos, buckets)
        return out

    def _logits(self, starts: np.ndarray, i0: int, i1: int, pos: np.ndarray, buckets: np.ndarray) -> np.ndarray:
        """Logits of windows i0..i1-1 of `starts` from the events (E,) of their span, in position order.

        NOTE: vectorised (issue #28): an event counts in a window's bag when it is the first of its bucket
        there, i.e. the previous event of its bucket lies before the window's start (one before the span does:
        it reads as none). An event sits in at most three windows (stride window // 2, plus the last one flush
        with the end); pass o adds each event to its first window + o, as the whole text's loop did.
        """
        prev = previous_of_bucket(pos, buckets)
        first = np.searchsorted(starts, pos - self.window_chars, side="right")  # first window holding the event
        last = np.minimum(np.searchsorted(starts, pos, side="right"), i1) - 1
        fresh = np.maximum(np.searchsorted(starts, prev, side="right"), i0)  # first window after the previous one
        sums, sizes = np.zeros(i1 - i0), np.zeros(i1 - i0)
        w = self.weights[buckets].astype(np.float64)
        for o in range(3):
            i = first + o
            ok = (i <= last) & (i >= fresh)
            sums += np.bincount(i[ok] - i0, weights=w[ok], minlength=i1 - i0)
            sizes += np.bincount(i[ok] - i0, minlength=i1 - i0)
        out: np.ndarray = sums / np.sqrt(np.maximum(sizes, 1.0)) + self.bias
        return out

    def window_logits_reference(self, text: str | bytes | bytearray | memoryview) -> np.ndarray:
        """The loop `window_logits` must equal: each window's bag built one by one (`features.bag`)."""
        norm, pos, buckets = feature_events(text, self.featurizer)
        starts = window_starts(len(norm), self.window_chars)
        lo = np.searchsorted(pos, starts, side="left")
        hi = np.searchsorted(pos, starts + self.window_chars, side="left")
        out = np.empty(len(starts))
        for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
            idx, val = bag(buckets[a:b])
            out[i] = float(self.weights[idx] @ val) + self.bias
        return out

    def score(self, text: str | bytes | bytearray | memoryview) -> float:
        """P(injection) of the strongest window, in [0, 1]."""
        z = float(np.max(self.window_logits(text)))
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0

    def digest(self) -> str:
        """sha256 of what decides a score: the weights as shipped (float16), bias, featurizer, window, threshold."""
        h = hashlib.sha256(self.weights.astype(np.float16).tobytes())
        h.update(
            json.dumps([self.bias, self.featurizer.to_dict(), self.window_chars, self.threshold]).encode()
        )
        return h.hexdigest()

    def save(self, stem: str) -> None:
        """Write `<stem>.npz` (float16 weights) and `<stem>.json` (everything else)."""
        np.savez_compressed(f"{stem}.npz", weights=self.weights.astype(np.float16))
        doc = {
            "bias": self.bias,
            "featurizer": self.featurizer.to_dict(),
            "window_chars": self.window_chars,
            "threshold": self.threshold,
            "meta": self.meta,
        }
        with open(f"{stem}.json", "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True, ensure_ascii=False)
            f.write("\n")

    @classmethod
    def from_parts(cls, weights: np.ndarray, doc: dict[str, Any]) -> LearnedModel:
        return cls(
            weights.astype(np.float32),
            float(doc["bias"]),
            FeaturizerConfig.from_dict(doc["featurizer"]),
            int(doc["window_chars"]),
            float(doc["threshold"]),
            dict(doc.get("meta", {})),
        )


def previous_of_bucket(pos: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """(E,) int64: the position of the previous event of the same bucket (-1: none), for events (E,) in
    position order.

    NOTE: one sort of the values bucket << shift | index (numpy sorts values with SIMD; an argsort of the same
    keys took about 3x as long, and 32-bit keys, where they fit, sort in 2/3 of the time of 64-bit ones, issue
    #28): neighbours in it are the same bucket's events in position order.
    """
    shift = max(1, (len(pos) - 1).bit_length())  # the index's bits
    dt = np.uint32 if len(pos) and shift + int(buckets.max()).bit_length() <= 32 else np.uint64
    keys = np.sort(np.left_shift(buckets.astype(dt), shift) | np.arange(len(pos), dtype=dt))  # (E,)
    order = (keys & dt((1 << shift) - 1)).astype(np.int64)
    same = (keys[1:] >> dt(shift)) == (keys[:-1] >> dt(shift))
    prev = np.full(len(pos), -1, dtype=np.int64)
    prev[order[1:][same]] = pos[order[:-1][same]]
    return prev


def window_starts(length: int, window: int) -> np.ndarray:
    """Starts of windows of `window` chars, stride window // 2, the last one flush with the end."""
    if length <= window:
        return np.zeros(1, dtype=np.int64)
    stride = max(1, window // 2)
    starts = np.arange(0, length - window + 1, stride, dtype=np.int64)
    return starts if starts[-1] == length - window else np.append(starts, length - window)


@lru_cache(maxsize=4)
def load_model(name: str = MODEL_NAME) -> LearnedModel:
    """The shipped model `name` from `fleet/core/quarantine/model/` (cached: it is read-only)."""
    root = resources.files("fleet.core.quarantine") / "model"
    doc = json.loads((root / f"{name}.json").read_text())
    with resources.as_file(root / f"{name}.npz") as path, np.load(path) as npz:
        weights = np.asarray(npz["weights"])
    return LearnedModel.from_parts(weights, doc)
