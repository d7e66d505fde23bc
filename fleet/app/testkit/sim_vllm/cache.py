"""The stand-in's block pool: a real prefix cache with vLLM's block hashing, LRU eviction and events.

`num_blocks` blocks hold full prompt blocks. A block is pinned while a running request holds it
(ref_cnt > 0) and cached-but-free once none does; new blocks take free slots first, then evict the
least recently used unpinned block (one BlockRemoved each). As in vLLM, a request's blocks are
released in reverse order, so of one request the tail blocks are evicted first and its prefix stays.
As in vLLM's BlockPool, blocks are physical and not de-duplicated: a block a request computes takes a block of its
own even when its hash is cached already (a fully cached prompt's last block, which vLLM recomputes), the hash then
maps to both copies, a hit takes the first one stored, and each copy is evicted, with its own BlockRemoved, in turn.

As in vLLM's KV cache manager, a request's blocks are cached as its prefill computes them: `allocate` pins its
prefix-cache hit when it is admitted, and `cache_blocks` caches the full blocks each scheduled chunk completes (one
BlockStored per request and step, vLLM's `cache_full_blocks`), so a long prompt is stored, and announced, over the
steps that compute it. Blocks a running request has still to compute are reserved: another request is admitted only
beside them. Events are queued and published with the engine step (`_flush`). Pure: the publisher is a callable, no
I/O here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.sched import Seq
from fleet.core.block_hash import HashConfig, chain, to_external


@dataclass(frozen=True, slots=True)
class StepResult:
    num_prompt_tokens: int
    num_cached_tokens: int
    num_new_blocks: int


class PrefixCache:
    """The cache side of one DP rank; implements `sched.BlockPool` for the scheduler."""

    def __init__(
        self,
        hash_cfg: HashConfig,
        num_blocks: int,
        loras: dict[str, str],
        publish: Callable[[list[Any]], None],
        max_num_batched_tokens: int | None = None,
    ) -> None:
        self.hash_cfg, self.num_blocks, self.loras = hash_cfg, num_blocks, loras
        self.max_num_batched_tokens = max_num_batched_tokens  # the instant path's chunk (None: one step)
        self._publish = publish
        self.cache: dict[bytes, list[int]] = {}  # full digest -> its blocks, the first stored first (hits take it)
        self.lru: OrderedDict[int, bytes] = OrderedDict()  # cached block id -> its digest, least recently freed first
        self.ref_cnt: dict[int, int] = {}  # block id -> running seqs holding it (pinned: never evicted)
        self._next_block_id = 0
        self.num_reserved = 0  # blocks the running seqs have still to compute (`cache_blocks`)
        self.pending: list[Any] = []
        self.queries = 0
        self.hits = 0
        # a preempted request's readmissions: prompt tokens computed again, less the cache's hits (vLLM does not
        # export these; the stand-in does, as sim:preempted_prefill_tokens_total, so a bench can count the work)
        self.preempted_prefill = 0

    def kv_usage(self) -> float:
        """vllm:kv_cache_usage_perc: blocks held by running requests / the pool (cached-but-free is free)."""
        return len(self.ref_cnt) / self.num_blocks

    def resident_external(self) -> list[int]:
        """The TRUE resident hashes (64-bit, as events carry them), for oracle checks."""
        return [to_external(d) for d in self.cache]

    def clear_blocks(self) -> None:
        """Drop every cached block (a reset or a restart); no event here."""
        self.cache.clear()
        self.lru.clear()

    def _step(
        self, token_ids: Sequence[int], lora: str | None, salt: str | None, report_full: bool, skip_cache: bool = False
    ) -> StepResult:
        """One request's prompt through the cache at once, alone (the instant path): admitted, its prefill computed in
        chunks of `max_num_batched_tokens`, each chunk's blocks published as one step's batch, then released.

        NOTE: with nothing pinned, the cache ends as the stand-in's original one-shot step left it (the demo's
        offline model replays it); before, a prompt longer than the budget went out in one batch."""
        seq = Seq(-1, token_ids, 1, 0.0, lora, salt, report_full, digests=self._digests(token_ids, lora, salt),
                  skip_cache=skip_cache)
        hit = self.allocate(seq)
        num_computed, todo = hit, max(len(token_ids) - hit, 1)
        while todo > 0:
            n = min(todo, self.max_num_batched_tokens or todo)
            num_computed, todo = num_computed + n, todo - n
            self.cache_blocks(seq, num_computed)
            self._flush()
        res = StepResult(len(token_ids), hit, len(seq.pinned) - hit // self.hash_cfg.block_size)
        self.free(seq)
        return res

    # sched.BlockPool
    def can_allocate(self, seq: Seq, alone: bool) -> bool:
        if alone:
            return True  # NOTE: a prompt larger than the pool runs alone, only its head cached
        hit = self._num_hit(seq)
        extra = sum(self.cache[d][0] not in self.ref_cnt for d in seq.digests[:hit]) + len(seq.digests) - hit
        return len(self.ref_cnt) + self.num_reserved + extra <= self.num_blocks

    def allocate(self, seq: Seq) -> int:
        """Admit the seq: pin its prefix-cache hit and reserve the blocks its prefill will compute. Returns the hit
        in tokens. The hit counts in `queries`/`hits` (vllm:prefix_cache_*_total) at a request's first admission only,
        as vLLM counts it; a preempted request's readmission goes to `preempted_prefill` instead."""
        digests, B = seq.digests, self.hash_cfg.block_size
        hit = self._num_hit(seq)
        seq.pinned = [self.cache[d][0] for d in digests[:hit]]  # vLLM's touch: the first copy of each
        for b in seq.pinned:
            self.ref_cnt[b] = self.ref_cnt.get(b, 0) + 1
        room = max(self.num_blocks - len(self.ref_cnt) - self.num_reserved, 0)
        seq.num_blocks_to_hold = hit + min(len(digests) - hit, room)  # all of them, unless it runs alone and big
        self.num_reserved += seq.num_blocks_to_hold - hit
        if seq.report_full and hit:  # vLLM's kv_cache_report_mode "full": the reused prefix, at admission
            self.pending.append(self._stored_event(seq.token_ids, digests, 0, hit, seq.lora, seq.cache_salt))
        if seq.num_cached_tokens < 0:
            if not seq.skip_cache:  # vLLM's get_computed_blocks returns before it counts a query for it
                self.queries += len(seq.token_ids)
                self.hits += hit * B
        else:
            self.preempted_prefill += len(seq.token_ids) - hit * B
        return hit * B

    def cache_blocks(self, seq: Seq, num_computed_tokens: int) -> None:
        """Cache the seq's full blocks up to `num_computed_tokens` (its position once the scheduled chunk is
        computed): each takes a block of its own (LRU-evicting unpinned ones once no slot is free), even one whose
        hash is cached already (vLLM does not de-duplicate), is pinned, and they go out as one BlockStored (vLLM's
        `KVCacheManager.allocate_slots` -> `cache_full_blocks`, at the step that schedules them)."""
        start = len(seq.pinned)
        upto = min(num_computed_tokens // self.hash_cfg.block_size, seq.num_blocks_to_hold)
        if upto <= start:
            return
        new = seq.digests[start:upto]
        self._evict(len(self.lru) + len(new) - self.num_blocks)
        for d in new:
            b, self._next_block_id = self._next_block_id, self._next_block_id + 1
            self.lru[b] = d
            self.cache.setdefault(d, []).append(b)
            self.ref_cnt[b] = 1
            seq.pinned.append(b)
        self.num_reserved -= len(new)
        self.pending.append(self._stored_event(seq.token_ids, seq.digests, start, len(new), seq.lora, seq.cache_salt))

    def free(self, seq: Seq) -> None:
        """Unpin the request's blocks and drop what it had still to compute; those no running request holds join
        the LRU end in reverse order, so the tail blocks are evicted first (vLLM's `KVCacheManager.free`)."""
        self.num_reserved -= seq.num_blocks_to_hold - len(seq.pinned)
        seq.num_blocks_to_hold = 0
        for b in reversed(seq.pinned):
            if self.ref_cnt.get(b, 0) > 1:
                self.ref_cnt[b] -= 1
            else:
                self.ref_cnt.pop(b, None)
                if b in self.lru:
                    self.lru.move_to_end(b)
        seq.pinned = []

    # internals
    def _digests(self, token_ids: Sequence[int], lora: str | None, salt: str | None) -> list[bytes]:
        lora_kv = (lora, self.loras[lora]) if lora else None
        return chain(self.hash_cfg, token_ids, lora=lora_kv, cache_salt=salt)

    def _num_hit(self, seq: Seq) -> int:
        """The seq's leading blocks in the cache, short of its last token; none for a request vLLM prefills whole
        (Seq.skip_cache).

        NOTE: vLLM's `KVCacheManager.get_computed_blocks` looks up at most `num_tokens - 1` tokens (prompt and any
        output a preempted request recomputes): the last token must be computed for its logits, and the hit is whole
        blocks, so a fully cached prompt of whole blocks hits all but its last block, recomputes it and stores it
        again (a BlockStored). The stand-in hit the whole prompt and computed one token."""
        if seq.skip_cache:
            return 0
        digests, hit = seq.digests, 0
        limit = min(len(digests), (len(seq.token_ids) + seq.num_output - 1) // self.hash_cfg.block_size)
        while hit < limit and digests[hit] in self.cache:
            hit += 1
        return hit

    def _evict(self, n: int) -> None:
        """Evict the `n` least recently used blocks no running request holds (vLLM's free queue, front first).

        NOTE: it listed every block not kept and took the first n, on every admission, n = 0 included: O(blocks
        cached) per request, so a stand-in slowed as its cache filled (bench/proxy_load.py's 65,536-block workers
        ran 2,640 requests/s straight to them in its first round and 688 in its eighth; this list was 2.8 ms of
        each request's CPU by the 14th). It walks from the front now, and stops once it has n."""
        if n <= 0:
            return
        gone: list[int] = []
        for b in self.lru:
            if b not in self.ref_cnt:
                gone.append(b)
                if len(gone) == n:
                    break
        for b in gone:
            d = self.lru.pop(b)
            copies = self.cache[d]
            copies.remove(b)
            if not copies:
                del self.cache[d]
            self.pending.append(
                wire.VllmBlockRemoved(block_hashes=[to_external(d)], medium="GPU", group_idx=0)
            )

    def _stored_event(
        self,
        token_ids: Sequence[int],
        digests: list[bytes],
        start: int,
        n: int,
        lora: str | None,
        salt: str | None,
    ) -> wire.VllmBlockStored:
        B = self.hash_cfg.block_size
        extra: list[tuple[Any, ...] | None] = []
        for i in range(start, start + n):
            keys = ([lora] if lora else []) + ([salt] if salt is not None and i == 0 else [])
            extra.append(tuple(keys) or None)
        return wire.VllmBlockStored(
            block_hashes=[to_external(d) for d in digests[start : start + n]],
            parent_block_hash=to_external(digests[start - 1]) if start > 0 else None,
            token_ids=list(token_ids[start * B : (start + n) * B]),
            block_size=B,
            lora_id=(sorted(self.loras).index(lora) + 1) if lora else None,
            medium="GPU",
            lora_name=lora,
            extra_keys=extra,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )

    def _flush(self) -> None:
        if self.pending:
            events, self.pending = self.pending, []
            self._publish(events)
