"""JudgeLanes (controller/judge_lanes.py): per-tenant lanes over one bounded pool, served in turn, each tenant
paced by its CPU budget, its queue bounded. Real threads burning real CPU (no clock is faked)."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import pytest

from controller.judge_lanes import JudgeLanes, JudgeLimits, add_judge_flags, judge_limits_from
from fleet.core.errors import InvalidArgument, ResourceExhausted


def burn(seconds: float, tag: str = "") -> str:
    """Spin for `seconds` of this thread's CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    return tag


async def test_lanes_are_served_in_turn_and_one_tenant_never_holds_every_thread() -> None:
    lanes = JudgeLanes(JudgeLimits(threads=2, tenant_inflight=1, tenant_cpu=0))
    started: list[str] = []

    def job(tag: str) -> str:
        started.append(tag)  # in start order (list.append is atomic)
        return burn(0.02, tag)

    try:
        flood = [asyncio.ensure_future(lanes.run("a", job, f"a{i}")) for i in range(6)]
        await asyncio.sleep(0)
        assert await lanes.run("b", job, "b0") == "b0"  # queued after a's six
        assert started.index("b0") == 1, started  # the free thread: a holds one at most
        await asyncio.gather(*flood)
        assert started == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]  # a's in order (FIFO)
        assert lanes.stats("a")["jobs"] == 6 and lanes.stats("a")["cpu_s"] >= 6 * 0.02 * 0.9
    finally:
        await lanes.aclose()


async def test_a_tenant_over_its_cpu_budget_waits_and_others_do_not() -> None:
    """Budget 0.05 CPU-s/s, burst 0.02 CPU-s: six jobs of 0.02 CPU-s (0.12 in all) cannot finish before
    (0.12 - 0.02 - 0.02) / 0.05 = 1.6 s of wall time (the burst, and the last job may overrun the bucket),
    and the lane is seen throttled; b's one job, queued behind them,
    runs while a still waits. Control: with no budget a's lane is never throttled."""
    for cpu in (0.05, 0.0):
        lanes = JudgeLanes(JudgeLimits(threads=2, tenant_inflight=1, tenant_cpu=cpu, burst_s=0.02))
        try:
            t0 = time.perf_counter()
            a = [asyncio.ensure_future(lanes.run("a", burn, 0.02)) for _ in range(6)]
            await asyncio.sleep(0.1)
            await lanes.run("b", burn, 0.01)
            a_left = sum(not f.done() for f in a)
            await asyncio.gather(*a)
            wall, st = time.perf_counter() - t0, lanes.stats("a")
            print(
                f"budget {cpu}: a's 6 jobs took {wall:.2f} s wall, {st['cpu_s']:.2f} CPU-s; throttled "
                f"{st['throttled']}; a's jobs left when b's finished: {a_left}"
            )
            if cpu:
                assert wall >= (0.12 - 0.02 - 0.02) / cpu and st["throttled"] > 0 and a_left > 0
            else:
                assert st["throttled"] == 0
        finally:
            await lanes.aclose()


async def test_a_full_queue_is_resource_exhausted_and_background_jobs_are_dropped_not_failed() -> None:
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0, tenant_queue=2))
    try:
        running = [asyncio.ensure_future(lanes.run("a", burn, 0.05)) for _ in range(3)]  # 1 running, 2 queued
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted, match="--judge-cpu-per-tenant"):
            await lanes.run("a", burn, 0.0)
        assert await lanes.run("b", burn, 0.0, "b") == "b"  # another tenant's queue is its own
        # background jobs run on their own thread, one at a time: one running, two queued, the fourth dropped
        assert all(lanes.background("a", burn, 0.05) for _ in range(3))
        assert not lanes.background("a", burn, 0.0) and lanes.stats("a")["dropped"] == 1
        await asyncio.gather(*running)
    finally:
        await lanes.aclose()


