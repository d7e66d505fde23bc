"""Paged KV storage for one session: a block table over ref-counted, copy-on-write blocks.

A block holds `block_size` consecutive absolute positions, [b*BS, (b+1)*BS), for every layer:
one array [3, n_layers, n_kv_heads, block_size, head_dim] = (K post-RoPE, Kraw pre-RoPE, V).
Blocks are shared by `fork` (ref_cnt += 1) and by PrefixKV adoption/export (`external`); any
write into a shared block copies it first, so a writer never changes what another holder sees.
Rows past the session's length inside its last block are stale; attention masks them.
"""

from __future__ import annotations

from typing import Any

from fleet.kernel.types import K_POST, K_RAW, V_IDX


class Block:
    """One cache block. `external`: also visible outside this kernel's ref counts (read-only)."""

    __slots__ = ("kv", "ref_cnt", "external")

    def __init__(self, kv: Any, external: bool = False) -> None:
        self.kv = kv  # [3, L, KV, BS, hd]
        self.ref_cnt = 1
        self.external = external

    @property
    def shared(self) -> bool:
        return self.ref_cnt > 1 or self.external


class PagedKV:
    """The block table of one session plus the row-level reads and writes the forward pass needs."""

    def __init__(self, ops: Any, shape: tuple[int, int, int, int], blocks: list[Block] | None = None) -> None:
        self.ops = ops
        self.n_layers, self.n_kv, self.block_size, self.head_dim = shape
        self.blocks: list[Block] = blocks or []
        self._zero: Any = None

    # -- allocation, sharing, copy-on-write --
    def _new_block(self) -> Block:
        return Block(self.ops.zeros((3, self.n_layers, self.n_kv, self.block_size, self.head_dim)))

    def ensure(self, num_tokens: int) -> None:
        """Allocate zeroed blocks until positions [0, num_tokens) are covered."""
        while len(self.blocks) * self.block_size < num_tokens:
            self.blocks.append(self._new_block())

    def make_writable(self, lo: int, hi: int) -> None:
        """Copy-on-write every shared block overlapping positions [lo, hi)."""
        for b in range(lo // self.block_size, (hi - 1) // self.block_size + 1):
            blk = self.blocks[b]
            if blk.shared:
                blk.ref_cnt -= 1
                self.blocks[b] = Block(self.ops.copy(blk.kv))

    def fork(self) -> PagedKV:
        for blk in self.blocks:
            blk.ref_cnt += 1
        return PagedKV(
            self.ops, (self.n_layers, self.n_kv, self.block_size, self.head_dim), list(self.blocks)
        )

    def truncate(self, num_tokens: int) -> None:
        """Drop the blocks wholly past `num_tokens` (their ref counts go down)."""
        keep = -(-num_tokens // self.block_size)
        for blk in self.blocks[keep:]:
            blk.ref_cnt -= 1
        del self.blocks[keep:]

    def release(self) -> None:
        self.truncate(0)

    # -- row I/O for the forward pass --
    def write(self, l: int, pos0: int, lo: int, hi: int, k: Any, kraw: Any, v: Any) -> None:
        """Store rows for positions [lo, hi) of layer l; k/kraw/v are tile arrays [KV, T, hd] whose
        slot 0 is position pos0 (k post-RoPE, kraw pre-RoPE)."""
        BS, p = self.block_size, lo
        while p < hi:
            b, r = divmod(p, BS)
            n = min(hi - p, BS - r)
            kv = self.blocks[b].kv  # [3, L, KV, BS, hd]
            s = slice(p - pos0, p - pos0 + n)
            kv[K_POST, l, :, r : r + n] = k[:, s]
            kv[K_RAW, l, :, r : r + n] = kraw[:, s]
            kv[V_IDX, l, :, r : r + n] = v[:, s]
            p += n

    def read(self, l: int, num_blocks: int) -> tuple[Any, Any]:
        """K (post-RoPE) and V of layer l over blocks [0, num_blocks): each [KV, num_blocks*BS, hd].
        Blocks past the table read as zeros (always masked)."""
        if self._zero is None:
            self._zero = self.ops.zeros((3, self.n_layers, self.n_kv, self.block_size, self.head_dim))
        parts = [self.blocks[b].kv if b < len(self.blocks) else self._zero for b in range(num_blocks)]
        return (self.ops.cat([p[K_POST, l] for p in parts], 1), self.ops.cat([p[V_IDX, l] for p in parts], 1))

    def rows(self, lo: int, hi: int) -> Any:
        """All tensors for positions [lo, hi): [3, L, KV, hi-lo, hd] (a copy)."""
        BS, parts, p = self.block_size, [], lo
        while p < hi:
            b, r = divmod(p, BS)
            n = min(hi - p, BS - r)
            parts.append(self.blocks[b].kv[:, :, :, r : r + n])
            p += n
        return self.ops.cat(parts, 3)

    def put_rows(self, lo: int, data: Any) -> None:
        """Write data [3, L, KV, m, hd] at positions [lo, lo+m) (blocks must be writable)."""
        BS, m, p = self.block_size, data.shape[3], lo
        while p < lo + m:
            b, r = divmod(p, BS)
            n = min(lo + m - p, BS - r)
            self.blocks[b].kv[:, :, :, r : r + n] = data[:, :, :, p - lo : p - lo + n]
            p += n
