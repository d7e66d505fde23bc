"""Judge lanes: the detector's CPU work, per tenant, on its own bounded pool (issue #28).

Tool-result verdicts (JudgeToolResults, AdmitToolResult, the background heavy layers) never run on the
store executor that uploads, GetBlob and every store call share: one tenant's flood of first inspections
would hold those threads and stall every other tenant's uploads and chats. Instead:

    pools      `threads` judge threads for the jobs a request waits for ("now"), and `heavy_threads` for
               the heavy layers nobody waits for ("later"), so a request never queues behind an encoder
               inspection; both for the whole controller (the judges' share of the CPU)
    lanes      one per tenant, two FIFO queues, "now" and "later"; for each pool, the lanes with work of
               its kind are served round-robin, one job per turn
    in flight  at most `tenant_inflight` "now" jobs (and one "later" job) of one tenant run at once, so a
               tenant never holds every thread (with threads > tenant_inflight another tenant always
               finds one free)
    budget     each job's CPU (time.thread_time() around it) is charged to its tenant's bucket, which
               refills at `tenant_cpu` CPU-seconds per wall-second up to `burst_s`; a lane whose bucket
               is empty waits until it refills (only that tenant waits: the others keep being served)
    bounds     `tenant_queue` queued "now" jobs per tenant, then RESOURCE_EXHAUSTED naming the flag;
               past `tenant_queue` queued "later" jobs, or `tenant_later_bytes` of tool results held by
               them (queued or running), a background job is dropped (counted): it is run again the next
               time its bytes are seen

A job whose caller went away (the RPC was cancelled) is skipped when its turn comes. The lanes live on
one asyncio loop (the controller's); the jobs run on the pool. One tenant's books (its queues, jobs in
flight and CPU bucket) are a JudgeLane (controller/judge_lane.py); this module decides whose turn it is.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from controller.judge_lane import JudgeJob, JudgeLane
from fleet.core.errors import InvalidArgument, ResourceExhausted

log = logging.getLogger("kvfleet.controller")
T = TypeVar("T")

DEFAULT_THREADS = 2
DEFAULT_TENANT_INFLIGHT = 1
DEFAULT_TENANT_CPU = 0.5  # CPU-seconds per wall-second one tenant's judging may use on average
DEFAULT_BURST_S = 5.0  # CPU-seconds a tenant may use at once before its budget paces it
DEFAULT_TENANT_QUEUE = 1024
DEFAULT_TENANT_LATER_BYTES = 64 << 20  # tool results a tenant's background jobs may hold, queued or running


@dataclass(frozen=True, slots=True)
class JudgeLimits:
    """The judge pool and per-tenant lanes (`--judge-*` flags). Invariants: threads >= 1,
    1 <= tenant_inflight < threads (or both 1), tenant_cpu >= 0 (0: no CPU budget), burst_s > 0, tenant_queue >= 1."""

    threads: int = DEFAULT_THREADS
    heavy_threads: int = 1  # the background (heavy layer) pool
    tenant_inflight: int = DEFAULT_TENANT_INFLIGHT
    tenant_cpu: float = DEFAULT_TENANT_CPU
    burst_s: float = DEFAULT_BURST_S
    tenant_queue: int = DEFAULT_TENANT_QUEUE
    tenant_later_bytes: int = DEFAULT_TENANT_LATER_BYTES

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidArgument(f"--judge-threads must be >= 1, got {self.threads}")
        if self.heavy_threads < 1:
            raise InvalidArgument(f"heavy judge threads must be >= 1, got {self.heavy_threads}")
        if self.tenant_inflight < 1:
            raise InvalidArgument(f"--judge-inflight-per-tenant must be >= 1, got {self.tenant_inflight}")
        if self.threads > 1 and self.tenant_inflight >= self.threads:
            # NOTE: accepted silently before: one tenant could then hold every thread, and the guarantee that another
            # tenant always finds one free did not hold (one thread cannot keep it: 1 and 1 stay allowed)
            raise InvalidArgument(
                f"--judge-inflight-per-tenant ({self.tenant_inflight}) must be below --judge-threads ({self.threads}), "
                "so that another tenant always finds a thread free"
            )
        if not self.tenant_cpu >= 0:
            raise InvalidArgument(
                f"--judge-cpu-per-tenant must be >= 0 (0: no budget), got {self.tenant_cpu}"
            )
        if not self.burst_s > 0:
            raise InvalidArgument(f"judge burst must be > 0 CPU-seconds, got {self.burst_s}")
        if self.tenant_queue < 1:
            raise InvalidArgument(f"judge queue per tenant must be >= 1, got {self.tenant_queue}")
        if self.tenant_later_bytes < 1:
            raise InvalidArgument(f"background judge bytes per tenant must be >= 1, got {self.tenant_later_bytes}")


class JudgeLanes:
    """Per-tenant lanes over one bounded judge pool; see the module docstring."""

    def __init__(self, limits: JudgeLimits | None = None) -> None:
        self.limits = limits or JudgeLimits()
        self.pool = ThreadPoolExecutor(self.limits.threads, thread_name_prefix="kvfleet-judge")
        self.heavy_pool = ThreadPoolExecutor(
            self.limits.heavy_threads, thread_name_prefix="kvfleet-judge-heavy"
        )
        self._lanes: dict[str, JudgeLane] = {}
        self._order: tuple[deque[str], deque[str]] = (deque(), deque())  # per kind: tenants with jobs queued
        self._running = [0, 0]
        self._wake: asyncio.TimerHandle | None = None
        self._closed = False

    def _lane(self, tenant: str) -> JudgeLane:
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = JudgeLane(self.limits.burst_s, time.monotonic())
        return lane

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) in `tenant`'s lane and wait for it (a request waits: the "now" queue).

        Raises:
            ResourceExhausted: the tenant already has `tenant_queue` jobs waiting.
        """
        return (await self.run_many(tenant, fn, [args]))[0]

    async def run_many(self, tenant: str, fn: Callable[..., T], args: list[tuple[Any, ...]]) -> list[T]:
        """[fn(*a) for a in args], each a job in `tenant`'s lane, all queued at once or none; when one fails,
        the others still queued are dropped (nobody reads their verdicts).

        Raises:
            ResourceExhausted: the tenant's queue has no room for all of them (nothing is queued).
        """
        lane = self._lane(tenant)
        if len(lane.now) + len(args) > self.limits.tenant_queue:
            lane.drop_gone()
        if len(lane.now) + len(args) > self.limits.tenant_queue:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {len(lane.now)} tool results waiting to be judged and sent "
                f"{len(args)} more (at most {self.limits.tenant_queue} wait, and its judging may use "
                f"{self.limits.tenant_cpu:g} CPU-seconds per second: --judge-cpu-per-tenant); retry when its "
                "earlier requests have finished"
            )
        # NOTE: queued here, with no await after the check: queued by tasks of their own, two batches of one tenant
        # both passed the check, and the second was refused after some of its jobs were queued (and then run)
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[T]] = [loop.create_future() for _ in args]
        for fut, a in zip(futs, args, strict=True):
            self._push(tenant, lane, 0, JudgeJob(functools.partial(fn, *a), fut))
        try:
            return list(await asyncio.gather(*futs))
        except BaseException:
            for fut in futs:
                fut.cancel()
            raise

    def background(self, tenant: str, fn: Callable[..., Any], *args: Any, nbytes: int = 0) -> bool:
        """Queue fn(*args), which holds `nbytes` of tool results until it ends, in `tenant`'s lane after its
        waited-for jobs; nobody waits for it. False (and counted in `dropped`) when the tenant's background queue
        is full, in jobs or in bytes, or the lanes are closed.
        NOTE: bounded in jobs alone, a tenant's 1,024 queued jobs could each hold a 3 MiB tool result (about 3 GiB
        per tenant) while the heavy layer drained them far slower than the fast layers queued them (review
        finding); a session's admission now queues its blob's ref, not its bytes."""
        lane = self._lane(tenant)
        if self._closed or len(lane.later) >= self.limits.tenant_queue \
                or lane.later_bytes + nbytes > self.limits.tenant_later_bytes:
            lane.dropped += 1
            return False
        lane.later_bytes += nbytes
        self._push(tenant, lane, 1, JudgeJob(lambda: fn(*args), None, nbytes))
        return True

    def _push(self, tenant: str, lane: JudgeLane, kind: int, job: JudgeJob) -> None:
        if self._closed:
            raise ResourceExhausted("the controller is stopping; retry on another controller")
        lane.queue(kind).append(job)
        if tenant not in self._order[kind]:
            self._order[kind].append(tenant)
        self._pump()

    def _pump(self) -> None:
        """Start jobs while threads are free, for each pool: tenants round-robin, skipping a lane at its
        in-flight cap or out of budget (it is woken when its bucket has refilled)."""
        now, wait = time.monotonic(), None
        rate = self.limits.tenant_cpu
        for kind, width, cap in (
            (0, self.limits.threads, self.limits.tenant_inflight),
            (1, self.limits.heavy_threads, 1),
        ):
            order, tried = self._order[kind], 0
            while self._running[kind] < width and order and tried < len(order):
                tenant = order[0]
                order.rotate(-1)
                lane = self._lanes[tenant]
                lane.refill(now, rate, self.limits.burst_s)
                job = lane.next(kind)
                if job is None:
                    order.remove(tenant)
                    tried = 0
                    continue
                if lane.running[kind] >= cap or (rate > 0 and lane.balance <= 0):
                    if rate > 0 and lane.balance <= 0:
                        lane.throttled += 1
                        due = -lane.balance / rate + 1e-3
                        wait = due if wait is None else min(wait, due)
                    tried += 1
                    continue
                lane.queue(kind).popleft()
                if not lane.queue(kind):
                    order.remove(tenant)
                tried = 0
                self._start(tenant, lane, kind, job)
        if wait is not None and not self._closed:
            self._wake_at(wait)

    def _wake_at(self, wait: float) -> None:
        """Pump again in `wait` s, unless a wake is due sooner. NOTE: a wake already set was kept even when later:
        a lane a few ms short of budget waited for another tenant's, refilling a long overrun (20 s, not 0.05)."""
        loop = asyncio.get_running_loop()
        if self._wake is not None:
            if self._wake.when() <= loop.time() + wait:
                return
            self._wake.cancel()
        self._wake = loop.call_later(wait, self._woken)

    def _woken(self) -> None:
        self._wake = None
        self._pump()

    def _start(self, tenant: str, lane: JudgeLane, kind: int, job: JudgeJob) -> None:
        lane.started(kind)
        self._running[kind] += 1

        def timed() -> tuple[float, Any, BaseException | None]:
            t0 = time.thread_time()
            try:
                value = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                return time.thread_time() - t0, None, e
            return time.thread_time() - t0, value, None

        cf = asyncio.get_running_loop().run_in_executor(self.heavy_pool if kind else self.pool, timed)
        cf.add_done_callback(lambda f: self._done(tenant, lane, kind, job, f))

    def _done(self, tenant: str, lane: JudgeLane, kind: int, job: JudgeJob, f: asyncio.Future[Any]) -> None:
        self._running[kind] -= 1
        if f.cancelled():
            err: BaseException | None = asyncio.CancelledError()
            cpu, value = 0.0, None
        else:
            cpu, value, err = f.result()
        lane.ended(kind, cpu, job.nbytes)
        if job.fut is not None and not job.fut.done():
            if err is not None:
                job.fut.set_exception(err)
            else:
                job.fut.set_result(value)
        elif err is not None and not isinstance(err, asyncio.CancelledError):
            log.warning("background judge job of tenant %r failed: %s: %s", tenant, type(err).__name__, err)
        if not self._closed:
            self._pump()

    def stats(self, tenant: str) -> dict[str, float]:
        """{"cpu_s", "jobs", "queued", "inflight", "dropped", "throttled", "balance"} of `tenant`'s lane (zeros if
        none: a fresh lane's, with a full bucket; none is made for it)."""
        lane = self._lanes.get(tenant)
        return (lane if lane is not None else JudgeLane(self.limits.burst_s, 0.0)).stats()

    async def aclose(self) -> None:
        """close(), then wait for the running jobs (they may still use the store the caller closes next)."""
        self.close()
        await asyncio.to_thread(self.pool.shutdown, True)
        await asyncio.to_thread(self.heavy_pool.shutdown, True)

    def close(self) -> None:
        """Drop every queued job (waiters get CancelledError), let running ones finish on their own."""
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
        for lane in self._lanes.values():
            lane.cancel_queued()
        for order in self._order:
            order.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.heavy_pool.shutdown(wait=False, cancel_futures=True)


