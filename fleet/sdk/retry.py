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

import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from fleet.core.errors import InvalidArgument
from fleet.sdk import args


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, on UNAVAILABLE (and DEADLINE_EXCEEDED of a call that carries an op id),
    within an overall deadline: no retry starts `deadline_s` after the call's start, and none runs past it (the
    first attempt always has its whole per-attempt deadline).

    Attempt n (0-based) waits min(max_backoff_s, initial_backoff_s * multiplier**n) * U(1 - jitter, 1 + jitter).
    """

    max_attempts: int = 8
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 3.0
    multiplier: float = 2.0
    jitter: float = 0.2
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        """Raises InvalidArgument naming the field that is out of range (fleet/sdk/args.py's checks).

        NOTE: these were asserts: a bad policy raised a bare AssertionError naming nothing (none at all under
        python -O), and max_backoff_s was not checked: -1 or nan made every pause 0, so the retries spun (found by
        review)."""
        args.count("RetryPolicy.max_attempts", self.max_attempts, 1)
        for name in ("initial_backoff_s", "max_backoff_s"):
            _number(name, getattr(self, name), 0.0)
        _number("multiplier", self.multiplier, 1.0)
        if not _number("jitter", self.jitter, 0.0) < 1:
            raise InvalidArgument(f"RetryPolicy.jitter must be below 1 (a fraction of the backoff), got {self.jitter!r}")
        args.seconds("RetryPolicy.deadline_s", self.deadline_s)

    def backoff(self, attempt: int) -> float:
        # NOTE: multiplier ** attempt overflows a float past about 1,000 doublings: a policy with that many attempts
        # raised OverflowError out of a call's retries (found by review); its backoff has long been max_backoff_s
        try:
            grown = self.initial_backoff_s * self.multiplier ** attempt
        except OverflowError:
            grown = self.max_backoff_s if self.initial_backoff_s else 0.0
        base = min(self.max_backoff_s, grown)
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


def _number(name: str, value: object, low: float) -> float:
    """`value` as a finite number >= low (not a bool, not a str)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < low:
        raise InvalidArgument(f"RetryPolicy.{name} must be a finite number >= {low:g}, got {value!r:.40}")
    return float(value)


NO_RETRY = RetryPolicy(max_attempts=1)


# grpc's words for a TLS handshake its SSL library refused (older grpc says "Ssl handshake failed"); SSL_ERROR_SSL is
# a protocol or certificate failure, which every retry meets again (a connection cut mid-handshake is SSL_ERROR_SYSCALL)
_HANDSHAKE = re.compile(r"\b(?:tls|ssl) handshake failed\b.*\bSSL_ERROR_SSL\b", re.IGNORECASE | re.DOTALL)
_TLS_CAUSES = (("WRONG_VERSION_NUMBER", "a plaintext controller? drop --tls (tls=True in the SDK)"),
               ("CERTIFICATE_VERIFY_FAILED", "its certificate did not verify: give the CA that signed it (--tls-ca, or "
                                             "root_certificates in the SDK)"))


def tls_failure(details: str) -> str | None:
    """What a status's details say of a TLS handshake that cannot succeed (its likely cause), or None.

    NOTE: --tls against a plaintext controller was retried 8 times over 8.7 s and ended in "check that `kvfleet
    controller` is running" (found by review); grpc reports it as UNAVAILABLE, "Tls handshake failed
    (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: ...WRONG_VERSION_NUMBER".
    """
    if not _HANDSHAKE.search(details):
        return None
    return next((cause for word, cause in _TLS_CAUSES if word in details), "the TLS settings of the two sides differ")


def retryable(e: grpc.RpcError, keyed: bool = False) -> bool:
    """The one rule: only UNAVAILABLE is retried (nothing ran, or the op is safe to repeat), except a TLS handshake
    that cannot succeed (tls_failure); and DEADLINE_EXCEEDED for a `keyed` call, one that carries an op id.

    NOTE: DEADLINE_EXCEEDED is not retried otherwise: the attempt may still be running on the server. A keyed call's
    retry is safe: the session runs one op at a time, so the retry waits for the first attempt and is answered from
    the op log (replayed=True). Before, a timed-out append was applied by the server and raised by the SDK without
    its op id, and the user's own retry applied it again (found by review).
    """
    if keyed and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    if e.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    details = e.details() if hasattr(e, "details") else None
    return tls_failure(details or "") is None


class Attempts:
    """One call's retry schedule under a RetryPolicy, without I/O: the caller runs and sleeps.

    Invariants: at most `policy.max_attempts` attempts, none started past `policy.deadline_s`, and
    no pause reaches past it; the pause after failed attempt n (0-based) is `policy.backoff(n)`.
    """

    __slots__ = ("policy", "clock", "start", "num_attempts", "last", "timeout")

    def __init__(self, policy: RetryPolicy, clock: Callable[[], float] | None = None) -> None:
        self.policy, self.clock = policy, clock or time.monotonic
        self.start = self.clock()
        self.num_attempts = 0
        self.last: BaseException | None = None
        self.timeout = 0.0  # the last attempt's (next's answer)

    def elapsed(self) -> float:
        return self.clock() - self.start

    def next(self, per_attempt: float | None = None) -> float | None:
        """Start an attempt: its timeout, or None when the call must give up. Without `per_attempt`: the seconds left
        before the deadline. With it: all of `per_attempt` for the first attempt, then the smaller of it and the
        seconds left (a retry never runs past the deadline).

        NOTE: the first attempt is not cut by the deadline: it was, so a retried session call (120 s per attempt)
        ended at the default deadline_s (30 s) and only the calls sent once had the per-attempt deadline the docs
        promise (found by review).
        """
        if self.num_attempts >= self.policy.max_attempts:
            return None
        left = self.policy.deadline_s - self.elapsed()
        if left <= 0:
            return None
        self.num_attempts += 1
        first = self.num_attempts == 1 and per_attempt is not None
        self.timeout = left if per_attempt is None else per_attempt if first else min(per_attempt, left)
        return self.timeout

    def failed(self, e: BaseException) -> float | None:
        """Record a retryable failure. Returns the pause before the next attempt (never past the
        deadline), or None after the last attempt."""
        self.last = e
        if self.num_attempts >= self.policy.max_attempts:
            return None
        left = self.policy.deadline_s - self.elapsed()
        return max(0.0, min(self.policy.backoff(self.num_attempts - 1), left))
