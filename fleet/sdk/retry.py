"""The one retry policy of the kvfleet gRPC clients: which errors are retried, and how long to wait.

`RetryPolicy` is the strategy (one method, `backoff`, as redis-py's `AbstractBackoff.compute`),
`retryable` the one rule, and `Attempts` one call's schedule, without I/O: FleetClient sleeps with
time.sleep, AsyncFleetClient with asyncio.sleep (fleet/sdk/client.py, fleet/sdk/aio.py).

NOTE: why not a library. gRPC's own retry (the channel's service config) caps attempts at 5, draws
its jitter over [0, backoff], spends one deadline across all attempts and cannot be observed;
`tenacity` is not a dependency; redis-py's backoffs use other jitter formulas and would pull redis
into the SDK layer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, on UNAVAILABLE only, within an overall deadline.

    Attempt n (0-based) waits min(max_backoff_s, initial_backoff_s * multiplier**n) * U(1 - jitter, 1 + jitter).
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 3.0
    multiplier: float = 2.0
    jitter: float = 0.2
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        assert self.max_attempts >= 1 and self.initial_backoff_s >= 0 and self.multiplier >= 1
        assert 0 <= self.jitter < 1 and self.deadline_s > 0

    def backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** attempt)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


NO_RETRY = RetryPolicy(max_attempts=1)


def retryable(e: grpc.RpcError) -> bool:
    """The one rule: only UNAVAILABLE is retried (nothing ran, or the op is safe to repeat).

    NOTE: DEADLINE_EXCEEDED is not retried: the attempt may still be running on the server.
    """
    return bool(e.code() == grpc.StatusCode.UNAVAILABLE)


class Attempts:
    """One call's retry schedule under a RetryPolicy, without I/O: the caller runs and sleeps.

    Invariants: at most `policy.max_attempts` attempts, none started past `policy.deadline_s`, and
    no pause reaches past it; the pause after failed attempt n (0-based) is `policy.backoff(n)`.
    """

    __slots__ = ("policy", "clock", "start", "num_attempts", "last")

    def __init__(self, policy: RetryPolicy, clock: Callable[[], float] | None = None) -> None:
        self.policy, self.clock = policy, clock or time.monotonic
        self.start = self.clock()
        self.num_attempts = 0
        self.last: BaseException | None = None

    def elapsed(self) -> float:
        return self.clock() - self.start

    def next(self) -> float | None:
        """Start an attempt: the seconds left before the deadline, or None when the call must give up."""
        if self.num_attempts >= self.policy.max_attempts:
            return None
        left = self.policy.deadline_s - self.elapsed()
        if left <= 0:
            return None
        self.num_attempts += 1
        return left

    def failed(self, e: BaseException) -> float | None:
        """Record a retryable failure. Returns the pause before the next attempt (never past the
        deadline), or None after the last attempt."""
        self.last = e
        if self.num_attempts >= self.policy.max_attempts:
            return None
        left = self.policy.deadline_s - self.elapsed()
        return max(0.0, min(self.policy.backoff(self.num_attempts - 1), left))