def add_judge_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--judge-threads, --judge-inflight-per-tenant, --judge-cpu-per-tenant (env KVFLEET_JUDGE_*)."""
    d = JudgeLimits()
    p.add_argument(
        "--judge-threads",
        type=int,
        default=env.get("KVFLEET_JUDGE_THREADS", d.threads),  # NOTE: an env string is parsed by type=
        help="threads that run the quarantine detector, for every tenant together (env "
        f"KVFLEET_JUDGE_THREADS; default {d.threads}); never the store's threads",
    )
    p.add_argument(
        "--judge-inflight-per-tenant",
        type=int,
        default=env.get("KVFLEET_JUDGE_INFLIGHT_PER_TENANT", d.tenant_inflight),
        help="a tenant's detector jobs running at once (env KVFLEET_JUDGE_INFLIGHT_PER_TENANT; "
        f"default {d.tenant_inflight}); the rest wait in its lane, lanes served in turn",
    )
    p.add_argument(
        "--judge-cpu-per-tenant",
        type=float,
        default=env.get("KVFLEET_JUDGE_CPU_PER_TENANT", d.tenant_cpu),
        help="CPU-seconds per second a tenant's judging may use on average, bursts of "
        f"{d.burst_s:g} CPU-seconds (env KVFLEET_JUDGE_CPU_PER_TENANT; default {d.tenant_cpu:g}; "
        "0: no budget); over it, only that tenant's verdicts wait",
    )


def judge_limits_from(args: argparse.Namespace) -> JudgeLimits:
    """The JudgeLimits of parsed `add_judge_flags` flags (InvalidArgument names a bad one)."""
    return JudgeLimits(
        threads=args.judge_threads,
        tenant_inflight=args.judge_inflight_per_tenant,
        tenant_cpu=args.judge_cpu_per_tenant,
    )
