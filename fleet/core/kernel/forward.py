"""The forward pass of a session's new tokens: tile by tile, layer-major in groups, into a KV window that
replaces the cache's rows only once everything that can fail has run (fleet/core/kernel/session.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fleet.core.kernel.pacing import checkpoint

if TYPE_CHECKING:
    from fleet.core.kernel.cache import KVWindow, PagedKV
    from fleet.core.kernel.kernel import Kernel

GROUP_TOKENS = 2048  # positions per layer-major group of tiles (bounds the working set)


def run_tiles(kernel: Kernel, kv: PagedKV, ids: np.ndarray, p0: int) -> np.ndarray:
    """Run tokens `ids` at positions [p0, p0+n) tile by tile; store their K/Kraw/V in place of
    whatever `kv` holds from p0 on (positions past p0+n are dropped); return logits after
    the last one. Tile t covers absolute positions [t*T, (t+1)*T).

    NOTE: all or nothing. Everything that can fail (the tiles, the logits, the allocations of
    `prepare`) runs before the block table changes: the tiles write a contiguous window, and a
    failure (out of memory) leaves the cache as it was. The exact evict used to truncate first
    and recompute after, so a failure left 50 of 200 tokens (found by review).
    """
    k, ops = kernel, kernel.ops
    T, BS, p1 = k.tile_size, k.block_size, p0 + len(ids)
    t0, t1 = p0 // T, (p1 - 1) // T
    win = kv.window(p0, p1, -(-(t1 + 1) * T // BS))  # the last tile's key blocks
    with ops.limit():
        for g0 in range(t0, t1 + 1, group(T)):
            x = tile_group(kernel, ids, p0, p1, range(g0, min(g0 + group(T), t1 + 1)), win)
        logits: np.ndarray = ops.logits(x[(p1 - 1) % T])  # [V]: the last token's row
    kv.install(kv.prepare(p0, p1))  # allocates first, then swaps the table
    win.commit()
    return logits


def group(T: int) -> int:
    """Tiles run layer by layer in groups of about GROUP_TOKENS positions (bounded memory)."""
    return max(1, GROUP_TOKENS // T)


def tile_group(kernel: Kernel, ids: np.ndarray, p0: int, p1: int, tiles: range, win: KVWindow) -> Any:
    """Run tiles t in `tiles` (positions [t*T, (t+1)*T)) through every layer, layer-major: each
    tile's ops keep their fixed shapes (a function of t alone), only their order changes, so the
    bits are those of one tile at a time. Returns the last tile's hidden states [T, dim]."""
    k, ops, T, BS = kernel, kernel.ops, kernel.tile_size, kernel.block_size
    spans = [(t * T, max(p0, t * T), min(p1, t * T + T)) for t in tiles]  # (pos0, lo, hi)
    xs = [ops.embed(ids[lo - p0 : hi - p0], lo - pos0, T) for pos0, lo, hi in spans]  # [T, dim] each
    for l in range(k.config.n_layers):
        checkpoint()  # the host may let another tenant's work run first (fleet/core/kernel/pacing.py)
        qs = []
        for x, (pos0, lo, hi) in zip(xs, spans, strict=True):
            # q [KV, G*T, hd]; k/kraw/v [KV, T, hd]; layer 0 from the token ids (slot-invariant)
            q, kk, kraw, v = ops.qkv(x, l, pos0, ids[lo - p0 : hi - p0], lo - pos0)
            win.write(l, pos0, lo, hi, kk, kraw, v)
            qs.append(q)
        # tile t attends over key positions [0, ceil((t+1)*T / BS) * BS): fixed by t alone
        os_ = [
            ops.attention(q, *win.read(l, -(-(pos0 + T) // BS) * BS), pos0)
            for q, (pos0, _, _) in zip(qs, spans, strict=True)
        ]
        for x, o in zip(xs, os_, strict=True):
            ops.mlp(x, l, o)  # in place
    return xs[-1]
