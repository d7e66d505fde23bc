"""The stand-in's block pool: a real prefix cache with vLLM's block hashing, LRU eviction and events.

`num_blocks` blocks hold full prompt blocks. A block is pinned while a running request holds it
(ref_cnt > 0) and cached-but-free once none does; new blocks take free slots first, then evict the
least recently used unpinned block (one BlockRemoved each). As in vLLM, a request's blocks are
released in reverse order, so of one request the tail blocks are evicted first and its prefix stays. Events are queued and published
with the engine step (`_flush`). Pure: the publisher is a callable, no I/O here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.app.testkit.sim_vllm import wire
from fleet.core.block_hash import HashConfig, chain, to_external

if TYPE_CHECKING:
    from fleet.app.testkit.sim_vllm.sched import Seq


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
    ) -> None:
        self.hash_cfg, self.num_blocks, self.loras = hash_cfg, num_blocks, loras
        self._publish = publish
        self.cache: OrderedDict[bytes, None] = OrderedDict()  # full digest -> (), LRU order
        self.ref_cnt: dict[bytes, int] = {}  # digest -> running seqs holding it (pinned: never evicted)
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

    def _step(
        self, token_ids: Sequence[int], lora: str | None, salt: str | None, report_full: bool
    ) -> StepResult:
        """One request's prompt through the cache at once (admit, publish, release): the instant path."""
        res, _ = self._admit(token_ids, self._digests(token_ids, lora, salt), lora, salt, report_full)
        self._flush()
        return res

    # sched.BlockPool
    def can_allocate(self, seq: Seq, alone: bool) -> bool:
        if alone:
            return True  # NOTE: a prompt larger than the pool runs alone, only its head cached
        hit = self._num_hit(seq.digests)
        extra = sum(d not in self.ref_cnt for d in seq.digests[:hit]) + len(seq.digests) - hit
        return len(self.ref_cnt) + extra <= self.num_blocks

    def allocate(self, seq: Seq) -> int:
        first = seq.num_cached_tokens < 0  # a preempted seq's readmission is not a new query (vLLM)
        res, held = self._admit(seq.token_ids, seq.digests, seq.lora, seq.cache_salt, seq.report_full, first)
        if not first:
            self.preempted_prefill += res.num_prompt_tokens - res.num_cached_tokens
        for d in held:
            self.ref_cnt[d] = self.ref_cnt.get(d, 0) + 1
        seq.pinned = held
        return res.num_cached_tokens

    def free(self, seq: Seq) -> None:
        """Unpin the request's blocks; those no running request holds join the LRU end in reverse
        order, so the tail blocks are evicted first (vLLM's `KVCacheManager.free`)."""
        for d in reversed(seq.pinned):
            if self.ref_cnt.get(d, 0) > 1:
                self.ref_cnt[d] -= 1
            else:
                self.ref_cnt.pop(d, None)
                if d in self.cache:
                    self.cache.move_to_end(d)
        seq.pinned = []

    # internals
    def _digests(self, token_ids: Sequence[int], lora: str | None, salt: str | None) -> list[bytes]:
        lora_kv = (lora, self.loras[lora]) if lora else None
        return chain(self.hash_cfg, token_ids, lora=lora_kv, cache_salt=salt)

    def _num_hit(self, digests: list[bytes]) -> int:
        hit = 0
        while hit < len(digests) and digests[hit] in self.cache:
            hit += 1
        return hit

    def _admit(
        self,
        token_ids: Sequence[int],
        digests: list[bytes],
        lora: str | None,
        salt: str | None,
        report_full: bool,
        count: bool = True,
    ) -> tuple[StepResult, list[bytes]]:
        """Match the prefix, cache the new full blocks (LRU-evicting unpinned ones), queue the events.

        Returns the result and the blocks the request now holds (hit + new). `count`: add the prompt
        to `queries`/`hits` (vllm:prefix_cache_*_total), as vLLM does for a request's first scheduling
        only; a preempted request's readmission goes to its separate preempted stats, which it does not
        export. NOTE: with nothing pinned this is exactly the stand-in's original one-shot step (the
        demo's offline model replays it).
        """
        hit = self._num_hit(digests)
        for d in digests[:hit]:
            self.cache.move_to_end(d)
        held = set(self.ref_cnt) | set(digests[:hit])
        new = digests[hit:][: max(self.num_blocks - len(held), 0)]
        self._evict(len(self.cache) + len(new) - self.num_blocks, keep=held | set(digests))
        for d in new:
            self.cache[d] = None
        for d in reversed(digests[: hit + len(new)]):
            self.cache.move_to_end(d)  # tail first: vLLM frees a request's blocks in reverse order
        first_new = 0 if report_full else hit
        stored = digests[first_new : hit + len(new)]
        if stored:
            self.pending.append(self._stored_event(token_ids, digests, first_new, len(stored), lora, salt))
        if count:
            self.queries += len(token_ids)
            self.hits += hit * self.hash_cfg.block_size
        return StepResult(len(token_ids), hit * self.hash_cfg.block_size, len(new)), digests[: hit + len(new)]

    def _evict(self, n: int, keep: set[bytes]) -> None:
        """Evict the `n` least recently used blocks not in `keep`.

        NOTE: it listed every block not kept and took the first n, on every admission, n = 0 included: O(blocks
        cached) per request, so a stand-in slowed as its cache filled (bench/proxy_load.py's 65,536-block workers
        ran 2,640 requests/s straight to them in its first round and 688 in its eighth; this list was 2.8 ms of
        each request's CPU by the 14th). It walks from the front now, and stops once it has n."""
        if n <= 0:
            return
        gone: list[bytes] = []
        for d in self.cache:
            if d not in keep:
                gone.append(d)
                if len(gone) == n:
                    break
        for d in gone:
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
