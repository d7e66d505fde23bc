"""Judge lanes: the detector's CPU work, per tenant, on its own bounded pool (issue #28).

Tool-result verdicts (JudgeToolResults, AdmitToolResult, the background heavy layers) never run on the
store executor that uploads, GetBlob and every store call share: one tenant's flood of first inspections
would hold those threads and stall every other tenant's uploads and chats. Instead:

    pool       `threads` judge threads for the whole controller (the judges' share of the CPU)
    lanes      one per tenant, two FIFO queues: "now" (a request waits for it) before "later" (heavy
               layers run in the background); lanes with work are served round-robin, one job per turn
    in flight  at most `tenant_inflight` jobs of one tenant run at once, so a tenant never holds every
               thread (with threads > tenant_inflight another tenant always finds one free)
    budget     each job's CPU (time.thread_time() around it) is charged to its tenant's bucket, which
               refills at `tenant_cpu` CPU-seconds per wall-second up to `burst_s`; a lane whose bucket
               is empty waits until it refills (only that tenant waits: the others keep being served)
    bounds     `tenant_queue` queued "now" jobs per tenant, then RESOURCE_EXHAUSTED naming the flag;
               past `tenant_queue` queued "later" jobs a background job is dropped (counted): it is run
               again the next time its bytes are seen

A job whose caller went away (the RPC was cancelled) is skipped when its turn comes. The lanes live on
one asyncio loop (the controller's); the jobs run on the pool.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fleet.errors import InvalidArgument, ResourceExhausted

log = logging.getLogger("kvfleet.controller")
T = TypeVar("T")

DEFAULT_THREADS = 2
DEFAULT_TENANT_INFLIGHT = 1
DEFAULT_TENANT_CPU = 0.5  # CPU-seconds per wall-second one tenant's judging may use on average
DEFAULT_BURST_S = 5.0  # CPU-seconds a tenant may use at once before its budget paces it
DEFAULT_TENANT_QUEUE = 1024


@dataclass(frozen=True, slots=True)
class JudgeLimits:
    """The judge pool and per-tenant lanes (`--judge-*` flags). Invariants: threads >= 1,
    1 <= tenant_inflight, tenant_cpu >= 0 (0: no CPU budget), burst_s > 0, tenant_queue >= 1."""

    threads: int = DEFAULT_THREADS
    tenant_inflight: int = DEFAULT_TENANT_INFLIGHT
    tenant_cpu: float = DEFAULT_TENANT_CPU
    burst_s: float = DEFAULT_BURST_S
    tenant_queue: int = DEFAULT_TENANT_QUEUE

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise InvalidArgument(f"--judge-threads must be >= 1, got {self.threads}")
        if self.tenant_inflight < 1:
            raise InvalidArgument(f"--judge-inflight-per-tenant must be >= 1, got {self.tenant_inflight}")
        if not self.tenant_cpu >= 0:
            raise InvalidArgument(
                f"--judge-cpu-per-tenant must be >= 0 (0: no budget), got {self.tenant_cpu}"
            )
        if not self.burst_s > 0:
            raise InvalidArgument(f"judge burst must be > 0 CPU-seconds, got {self.burst_s}")
        if self.tenant_queue < 1:
            raise InvalidArgument(f"judge queue per tenant must be >= 1, got {self.tenant_queue}")


@dataclass(slots=True)
class _Job:
    fn: Callable[[], Any]
    fut: asyncio.Future[Any] | None  # None: a background job nobody waits for


@dataclass(slots=True)
class _Lane:
    balance: float  # CPU-seconds left in the bucket (may go below 0 by the last job's overrun)
    stamp: float  # when balance was last refilled (monotonic)
    now: deque[_Job] = field(default_factory=deque)
    later: deque[_Job] = field(default_factory=deque)
    inflight: int = 0
    cpu_s: float = 0.0  # CPU charged in total
    jobs: int = 0
    dropped: int = 0  # background jobs dropped on a full queue
    throttled: int = 0  # times its turn came with jobs waiting and its budget spent

    def pending(self) -> int:
        return len(self.now) + len(self.later)


class JudgeLanes:
    """Per-tenant lanes over one bounded judge pool; see the module docstring."""

    def __init__(self, limits: JudgeLimits | None = None) -> None:
        self.limits = limits or JudgeLimits()
        self.pool = ThreadPoolExecutor(self.limits.threads, thread_name_prefix="kvfleet-judge")
        self._lanes: dict[str, _Lane] = {}
        self._order: deque[str] = deque()  # round-robin order of tenants with queued jobs
        self._running = 0
        self._wake: asyncio.TimerHandle | None = None
        self._closed = False

    def _lane(self, tenant: str) -> _Lane:
        lane = self._lanes.get(tenant)
        if lane is None:
            lane = self._lanes[tenant] = _Lane(self.limits.burst_s, time.monotonic())
        return lane

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) in `tenant`'s lane and wait for it (a request waits: the "now" queue).

        Raises:
            ResourceExhausted: the tenant already has `tenant_queue` jobs waiting.
        """
        lane = self._lane(tenant)
        if len(lane.now) >= self.limits.tenant_queue:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {len(lane.now)} tool results waiting to be judged (at most "
                f"{self.limits.tenant_queue}, and {self.limits.tenant_cpu:g} CPU-seconds per second for its "
                "judging: --judge-cpu-per-tenant); retry when its earlier requests have finished"
            )
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._push(tenant, lane, lane.now, _Job(lambda: fn(*args), fut))
        return await fut

    async def run_many(self, tenant: str, fn: Callable[..., T], args: list[tuple[Any, ...]]) -> list[T]:
        """[fn(*a) for a in args], each a job in `tenant`'s lane, all queued at once or none.

        Raises:
            ResourceExhausted: the tenant's queue has no room for all of them (nothing is queued).
        """
        lane = self._lane(tenant)
        if len(lane.now) + len(args) > self.limits.tenant_queue:
            raise ResourceExhausted(
                f"tenant {tenant!r} has {len(lane.now)} tool results waiting to be judged and sent "
                f"{len(args)} more (at most {self.limits.tenant_queue} wait, and its judging may use "
                f"{self.limits.tenant_cpu:g} CPU-seconds per second: --judge-cpu-per-tenant); retry when its "
                "earlier requests have finished"
            )
        return list(await asyncio.gather(*(self.run(tenant, fn, *a) for a in args)))

    def background(self, tenant: str, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue fn(*args) in `tenant`'s lane after its waited-for jobs; nobody waits for it. False (and
        counted in `dropped`) when the tenant's background queue is full or the lanes are closed."""
        lane = self._lane(tenant)
        if self._closed or len(lane.later) >= self.limits.tenant_queue:
            lane.dropped += 1
            return False
        self._push(tenant, lane, lane.later, _Job(lambda: fn(*args), None))
        return True

    def _push(self, tenant: str, lane: _Lane, q: deque[_Job], job: _Job) -> None:
        if self._closed:
            raise ResourceExhausted("the controller is stopping; retry on another controller")
        q.append(job)
        if tenant not in self._order:
            self._order.append(tenant)
        self._pump()

    def _refill(self, lane: _Lane, now: float) -> None:
        rate = self.limits.tenant_cpu
        if rate > 0:
            lane.balance = min(self.limits.burst_s, lane.balance + (now - lane.stamp) * rate)
        lane.stamp = now

    def _pump(self) -> None:
        """Start jobs while threads are free: tenants round-robin, skipping a lane at its in-flight cap or
        out of budget (it is woken when its bucket has refilled)."""
        now, wait = time.monotonic(), None
        tried = 0
        while self._running < self.limits.threads and self._order and tried < len(self._order):
            tenant = self._order[0]
            self._order.rotate(-1)
            lane = self._lanes[tenant]
            self._refill(lane, now)
            job = self._next(lane)
            if job is None:
                self._order.remove(tenant)
                tried = 0
                continue
            if lane.inflight >= self.limits.tenant_inflight or (
                self.limits.tenant_cpu > 0 and lane.balance <= 0
            ):
                if lane.balance <= 0 and self.limits.tenant_cpu > 0:
                    lane.throttled += 1
                    due = -lane.balance / self.limits.tenant_cpu + 1e-3
                    wait = due if wait is None else min(wait, due)
                tried += 1
                continue
            (lane.now if lane.now and lane.now[0] is job else lane.later).popleft()
            if not lane.pending():
                self._order.remove(tenant)
            tried = 0
            self._start(tenant, lane, job)
        if wait is not None and self._wake is None and not self._closed:
            self._wake = asyncio.get_running_loop().call_later(wait, self._woken)

    def _woken(self) -> None:
        self._wake = None
        self._pump()

    @staticmethod
    def _next(lane: _Lane) -> _Job | None:
        """The lane's next live job ("now" first); cancelled ones are dropped on the way."""
        for q in (lane.now, lane.later):
            while q and q[0].fut is not None and q[0].fut.done():
                q.popleft()
            if q:
                return q[0]
        return None

    def _start(self, tenant: str, lane: _Lane, job: _Job) -> None:
        lane.inflight += 1
        self._running += 1

        def timed() -> tuple[float, Any, BaseException | None]:
            t0 = time.thread_time()
            try:
                value = job.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                return time.thread_time() - t0, None, e
            return time.thread_time() - t0, value, None

        cf = asyncio.get_running_loop().run_in_executor(self.pool, timed)
        cf.add_done_callback(lambda f: self._done(tenant, lane, job, f))

    def _done(self, tenant: str, lane: _Lane, job: _Job, f: asyncio.Future[Any]) -> None:
        lane.inflight -= 1
        self._running -= 1
        lane.jobs += 1
        if f.cancelled():
            err: BaseException | None = asyncio.CancelledError()
            cpu, value = 0.0, None
        else:
            cpu, value, err = f.result()
        lane.cpu_s += cpu
        lane.balance -= cpu
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
        none)."""
        lane = self._lanes.get(tenant)
        if lane is None:
            return {
                "cpu_s": 0.0,
                "jobs": 0,
                "queued": 0,
                "inflight": 0,
                "dropped": 0,
                "throttled": 0,
                "balance": self.limits.burst_s,
            }
        return {
            "cpu_s": lane.cpu_s,
            "jobs": lane.jobs,
            "queued": lane.pending(),
            "inflight": lane.inflight,
            "dropped": lane.dropped,
            "throttled": lane.throttled,
            "balance": lane.balance,
        }

    async def aclose(self) -> None:
        """close(), then wait for the running jobs (they may still use the store the caller closes next)."""
        self.close()
        await asyncio.to_thread(self.pool.shutdown, True)

    def close(self) -> None:
        """Drop every queued job (waiters get CancelledError), let running ones finish on their own."""
        self._closed = True
        if self._wake is not None:
            self._wake.cancel()
        for lane in self._lanes.values():
            for q in (lane.now, lane.later):
                for job in q:
                    if job.fut is not None and not job.fut.done():
                        job.fut.cancel()
                q.clear()
        self._order.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)


def add_judge_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--judge-threads, --judge-inflight-per-tenant, --judge-cpu-per-tenant (env KVFLEET_JUDGE_*)."""
    d = JudgeLimits()
    p.add_argument(
        "--judge-threads",
        type=int,
        default=int(env.get("KVFLEET_JUDGE_THREADS", d.threads)),
        help="threads that run the quarantine detector, for every tenant together (env "
        f"KVFLEET_JUDGE_THREADS; default {d.threads}); never the store's threads",
    )
    p.add_argument(
        "--judge-inflight-per-tenant",
        type=int,
        default=int(env.get("KVFLEET_JUDGE_INFLIGHT_PER_TENANT", d.tenant_inflight)),
        help="a tenant's detector jobs running at once (env KVFLEET_JUDGE_INFLIGHT_PER_TENANT; "
        f"default {d.tenant_inflight}); the rest wait in its lane, lanes served in turn",
    )
    p.add_argument(
        "--judge-cpu-per-tenant",
        type=float,
        default=float(env.get("KVFLEET_JUDGE_CPU_PER_TENANT", d.tenant_cpu)),
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
