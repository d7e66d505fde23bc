"""The benchmark traces: the unbounded tree hits exactly the optimum (seeds' figures), and the
capped agents trace reproduces LRU's thrash (62.1%) while next-use beats it."""

from __future__ import annotations

import pytest

from fleet.core.radix.traces import (
    REALISTIC_TRACES,
    SEED_TRACES,
    longest_request,
    optimal_hits,
    simulate,
)

# (hit tokens, prompt tokens) derived in docs/radix.md
SEED_OPTIMA = {
    "few-shot": (15 * 256, 16 * 272),                          # 3840 / 4352 = 88.2%
    "multi-turn": (7 * 64 + 32 * 21, 8 * 64 + 32 * 28),        # 1120 / 1408 = 79.5%
    "tree-of-thought": (27 * 112 - 688, 27 * 112),             # 2336 / 3024 = 77.2%
    "agents": (6360 - 848, 6360),                              # 5512 / 6360 = 86.7%
}
SEED_PERCENT = {"few-shot": "88.2", "multi-turn": "79.5", "tree-of-thought": "77.2", "agents": "86.7"}

@pytest.mark.parametrize("name", sorted(SEED_TRACES))
def test_seed_trace_unbounded_hit_rate_is_the_exact_optimum(name: str) -> None:
    trace = SEED_TRACES[name]()
    res = simulate(trace)
    hits, total = SEED_OPTIMA[name]
    assert (res.num_hit_tokens, res.num_queried_tokens) == (hits, total)
    assert res.num_hit_tokens == sum(optimal_hits(trace))           # independent brute force
    assert f"{100 * res.hit_rate:.1f}" == SEED_PERCENT[name]
    print(f"{name}: {hits}/{total} = {100 * res.hit_rate:.2f}%")

@pytest.mark.parametrize("name", sorted(REALISTIC_TRACES))
def test_realistic_trace_unbounded_tree_equals_brute_force_optimum(name: str) -> None:
    trace = REALISTIC_TRACES[name]()
    res = simulate(trace)
    assert res.num_hit_tokens == sum(optimal_hits(trace))
    capped = simulate(trace, capacity_tokens=int(1.5 * longest_request(trace)), policy="lru")
    assert capped.num_hit_tokens < res.num_hit_tokens                # control: a cap costs hits
    print(f"{name}: optimum {100 * res.hit_rate:.2f}%, LRU capped {100 * capped.hit_rate:.2f}%")

def test_capped_agents_lru_thrashes_at_the_seeds_figure_and_next_use_beats_it() -> None:
    trace = SEED_TRACES["agents"]()
    cap = int(1.5 * longest_request(trace))
    assert cap == 408
    lru = simulate(trace, capacity_tokens=cap, policy="lru")
    nxt = simulate(trace, capacity_tokens=cap, policy="next-use")
    assert (lru.num_hit_tokens, lru.num_queried_tokens) == (3952, 6360)  # 62.1%: the seeds' figure
    assert nxt.num_hit_tokens == 4648                                    # 73.1%
    assert lru.max_cached_tokens <= cap and nxt.max_cached_tokens <= cap
    print(f"agents @ {cap} tokens: LRU {100 * lru.hit_rate:.1f}%  next-use {100 * nxt.hit_rate:.1f}%")
