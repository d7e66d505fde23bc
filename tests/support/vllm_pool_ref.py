"""A reference model of vLLM v1's block pool and KV cache manager, for differential tests of the stand-in's prefix
cache (fleet/app/testkit/sim_vllm/cache.py). One full-attention KV group, no connector, no speculative tokens.

It follows vLLM's code, not the stand-in's:

- `BlockPool`: `num_gpu_blocks` physical blocks, block 0 the null block (never used); one free queue in eviction
  order, every block free and unhashed at start; `get_new_blocks` pops from the queue's front and evicts a popped
  block that still carries a hash (`_maybe_evict_cached_block`: one BlockRemoved); `touch` takes a hit block out of
  the queue; `free_blocks` puts the blocks whose ref_cnt reaches 0 back, unhashed ones at the front (`prepend_n`),
  hashed ones at the tail (`append_n`), in the order given; `cache_full_blocks` hashes the newly full blocks and
  emits one BlockStored for them. Blocks are not de-duplicated: a hash can map to two physical blocks, and a hit
  takes the first one stored (`BlockHashToBlockMap.get_one_block`).
- `KVCacheManager`: `get_computed_blocks` finds the leading run of cached blocks, capped at `num_tokens - 1`
  tokens (a fully cached prompt recomputes its last block); `allocate_slots` touches the hit, takes new blocks for
  every slot the chunk needs (a partial last block included) or answers None when they do not fit, and caches the
  blocks full after the chunk; `free` frees a request's blocks in reverse order (its tail is evicted first).

Events are (kind, hashes, parent) tuples with the 32-byte digests the stand-in keys its cache by.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

Event = tuple[str, tuple[bytes, ...], bytes | None]


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_gpu_blocks: int) -> None:
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])  # front first
        self.cached: dict[bytes, dict[int, Block]] = {}
        self.events: list[Event] = []

    def num_free(self) -> int:
        return len(self.free)

    def get_cached_block(self, h: bytes) -> Block | None:
        copies = self.cached.get(h)
        return next(iter(copies.values())) if copies else None

    def get_new_blocks(self, n: int) -> list[Block]:
        assert n <= len(self.free)
        out = []
        for _ in range(n):
            _, b = self.free.popitem(last=False)
            if b.block_hash is not None:  # _maybe_evict_cached_block
                copies = self.cached[b.block_hash]
                del copies[b.block_id]
                if not copies:
                    del self.cached[b.block_hash]
                self.events.append(("removed", (b.block_hash,), None))
                b.block_hash = None
            b.ref_cnt += 1
            out.append(b)
        return out

    def touch(self, blocks: Sequence[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free[b.block_id]
            b.ref_cnt += 1

    def free_blocks(self, ordered: Sequence[Block]) -> None:
        for b in ordered:
            b.ref_cnt -= 1
        freeable = [b for b in ordered if b.ref_cnt == 0]
        fresh = [b for b in freeable if b.block_hash is None]
        for b in reversed(fresh):  # prepend_n: the first of them ends at the very front
            self.free[b.block_id] = b
            self.free.move_to_end(b.block_id, last=False)
        for b in freeable:
            if b.block_hash is not None:
                self.free[b.block_id] = b

    def cache_full_blocks(self, blocks: list[Block], hashes: Sequence[bytes], num_cached: int, num_full: int) -> None:
        if num_cached >= num_full:
            return
        new = []
        for i in range(num_cached, num_full):
            b = blocks[i]
            if b.block_hash is not None:
                continue
            b.block_hash = hashes[i]
            self.cached.setdefault(hashes[i], {})[b.block_id] = b
            new.append(hashes[i])
        self.events.append(("stored", tuple(new), hashes[num_cached - 1] if num_cached else None))

    def reset_prefix_cache(self) -> bool:
        if len(self.free) != len(self.blocks) - 1:
            return False
        self.cached.clear()
        for b in self.blocks:
            b.block_hash = None
        self.events.append(("cleared", (), None))
        return True


@dataclass(slots=True)
class Request:
    request_id: str
    block_hashes: list[bytes]  # the prompt's full blocks
    num_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, cap_hit: bool = True) -> None:
        self.pool, self.block_size = BlockPool(num_gpu_blocks), block_size
        self.cap_hit = cap_hit  # False: the whole prompt may hit (not vLLM; to isolate other differences)

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        max_blocks = (req.num_tokens - (1 if self.cap_hit else 0)) // self.block_size
        hit: list[Block] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        return hit, len(hit) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: Sequence[Block] = ()) -> bool:
        B = self.block_size
        num_computed = req.num_computed_tokens + len(hit) * B
        num_required = -(-(num_computed + num_new_tokens) // B)
        num_new_blocks = num_required - len(req.blocks) - len(hit)
        num_evictable_hit = sum(b.ref_cnt == 0 for b in hit)
        if num_new_blocks + num_evictable_hit > self.pool.num_free():
            return False
        if not req.blocks:  # save_new_computed_blocks: a new request's hit counts as cached already
            req.num_cached_blocks = len(hit)
        self.pool.touch(hit)
        req.blocks += hit
        req.blocks += self.pool.get_new_blocks(max(num_new_blocks, 0))
        num_full = min(num_computed + num_new_tokens, req.num_tokens) // B
        num_full = min(num_full, len(req.block_hashes))
        self.pool.cache_full_blocks(req.blocks, req.block_hashes, req.num_cached_blocks, num_full)
        req.num_cached_blocks = max(req.num_cached_blocks, num_full)
        return True

    def free(self, req: Request) -> None:
        self.pool.free_blocks(list(reversed(req.blocks)))
        req.blocks, req.num_cached_blocks = [], 0
