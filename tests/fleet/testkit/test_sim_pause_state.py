"""The stand-in's pause state against vLLM 0.33.0's engine (EngineCore.pause_scheduler, wake_up, resume_scheduler).

vLLM keeps one scheduler pause state, whoever set it: a sleep pauses it as /pause does, /resume and a full wake both
clear it, and a wait pause (PAUSED_NEW) lets only the requests holding blocks (the running ones) finish, the
waiting ones staying queued until resume or wake. These drive a real SimEngine step by step in modelled time.
"""

from __future__ import annotations

from fleet.app.testkit.sim_vllm.config import EnginePaused, SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.sched import FINISHED, RUNNING, WAITING
from fleet.app.testkit.sim_vllm.wire import VllmAllBlocksCleared


def make_engine(**kw: object) -> tuple[SimEngine, list[list[object]]]:
    published: list[list[object]] = []
    return SimEngine(SimEngineConfig(**{"model": "m", "num_blocks": 64, **kw}), published.append), published


def play(eng: SimEngine) -> int:
    """Play every step out at once (the shell's loop, minus its sleeps); returns how many ran."""
    n = 0
    while (step := eng.plan()) is not None:
        eng.finish(step)
        n += 1
    return n


def test_a_wait_sleep_drains_the_running_request_alone_and_the_queue_waits_for_the_wake() -> None:
    eng, _ = make_engine(max_num_seqs=1)
    a = eng.submit(list(range(32)), 3)
    b = eng.submit(list(range(100, 132)), 1)  # max_num_seqs 1: queued behind a
    eng.finish(eng.plan())
    assert (a.state, b.state) == (RUNNING, WAITING)
    eng.sleep(1, "wait")
    play(eng)
    # vLLM: a finishes; b holds no blocks, stays queued (PAUSED_NEW schedules none of the waiting queue)
    assert (a.state, a.finish_reason, b.state, b.num_output) == (FINISHED, "length", WAITING, 0)
    assert eng.running == 0 and eng.waiting == 1 and len(eng.cache) == 0  # drained, then reset
    assert isinstance(eng.pending[-1], VllmAllBlocksCleared)
    eng.wake_up(None)
    play(eng)
    assert b.state == FINISHED and b.num_cached_tokens == 0  # after the wake, cold


def test_a_wait_pause_with_only_waiting_requests_completes_at_once() -> None:
    eng, _ = make_engine()
    eng.sleep(0, "abort")
    queued = eng.submit(list(range(32)), 1)  # waits on the sleeping engine: it holds no blocks
    eng.wake_up(None)
    eng.pause("wait", clear_cache=True)
    assert eng.plan() is None and queued.state == WAITING  # nothing to drain: not run
    assert len(eng.pending) == 1 and isinstance(eng.pending[0], VllmAllBlocksCleared)  # the reset came at once


def test_a_full_wake_resumes_a_pause_and_a_released_worker_as_vllm_does() -> None:
    eng, _ = make_engine()
    eng.pause("abort", clear_cache=False)
    assert eng.wake_up(None) and not eng.is_sleeping()  # vLLM: "awake", scheduling (the stand-in: "sleeping")
    eng.submit(list(range(16)), 1)  # no longer refused
    play(eng)
    eng.pause("keep", clear_cache=False)
    assert eng.release_kv_cache_memory() and eng.is_sleeping()
    assert eng.wake_up(["kv_cache"]) and not eng.is_sleeping()  # the documented restore: a wake


def test_resume_clears_a_sleeps_pause_and_a_sleep_keeps_a_pauses_refusal() -> None:
    eng, _ = make_engine()
    eng.sleep(0, "abort")
    eng.resume()
    assert not eng.is_sleeping()  # vLLM's resume_scheduler, whoever paused (the stand-in: still asleep)
    eng.sleep(1, "abort")
    eng.resume()
    assert eng.is_sleeping()  # its memory is still asleep: only a wake brings it back
    eng.wake_up(None)
    eng.pause("abort", clear_cache=True)
    eng.sleep(1, "keep")  # a sleep's pause leaves the /pause's refusal of new requests as it is
    try:
        eng.submit(list(range(16)), 1)
    except EnginePaused:
        pass
    else:
        raise AssertionError("a request to a paused, then slept worker was accepted; vLLM answers 503")
    assert eng.wake_up(None) and eng.submit(list(range(16)), 1).state == WAITING  # the wake lifts it


def test_a_release_waits_for_a_wait_pause_to_complete() -> None:
    eng, _ = make_engine()
    eng.submit(list(range(32)), 3)
    eng.finish(eng.plan())
    eng.pause("wait", clear_cache=False)
    assert not eng.release_kv_cache_memory()  # vLLM: "requires a completed pause first"
    play(eng)
    assert eng.release_kv_cache_memory()
