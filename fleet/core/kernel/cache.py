"""Paged KV storage for one session: a block table over ref-counted, copy-on-write blocks.

A block holds `block_size` consecutive absolute positions, [b*BS, (b+1)*BS), for every layer:
one array [3, n_layers, n_kv_heads, block_size, head_dim] = (K post-RoPE, Kraw pre-RoPE, V).
Blocks are shared by `fork` (ref_cnt += 1) and by PrefixKV adoption/export (`external`); any
write into a shared block copies it first, so a writer never changes what another holder sees.
Rows past the session's length inside its last block are stale; attention masks them.
"""

from __future__ import annotations

from typing import Any

from fleet.core.kernel.types import K_POST, K_RAW, V_IDX


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

    def prepare(self, lo: int, hi: int) -> list[Block]:
        """The block table a write of positions [lo, hi) will leave, positions past `hi` dropped:
        the table's blocks before lo's, a writable copy of each shared block holding [lo, hi), zeroed
        blocks past the table. Allocates (this can fail: out of memory) but changes nothing here;
        `install` then swaps it in without allocating.
        """
        BS, first, num_blocks = self.block_size, lo // self.block_size, -(-hi // self.block_size)
        table = self.blocks[:first]
        table += [Block(self.ops.copy(b.kv)) if b.shared else b for b in self.blocks[first:num_blocks]]
        while len(table) < num_blocks:
            table.append(self._new_block())
        assert len(table) * BS >= hi
        return table

    def install(self, table: list[Block]) -> None:
        """Make `table` (from `prepare`) this session's block table: the blocks it no longer holds
        (dropped, or replaced by a copy) have their ref counts go down. Allocates nothing."""
        kept = {id(b) for b in table}
        for blk in self.blocks:
            if id(blk) not in kept:
                blk.ref_cnt -= 1
        self.blocks = table

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

    def window(self, p0: int, p1: int, num_blocks: int) -> KVWindow:
        """A contiguous working copy of positions [0, num_blocks*BS) for a forward pass that
        writes positions [p0, p1): K and V of the blocks before p0 are copied in once (not once
        per tile and layer); everything else reads as zeros, as blocks past the table do.
        The blocks stay the source of truth: `KVWindow.commit` writes [p0, p1) back."""
        return KVWindow(self, p0, p1, num_blocks)

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


class KVWindow:
    """Per-call contiguous K/Kraw/V [3, L, KV, num_blocks*BS, hd] mirroring the block table.

    Every row a tile reads holds the same bytes the blocks hold at that moment (copied prefix
    blocks, rows written by earlier tiles of this call, zeros), so reading a view of it is the
    same arithmetic as gathering the blocks; only the copying is gone.
    """

    __slots__ = ("kv", "p0", "p1", "paged")

    def __init__(self, paged: PagedKV, p0: int, p1: int, num_blocks: int) -> None:
        BS = paged.block_size
        self.paged, self.p0, self.p1 = paged, p0, p1
        self.kv = paged.ops.zeros((3, paged.n_layers, paged.n_kv, num_blocks * BS, paged.head_dim))
        for b in range(min(-(-p0 // BS), len(paged.blocks), num_blocks)):  # blocks holding [0, p0)
            src, dst = paged.blocks[b].kv, self.kv[:, :, :, b * BS : (b + 1) * BS]  # [3, L, KV, BS, hd]
            dst[K_POST] = src[K_POST]
            dst[V_IDX] = src[V_IDX]  # Kraw is never read during a forward pass

    def write(self, l: int, pos0: int, lo: int, hi: int, k: Any, kraw: Any, v: Any) -> None:
        """Rows for positions [lo, hi) of layer l from tile arrays [KV, T, hd] (slot 0 = pos0)."""
        s = slice(lo - pos0, hi - pos0)
        self.kv[K_POST, l, :, lo:hi] = k[:, s]
        self.kv[K_RAW, l, :, lo:hi] = kraw[:, s]
        self.kv[V_IDX, l, :, lo:hi] = v[:, s]

    def read(self, l: int, num_keys: int) -> tuple[Any, Any]:
        """K (post-RoPE) and V of layer l over positions [0, num_keys): views [KV, num_keys, hd]."""
        return self.kv[K_POST, l, :, :num_keys], self.kv[V_IDX, l, :, :num_keys]

    def commit(self) -> None:
        """Write positions [p0, p1) back into the (writable) blocks: one copy per block."""
        self.paged.put_rows(self.p0, self.kv[:, :, :, self.p0 : self.p1])
