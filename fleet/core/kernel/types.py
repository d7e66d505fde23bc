"""Result and exchange types of the kernel: eviction and memory reports, exported prefixes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Index of each tensor inside a block array [3, n_layers, n_kv_heads, block_size, head_dim].
K_POST, K_RAW, V_IDX = 0, 1, 2


@dataclass(frozen=True, slots=True)
class EvictReport:
    """What an eviction did, and what it can honestly claim.

    Attributes:
        mode: "exact" or "reposition".
        start, length: the evicted span [start, start + length) in positions before the eviction.
        tail: the span reached the end of the session (write-time eviction).
        num_evicted: tokens dropped (== length).
        num_recomputed: survivors re-derived from their token ids ("exact" mode).
        num_rerotated: survivors whose key was re-rotated from Kraw ("reposition" mode).
        exact: True when the cache is, by construction, bit-identical to a session that never saw
            the span (tail eviction; "exact" mode; "reposition" on a 1-layer model), each only when
            no earlier reposition's survivors sit before the span (`Session.num_exact_tokens`). False
            means some layer >= 1 state still carries a span: measure the divergence.
        invariant_delta: max|K[i] - RoPE(Kraw[i], i)| over re-rotated rows (0.0 expected), or
            None when nothing was re-rotated.
        logits_fresh: `last_logits` was re-derived; False after a non-tail "reposition" (the next
            append returns fresh logits; `generate` re-derives them itself), and after an eviction
            that left no token (there are no logits).
    """

    mode: str
    start: int
    length: int
    tail: bool
    num_evicted: int
    num_recomputed: int
    num_rerotated: int
    exact: bool
    invariant_delta: float | None
    logits_fresh: bool


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """KV bytes a session holds. `bytes_shared` counts blocks also referenced elsewhere
    (ref_cnt > 1, adopted from or exported to a PrefixKV); `bytes_alone` the rest."""

    bytes_alone: int
    bytes_shared: int
    num_blocks: int
    num_shared_blocks: int
    num_tokens: int
    block_bytes: int

    @property
    def bytes_total(self) -> int:
        return self.bytes_alone + self.bytes_shared


@dataclass(frozen=True, slots=True)
class PrefixKV:
    """A block-aligned, read-only KV prefix that another session (or process) can adopt zero-copy.

    Attributes:
        tokens: the prefix token ids (len == num_blocks * block_size).
        block_size: tokens per block.
        blocks: one float32 array per block, shape [3, n_layers, n_kv_heads, block_size, head_dim]
            holding (K post-RoPE, Kraw pre-RoPE, V); read-only.
        model_id: the producing kernel's `model_id`; adoption by another model is refused.
    """

    tokens: tuple[int, ...]
    block_size: int
    blocks: tuple[np.ndarray, ...]
    model_id: str

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.blocks)

    def truncate(self, num_blocks: int) -> PrefixKV:
        """The first `num_blocks` blocks as a new PrefixKV (views, no copy)."""
        n = max(0, min(num_blocks, self.num_blocks))
        return PrefixKV(self.tokens[: n * self.block_size], self.block_size, self.blocks[:n], self.model_id)


def max_abs_delta(a: Any, b: Any) -> float:
    """max|a - b| in float64 (inf when shapes differ, nan propagates)."""
    x, y = np.asarray(a), np.asarray(b)
    if x.shape != y.shape:
        return float("inf")
    if x.size == 0 or (x.dtype == y.dtype and np.array_equal(x, y)):
        return 0.0  # fast path: bit-identical arrays (no float64 widening of large caches)
    return float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
