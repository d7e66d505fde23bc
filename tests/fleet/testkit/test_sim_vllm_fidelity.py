"""The stand-in's prefix cache against vLLM's own rules (tests/support/vllm_pool_ref.py models vLLM v1's BlockPool and
KVCacheManager from their code): the same requests hit the same tokens, and each step stores and evicts the same
blocks, in the same order, as vLLM would.

Two rules the stand-in did not follow before:
- vLLM looks up at most `num_tokens - 1` tokens (`KVCacheManager.get_computed_blocks`: the last token is computed for
  its logits, and a hit is whole blocks), so a fully cached prompt of whole blocks hits all but its last block,
  computes that block again and stores it (a BlockStored). The stand-in hit the whole prompt and computed one token:
  `cached_tokens` and `vllm:prefix_cache_hits_total` one block higher, and no event.
- vLLM does not de-duplicate blocks (`BlockPool.cache_full_blocks`): the recomputed block is a second copy of its
  hash, in a block of its own. The copies are evicted one at a time, each with its BlockRemoved, the older first,
  and the hash stays cached (and hit) while a copy is left.

The stand-in keeps its documented differences out of the comparison: prompts are whole blocks (vLLM's partial last
block takes a slot, the stand-in's none) and every request asks for one token (vLLM stores full output blocks), and the
reference pool has one block more (vLLM's null block).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from support.vllm_pool_ref import Block, KVCacheManager, Request

from fleet.app.testkit.sim_vllm import wire
from fleet.app.testkit.sim_vllm.cache import PrefixCache
from fleet.app.testkit.sim_vllm.sched import Scheduler, Seq
from fleet.app.testkit.sim_vllm.step_cost import CostModel
from fleet.core.block_hash import HashConfig, chain, to_external

B = 16
CFG = HashConfig()
COST = CostModel(0.002, 15000.0, 0.008, 8e-5)
Ev = tuple[str, tuple[Any, ...], Any]  # (kind, block hashes, parent hash) as the events carry them


def _sim_events(evs: list[Any]) -> list[Ev]:
    out: list[Ev] = []
    for e in evs:
        if isinstance(e, wire.VllmBlockStored):
            out.append(("stored", tuple(e.block_hashes), e.parent_block_hash))
        elif isinstance(e, wire.VllmBlockRemoved):
            out.append(("removed", tuple(e.block_hashes), None))
        else:
            out.append(("cleared", (), None))
    return out


class VllmPool:
    """vLLM's KV cache manager behind the stand-in scheduler's BlockPool calls (admission is the stand-in's)."""

    def __init__(self, num_blocks: int) -> None:
        self.mgr = KVCacheManager(num_blocks + 1, B)  # + vLLM's null block
        self.reqs: dict[int, tuple[Request, list[Block] | None]] = {}

    def allocate(self, seq: Seq) -> int:
        req = Request(str(seq.seq_id), seq.digests, len(seq.token_ids) + seq.num_output)
        hit_blocks, hit = self.mgr.get_computed_blocks(req)
        req.num_computed_tokens = 0
        self.reqs[seq.seq_id] = (req, hit_blocks)
        return hit

    def cache_blocks(self, seq: Seq, num_computed_tokens: int) -> None:
        req, hit_blocks = self.reqs[seq.seq_id]
        base = req.num_computed_tokens + len(hit_blocks or ()) * B
        assert self.mgr.allocate_slots(req, num_computed_tokens - base, hit_blocks or ()), "reference pool full"
        req.num_computed_tokens = num_computed_tokens
        self.reqs[seq.seq_id] = (req, None)

    def free(self, seq: Seq) -> None:
        if seq.seq_id in self.reqs:
            self.mgr.free(self.reqs.pop(seq.seq_id)[0])

    def events(self) -> list[Ev]:
        evs, self.mgr.pool.events = self.mgr.pool.events, []
        return [(k, tuple(map(to_external, hs)), None if p is None else to_external(p)) for k, hs, p in evs]


class Lockstep:
    """The scheduler's pool: the stand-in's, with vLLM's following every call; the hits each answered."""

    def __init__(self, num_blocks: int) -> None:
        self.sim, self.vllm = PrefixCache(CFG, num_blocks, {}, lambda evs: None), VllmPool(num_blocks)
        self.hits: list[tuple[int, int]] = []

    def can_allocate(self, seq: Seq, alone: bool) -> bool:
        return self.sim.can_allocate(seq, alone)

    def allocate(self, seq: Seq) -> int:
        hit = self.sim.allocate(seq)
        self.hits.append((hit, self.vllm.allocate(seq)))
        return hit

    def cache_blocks(self, seq: Seq, num_computed_tokens: int) -> None:
        self.sim.cache_blocks(seq, num_computed_tokens)
        self.vllm.cache_blocks(seq, num_computed_tokens)

    def free(self, seq: Seq) -> None:
        self.sim.free(seq)
        self.vllm.free(seq)


def _arrivals(seed: int, num_requests: int) -> list[tuple[float, list[int]]]:
    """Six conversations of whole blocks; a turn grows one by 1-5 blocks, or (one in five) repeats it exactly."""
    rng = random.Random(seed)
    convs = [[c * 100_000 + i for i in range(rng.randrange(1, 8) * B)] for c in range(6)]
    out, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(50.0)
        c = rng.randrange(len(convs))
        if rng.random() < 0.8:
            convs[c] = convs[c] + list(range(10**6 + i * 100, 10**6 + i * 100 + rng.randrange(1, 6) * B))
        if len(convs[c]) > 20 * B:
            convs[c] = convs[c][: rng.randrange(1, 4) * B]
        out.append((t, list(convs[c])))
    return out


def _replay(arrivals: Sequence[tuple[float, list[int]]], num_blocks: int, budget: int) -> list[dict[str, Any]]:
    """Every step's hits and events from both pools (stand-in, vLLM), until the last request has finished."""
    pool = Lockstep(num_blocks)
    sched = Scheduler(COST, 1024, budget, pool)
    steps, i = [], 0
    while i < len(arrivals) or sched.running or sched.waiting:
        while i < len(arrivals) and (arrivals[i][0] <= sched.now or not (sched.running or sched.waiting)):
            sched.advance(arrivals[i][0] - sched.now)
            sched.add(arrivals[i][1], 1, digests=chain(CFG, arrivals[i][1]))
            i += 1
        step = sched.plan()
        sim_events, pool.sim.pending = _sim_events(pool.sim.pending), []
        steps.append({"hits": pool.hits, "sim": sim_events, "vllm": pool.vllm.events()})
        pool.hits = []
        if step is not None:
            sched.complete(step)
    return steps


@pytest.mark.parametrize("budget", [8192, 64])  # 64: prompts prefilled in chunks, several requests per step
def test_hits_and_events_match_vllms_block_pool_step_by_step(budget: int) -> None:
    num_repeats = num_removed = 0
    for seed in range(12):
        arrivals = _arrivals(seed, 40)
        num_repeats += sum(a[1] == b[1] for a, b in zip(arrivals, arrivals[1:], strict=False))
        for n, step in enumerate(_replay(arrivals, 64, budget)):
            assert [h for h, _ in step["hits"]] == [h for _, h in step["hits"]], (seed, n, step["hits"])
            assert step["sim"] == step["vllm"], (seed, n)
            num_removed += sum(k == "removed" for k, _, _ in step["sim"])
    assert num_repeats and num_removed > 100  # fully cached prompts came, and the pool was full: blocks were evicted


class Alone:
    """A stand-in pool that runs each request alone, its prompt in one step (the instant path), and its batches."""

    def __init__(self, num_blocks: int) -> None:
        self.published: list[list[Any]] = []
        self.pool = PrefixCache(CFG, num_blocks, {}, self.published.append)

    def run(self, token_ids: list[int]) -> tuple[int, list[Ev]]:
        """(its hit in tokens, the events published for it)."""
        res = self.pool._step(token_ids, None, None, False)
        evs, self.published[:] = [e for batch in self.published for e in batch], []
        return res.num_cached_tokens, _sim_events(evs)


def test_a_fully_cached_prompt_recomputes_and_stores_its_last_block_again() -> None:
    w = Alone(8)
    a = list(range(48))  # 3 whole blocks
    h = [to_external(d) for d in chain(CFG, a)]
    assert w.run(a) == (0, [("stored", tuple(h), None)])
    # vLLM: all but the last block hit, that block computed again and stored again, chained on the one before
    assert w.run(a) == (32, [("stored", (h[2],), h[1])])
    assert w.pool.hits == 32 and w.pool.queries == 96
    # a prompt one token longer hits every block: its last token is not in one
    assert w.run(a + [7])[0] == 48


def test_the_older_copy_goes_first_and_the_hash_stays_cached_while_a_copy_is_left() -> None:
    w = Alone(4)
    a, c = list(range(32)), list(range(500, 532))  # 2 blocks each
    h = [to_external(d) for d in chain(CFG, a)]
    w.run(a)
    assert w.run(a) == (16, [("stored", (h[1],), h[0])])  # a second copy of a's last block
    assert len(w.pool.lru) == 3 and len(w.pool.cache) == 2  # three blocks, two hashes
    # c needs 2 of the 4 blocks: the free one, then the least recently freed: a's first copy of its last block
    assert w.run(c)[1][0] == ("removed", (h[1],), None)
    assert h[1] in w.pool.resident_external()  # vLLM still holds it (the copy): a longer prompt hits it
    assert w.run(a + [1])[0] == 32


def test_a_preempted_request_hits_its_whole_prompt_its_output_is_recomputed() -> None:
    pool = PrefixCache(CFG, 16, {}, lambda evs: None)
    sched = Scheduler(COST, 8, 8192, pool)
    seq = sched.add(list(range(32)), 4, digests=chain(CFG, list(range(32))))
    for _ in range(2):  # its prefill, then one decode: 2 tokens out
        step = sched.plan()
        assert step is not None
        sched.complete(step)
    sched.preempt_all()
    step = sched.plan()
    # vLLM's lookup is capped at num_tokens - 1 = 33 of prompt and output: both prompt blocks hit
    assert step is not None and step.prefill == ((seq, 2),) and seq.num_hit_tokens == 32
    assert (seq.num_cached_tokens, pool.preempted_prefill) == (0, 0)