async def test_background_jobs_hold_at_most_the_tenants_bytes_until_they_end() -> None:
    """A background job holds its tool result's bytes until it ends: past `tenant_later_bytes` held (queued or
    running), the next is dropped, another tenant's is not, and the bytes come back as the jobs end. NOTE: bounded
    in jobs alone (1,024), a tenant's queue could hold about 3 GiB of 3 MiB results (review finding); the control
    is the same jobs under the job bound alone."""
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0, tenant_later_bytes=10))
    gate = threading.Event()
    try:
        assert lanes.background("a", gate.wait, 5.0, nbytes=4)    # runs, holding its 4 bytes until it ends
        assert lanes.background("a", gate.wait, 5.0, nbytes=6)    # queued: 10 held
        assert not lanes.background("a", burn, 0.0, nbytes=1)      # 11 > 10: dropped
        assert lanes.background("b", burn, 0.0, nbytes=10)        # another tenant's bytes are its own
        assert lanes.stats("a")["later_bytes"] == 10 and lanes.stats("a")["dropped"] == 1
        gate.set()
        for _ in range(500):
            if not lanes.stats("a")["later_bytes"] and not lanes.stats("b")["later_bytes"]:
                break
            await asyncio.sleep(0.01)
        assert lanes.stats("a")["later_bytes"] == 0 and lanes.stats("b")["later_bytes"] == 0
        assert lanes.background("a", burn, 0.0, nbytes=10)         # room again
    finally:
        await lanes.aclose()
    control = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0, tenant_later_bytes=1 << 40))
    try:
        assert all(control.background("a", burn, 0.0, nbytes=6) for _ in range(3))   # 18 bytes, jobs alone bound it
    finally:
        await control.aclose()


async def test_a_request_never_waits_behind_its_own_tenants_heavy_job() -> None:
    """A background (heavy layer) job runs on its own pool: the tenant's next waited-for job starts while it
    runs (before, with one job in flight per tenant, the request waited for the encoder's inspection)."""
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0))
    started: list[str] = []

    def job(tag: str, seconds: float) -> str:
        started.append(tag)
        return burn(seconds, tag)

    try:
        assert lanes.background("a", job, "heavy", 0.3)
        assert await lanes.run("a", job, "now", 0.0) == "now"
        assert lanes.stats("a")["inflight"] == 1 and started == ["heavy", "now"]  # the heavy one still runs
    finally:
        await lanes.aclose()


async def test_a_cancelled_callers_job_is_skipped() -> None:
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0))
    try:
        first = asyncio.ensure_future(lanes.run("a", burn, 0.05))
        gone = asyncio.ensure_future(lanes.run("a", burn, 0.05, "gone"))
        await asyncio.sleep(0.01)
        gone.cancel()
        await first
        assert await lanes.run("a", burn, 0.0, "next") == "next"
        assert lanes.stats("a")["jobs"] == 2  # the cancelled one never ran
    finally:
        await lanes.aclose()


async def test_two_batches_of_one_tenant_are_queued_whole_or_not_at_all() -> None:
    """Two run_many of one tenant at once, 3 jobs each, room for 4: one batch is queued, the other refused with
    none of its jobs queued. Before, both passed the check before either queued (the jobs were queued by tasks
    of their own), and the refused batch's first job was queued and run: ran x1 x2 x3 y1."""
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0, tenant_queue=4))
    gate, ran = threading.Event(), []

    def job(tag: str) -> str:
        ran.append(tag)
        return tag

    try:
        blocker = asyncio.ensure_future(lanes.run("a", gate.wait))  # holds a's one slot: the rest wait queued
        await asyncio.sleep(0)
        x = asyncio.ensure_future(lanes.run_many("a", job, [("x1",), ("x2",), ("x3",)]))
        y = asyncio.ensure_future(lanes.run_many("a", job, [("y1",), ("y2",), ("y3",)]))
        with pytest.raises(ResourceExhausted, match="sent 3 more"):
            await y
        assert lanes.stats("a")["queued"] == 3  # x's three, none of y's
        gate.set()
        assert await x == ["x1", "x2", "x3"]
        await blocker
        assert await lanes.run("a", job, "next") == "next" and ran == ["x1", "x2", "x3", "next"]
    finally:
        gate.set()
        await lanes.aclose()


async def test_a_batch_whose_job_fails_drops_its_jobs_still_queued() -> None:
    """The first of four jobs raises: the caller gets its error, and the jobs still queued then are dropped, not
    judged for nobody (before, all three ran). The one started as the failing job ended may still run."""
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0))
    ran: list[str] = []

    def job(tag: str) -> str:
        if tag == "bad":
            raise ValueError("bad result")
        ran.append(tag)
        return tag

    try:
        with pytest.raises(ValueError, match="bad result"):
            await lanes.run_many("a", job, [("bad",), ("ok1",), ("ok2",), ("ok3",)])
        assert await lanes.run("a", job, "next") == "next"  # after whatever of the batch was left
        assert ran in (["next"], ["ok1", "next"]) and lanes.stats("a")["queued"] == 0
    finally:
        await lanes.aclose()


