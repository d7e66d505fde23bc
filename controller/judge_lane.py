"""JudgeLane: one tenant's lane in the judge lanes (controller/judge_lanes.py), with no pool or loop of its own.

A lane holds the tenant's two FIFO queues of jobs ("now": a request waits for them; "later": the heavy layers
nobody waits for), its jobs in flight of each kind, and its CPU bucket: `balance` CPU-seconds, refilled at
`rate` CPU-seconds per wall-second up to `burst_s` and charged with each job's CPU when it ends (it may go
below 0 by the last job's overrun). JudgeLanes decides whose turn it is; the lane keeps the tenant's books.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class JudgeJob:
    fn: Callable[[], Any]
    fut: asyncio.Future[Any] | None  # None: a background job nobody waits for
    nbytes: int = 0  # bytes of tool results the job holds until it ends (a background job's, counted in later_bytes)


@dataclass(slots=True)
class JudgeLane:
    balance: float  # CPU-seconds left in the bucket (may go below 0 by the last job's overrun)
    stamp: float  # when balance was last refilled (monotonic)
    now: deque[JudgeJob] = field(default_factory=deque)
    later: deque[JudgeJob] = field(default_factory=deque)
    running: list[int] = field(default_factory=lambda: [0, 0])  # jobs in flight, "now" and "later"
    cpu_s: float = 0.0  # CPU charged in total
    jobs: int = 0
    dropped: int = 0  # background jobs dropped on a full queue
    later_bytes: int = 0  # bytes the background jobs queued or running hold
    throttled: int = 0  # times its turn came with jobs waiting and its budget spent

    def pending(self) -> int:
        return len(self.now) + len(self.later)

    def queue(self, kind: int) -> deque[JudgeJob]:
        return self.later if kind else self.now

    def drop_gone(self) -> None:
        """Drop the "now" jobs whose callers went away. NOTE: jobs whose callers went away left the queue only when
        their lane's turn came; until then they counted, and a tenant whose calls had timed out was refused with
        nothing waiting"""
        self.now = deque(job for job in self.now if job.fut is None or not job.fut.done())

    def refill(self, now: float, rate: float, burst_s: float) -> None:
        """Refill the bucket for the time since the last refill, at `rate` CPU-seconds per second (0: no budget)."""
        if rate > 0:
            self.balance = min(burst_s, self.balance + (now - self.stamp) * rate)
        self.stamp = now

    def next(self, kind: int) -> JudgeJob | None:
        """The lane's next live job of `kind`; cancelled ones are dropped on the way."""
        q = self.queue(kind)
        while q and q[0].fut is not None and q[0].fut.done():
            q.popleft()
        return q[0] if q else None

    def started(self, kind: int) -> None:
        self.running[kind] += 1

    def ended(self, kind: int, cpu: float, nbytes: int = 0) -> None:
        """A job of `kind` holding `nbytes` ended, having used `cpu` CPU-seconds: charged to the total and the
        bucket."""
        self.running[kind] -= 1
        if kind:
            self.later_bytes -= nbytes
        self.jobs += 1
        self.cpu_s += cpu
        self.balance -= cpu

    def cancel_queued(self) -> None:
        """Drop every queued job (waiters get CancelledError)."""
        self.later_bytes -= sum(job.nbytes for job in self.later)   # running ones give theirs back as they end
        for q in (self.now, self.later):
            for job in q:
                if job.fut is not None and not job.fut.done():
                    job.fut.cancel()
            q.clear()

    def stats(self) -> dict[str, float]:
        return {
            "cpu_s": self.cpu_s,
            "jobs": self.jobs,
            "queued": self.pending(),
            "inflight": sum(self.running),
            "dropped": self.dropped,
            "later_bytes": self.later_bytes,
            "throttled": self.throttled,
            "balance": self.balance,
        }
