"""A batched request's cost and bookkeeping (controller/batch_route.py, controller/cost.py `terms(batch=...)`,
ShadowPools parts): the one cost model, summed over the prompts; every prompt a request of its own in the pool.
The end-to-end behaviour (proxy, controller, stand-ins) is tests/controller/proxy/test_proxy_batched_route.py."""

from __future__ import annotations

from controller.batch_route import within
from controller.cost import CandidateState, CostConfig, order, terms
from controller.shadow import ShadowPools

CFG = CostConfig()
B = 16


def _state(worker: str, cached: int, batch_cached: tuple[int, ...] = (), **kw: object) -> CandidateState:
    return CandidateState(worker, 0, True, kw.pop("proven", True), B, cached,  # type: ignore[arg-type]
                          batch_cached=batch_cached, **kw)  # type: ignore[arg-type]


def test_a_batch_is_costed_by_the_sum_of_its_prompts_and_goes_where_its_later_prompts_are_warm() -> None:
    # first prompt 100 tokens, cold on both; the second 240 tokens, all warm on w1
    w0, w1 = _state("w0", 0, (0,)), _state("w1", 0, (240,), num_resident_blocks=15)
    t0, t1 = terms(CFG, 100, w0, 256, 0, [(240, 0)]), terms(CFG, 100, w1, 256, 0, [(240, 0)])
    assert (t0.total, t0.prefill_tokens, t0.cached_tokens) == (340, 340, 0)
    assert (t1.total, t1.prefill_tokens, t1.cached_tokens) == (100, 100, 240)
    assert [s.state.worker for s in order(CFG, 100, [w0, w1], 256, 0, [(240, 0)])] == ["w1", "w0"]
    # control: by its first prompt alone (no batch) the two cost the same, and the tie goes to fewer resident blocks
    assert [s.state.worker for s in order(CFG, 100, [w0, w1], 256)] == ["w0", "w1"]


def test_a_batch_of_one_costs_what_its_prompt_costs() -> None:
    s = _state("w0", 64, num_resident_blocks=40, num_gpu_blocks=48, num_running=2.0)
    assert terms(CFG, 300, s, 256, 32) == terms(CFG, 300, s, 256, 32, [])


def test_an_unproven_rank_counts_no_prompt_of_a_batch_warm() -> None:
    t = terms(CFG, 100, _state("w0", 96, (240,), proven=False), 256, 0, [(240, 0)])
    assert (t.cached_tokens, t.prefill_tokens) == (0, 340)


def test_shared_prefixes_are_amortized_per_prompt() -> None:
    # each prompt starts with a 64-token shared prefix the rank lacks: both count as amortized (weight 0)
    t = terms(CFG, 100, _state("w0", 0, (0,)), 256, 64, [(200, 64)])
    assert (t.amortized_tokens, t.total) == (128, 300 - 128)


def test_a_batch_evicts_nothing_only_when_each_prompts_full_blocks_are_resident() -> None:
    full = dict(num_resident_blocks=100, num_gpu_blocks=100)  # a full rank: every new block evicts one
    # 40 tokens (2 full blocks + 8) and 24 tokens (1 + 8): their full blocks resident, their partial ones are not
    t = terms(CFG, 40, _state("w0", 32, (16,), **full), 256, 0, [(24, 0)])
    assert (t.evicted_tokens, t.prefill_tokens) == (0, 16)
    # the second prompt's only full block is missing: its new block evicts one of another prefix
    t = terms(CFG, 40, _state("w0", 32, (0,), **full), 256, 0, [(24, 0)])
    assert t.evicted_tokens > 0 and t.prefill_tokens == 32


def test_each_prompt_of_a_batch_is_a_request_in_the_pool_and_all_are_freed_with_the_route() -> None:
    pools = ShadowPools()
    key = ("w0", 0)
    pools.allocate(key, "r", [1, 2], 0, 9, now=0.0)
    pools.allocate(key, "r", [3, 4, 5], 0, 9, now=0.0, part=1)  # NOTE: one name for both raised "already holds"
    p = pools.get(key)
    assert p is not None and p.num_free() == 8 - 5
    pools.free("r", now=1.0)
    # both freed, each tail first, in the order they ran: the first prompt's, then the second's
    assert p.num_free() == 8 and p.queue()[-5:] == [2, 1, 5, 4, 3]


def test_a_batch_over_the_token_limit_keeps_its_leading_prompts_that_fit() -> None:
    batch = [[1] * 10, [2] * 20, [3] * 5]
    assert within(10, batch, 10) == 0  # the first alone fills it
    assert within(10, batch, 29) == 1
    assert within(10, batch, 40) == 2  # the third (5) would fit after the second, but the prompts keep their order
    assert within(10, batch, 45) == 3
    assert within(50, [], 10) == 0