async def test_a_lane_short_of_budget_is_not_woken_at_another_tenants_refill() -> None:
    """a overran its bucket by 0.04 CPU-s (refilled in 20 s at 0.002 CPU-s/s) and has a job waiting; b is short by
    about 0.0001 CPU-s (0.05 s). b's next job runs when b's bucket has refilled: before, the wake already set for
    a's refill was kept, and b's job waited the 20 s of a's. Control: a's job is still throttled then."""
    lanes = JudgeLanes(JudgeLimits(threads=2, tenant_cpu=0.002, burst_s=0.01))
    try:
        await lanes.run("a", burn, 0.05)
        a_next = asyncio.ensure_future(lanes.run("a", burn, 0.0, "a"))
        await asyncio.sleep(0)
        assert lanes.stats("a")["throttled"] > 0 and not a_next.done()
        await lanes.run("b", burn, 0.0101)
        # NOTE: not a speed bound: b's own refill is 0.05 s, a's 20 s; the bound only keeps a failure short
        assert await asyncio.wait_for(lanes.run("b", burn, 0.0, "b"), timeout=10.0) == "b"
        assert not a_next.done() and lanes.stats("a")["queued"] == 1
    finally:
        await lanes.aclose()


async def test_jobs_whose_callers_went_away_do_not_fill_the_queue() -> None:
    """b holds the one thread; a's two queued calls (its queue's room) time out. a's next call is queued and runs
    once the thread is free. Before, the two cancelled jobs still counted until a's turn came, and a was refused
    "has 2 tool results waiting" with nothing waiting."""
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0, tenant_queue=2))
    gate = threading.Event()
    try:
        blocker = asyncio.ensure_future(lanes.run("b", gate.wait))
        gone = [asyncio.ensure_future(lanes.run("a", burn, 0.0, "gone")) for _ in range(2)]
        await asyncio.sleep(0)
        for f in gone:
            f.cancel()
        nxt = asyncio.ensure_future(lanes.run("a", burn, 0.0, "next"))
        await asyncio.sleep(0)
        assert lanes.stats("a")["queued"] == 1 and not nxt.done()  # queued, not refused
        gate.set()
        assert await nxt == "next" and lanes.stats("a")["jobs"] == 1  # the cancelled ones never ran
        await blocker
    finally:
        gate.set()
        await lanes.aclose()


def test_bad_limits_name_the_flag() -> None:
    for kw, flag in (
        ({"threads": 0}, "--judge-threads"),
        ({"tenant_inflight": 0}, "--judge-inflight-per-tenant"),
        ({"tenant_cpu": -1.0}, "--judge-cpu-per-tenant"),
        ({"threads": 2, "tenant_inflight": 2}, "must be below --judge-threads"),  # before: accepted
    ):
        with pytest.raises(InvalidArgument, match=flag):
            JudgeLimits(**kw)  # type: ignore[arg-type]
    JudgeLimits(threads=1, tenant_inflight=1)  # controls: one thread cannot keep a thread free; 3 and 2 can
    JudgeLimits(threads=3, tenant_inflight=2)


@pytest.mark.parametrize(
    "var, value, flag",
    [
        ("KVFLEET_JUDGE_THREADS", "abc", "--judge-threads: invalid int value: 'abc'"),
        ("KVFLEET_JUDGE_INFLIGHT_PER_TENANT", "2.5", "--judge-inflight-per-tenant: invalid int value: '2.5'"),
        ("KVFLEET_JUDGE_CPU_PER_TENANT", "lots", "--judge-cpu-per-tenant: invalid float value: 'lots'"),
    ],
)
def test_a_malformed_env_value_is_a_usage_error_naming_the_flag(
    var: str, value: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # int()/float() on the env value used to raise ValueError while the parser was being built: a traceback
    p = argparse.ArgumentParser(prog="kvfleet controller")
    add_judge_flags(p, {var: value})
    with pytest.raises(SystemExit):
        p.parse_args([])
    assert flag in capsys.readouterr().err
    p = argparse.ArgumentParser()
    add_judge_flags(p, {"KVFLEET_JUDGE_THREADS": "3", "KVFLEET_JUDGE_CPU_PER_TENANT": "1.5"})  # control
    limits = judge_limits_from(p.parse_args([]))
    assert (limits.threads, limits.tenant_cpu, limits.tenant_inflight) == (3, 1.5, JudgeLimits().tenant_inflight)


async def test_a_batch_that_does_not_fit_is_refused_whole() -> None:
    lanes = JudgeLanes(JudgeLimits(threads=1, tenant_inflight=1, tenant_cpu=0, tenant_queue=3))
    try:
        with pytest.raises(ResourceExhausted, match="sent 4 more"):
            await lanes.run_many("a", burn, [(0.0,)] * 4)
        assert lanes.stats("a")["jobs"] == 0 and lanes.stats("a")["queued"] == 0  # nothing was queued
        assert await lanes.run_many("a", burn, [(0.0, "x"), (0.0, "y")]) == ["x", "y"]  # control: fits
    finally:
        await lanes.aclose()
