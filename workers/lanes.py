"""TenantLanes: a kernel host's threads, shared fairly between tenants (issue #29).

A host runs the kernel work of every session it holds (appends, prefills, replays) on `threads`
threads. Each tenant has a FIFO lane; whenever a thread is free, the lanes with work are served
round-robin, one job per turn, and one tenant never runs more than `tenant_inflight` jobs at once
(threads - 1 by default). So with two threads or more, a tenant whose agents flood their sessions
always leaves a thread to the next tenant: another tenant's call waits at most for the job already
running on that thread, never behind the flooder's queue.

    lanes = TenantLanes(threads=2)
    result = await lanes.run("acme", fn)     # fn() runs on a lane thread; the event loop stays free

The lanes live on the host's asyncio loop (a Ray async actor's); the jobs run on a ThreadPoolExecutor.
A job whose caller went away (cancelled) is skipped when its turn comes.

NOTE: the controller's judge has lanes of its own (controller/judge_lanes.py: two pools, a CPU budget per
tenant, a queue bound naming the judge's flags). A host cannot import the controller (the layer rule), and
needs none of those: its callers are bounded upstream (the controller's per-tenant session call lanes,
--session-concurrency-per-tenant), and kernel work is not paced by a CPU budget. So this is the small
round-robin core alone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet.core.errors import InvalidArgument


class TenantLanes:
    """`threads` worker threads; per-tenant FIFO lanes served round-robin, at most `tenant_inflight` each."""

    def __init__(self, threads: int, tenant_inflight: int | None = None) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise InvalidArgument(f"a host needs at least one thread, got {threads!r}")
        self.threads = threads
        self.tenant_inflight = tenant_inflight or max(1, threads - 1)
        if self.tenant_inflight < 1:
            raise InvalidArgument(f"tenant_inflight must be >= 1, got {tenant_inflight!r}")
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kernel")
        self._lanes: dict[str, deque[tuple[Callable[[], Any], asyncio.Future[Any]]]] = {}
        self._turn: deque[str] = deque()  # tenants with queued work, in serving order
        self._inflight: dict[str, int] = {}
        self._busy = 0

    async def run(self, tenant: str, fn: Callable[[], Any]) -> Any:
        """fn() on a lane thread, in `tenant`'s turn; its result (or exception)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        lane = self._lanes.setdefault(tenant, deque())
        if not lane and tenant not in self._turn:
            self._turn.append(tenant)
        lane.append((fn, fut))
        self._pump()
        return await fut

    def stats(self) -> dict[str, int]:
        return {"threads": self.threads, "busy": self._busy, "queued": sum(len(q) for q in self._lanes.values())}

    def _pump(self) -> None:
        """Start jobs while a thread is free: the next tenant in turn that is under its in-flight cap."""
        skipped = 0
        while self._busy < self.threads and self._turn and skipped < len(self._turn):
            tenant = self._turn[0]
            self._turn.rotate(-1)
            if self._inflight.get(tenant, 0) >= self.tenant_inflight:
                skipped += 1
                continue
            skipped = 0
            fn, fut = self._lanes[tenant].popleft()
            if not self._lanes[tenant]:
                del self._lanes[tenant]
                self._turn.remove(tenant)
            if fut.cancelled():
                continue
            self._start(tenant, fn, fut)

    def _start(self, tenant: str, fn: Callable[[], Any], fut: asyncio.Future[Any]) -> None:
        self._busy += 1
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        job = asyncio.get_running_loop().run_in_executor(self._pool, fn)

        def done(j: asyncio.Future[Any]) -> None:
            self._busy -= 1
            self._inflight[tenant] -= 1
            if not self._inflight[tenant]:
                del self._inflight[tenant]
            if fut.done():
                pass
            elif j.cancelled():
                fut.cancel()
            elif j.exception() is not None:
                fut.set_exception(j.exception())  # type: ignore[arg-type]
            else:
                fut.set_result(j.result())
            self._pump()

        job.add_done_callback(done)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
