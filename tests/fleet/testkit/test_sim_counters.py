"""The stand-in's vllm:prefix_cache_{queries,hits}_total count a request once, at its first scheduling.

vLLM's PrefixCacheStats.record puts a preempted request's readmission into separate preempted_*
stats, which the Prometheus counters do not include; a reset that preempts a running request must
therefore not count its prompt again (the bench reads prefilled = queries - hits per prompt sent).
"""

from __future__ import annotations

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.metrics import metrics_text
from fleet.app.testkit.sim_vllm.sched import FINISHED


def _engine() -> SimEngine:
    return SimEngine(SimEngineConfig(model="m", num_blocks=64, time_scale=1.0), lambda _events: None)


def _play(eng: SimEngine) -> None:
    while (step := eng.plan()) is not None:
        eng.finish(step)


def _counter(eng: SimEngine, name: str) -> float:
    line = next(x for x in metrics_text(eng).splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_a_request_preempted_by_a_reset_is_queried_once() -> None:
    eng = _engine()
    warm = eng.submit(list(range(32)), 1)
    _play(eng)
    a = eng.submit(list(range(48)), 3)  # its first 32 tokens (2 blocks) are cached
    eng.finish(eng.plan())
    eng.sleep(1, "keep")  # the reset preempts it: readmitted after the wake, against an empty cache
    assert eng.sched.stats.num_preemptions == 1
    eng.wake_up(None)
    _play(eng)
    assert (warm.state, a.state, a.num_output) == (FINISHED, FINISHED, 3)
    assert _counter(eng, "vllm:prefix_cache_queries_total") == 32 + 48
    assert _counter(eng, "vllm:prefix_cache_hits_total") == 32  # a's hit at its first admission


def test_a_wake_before_the_drain_ends_preempts_without_a_second_query() -> None:
    eng = _engine()
    a = eng.submit(list(range(64)), 4)
    eng.finish(eng.plan())  # admitted, still decoding
    eng.sleep(1, "wait")  # drains a before the reset ...
    eng.wake_up(None)  # ... but the wake comes first: the deferred reset preempts a
    assert eng.sched.stats.num_preemptions == 1
    _play(eng)
    assert a.state == FINISHED and _counter(eng, "vllm:prefix_cache_queries_total") == 64
