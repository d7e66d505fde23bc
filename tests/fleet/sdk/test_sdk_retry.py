"""The SDK's one retry policy (fleet/sdk/retry.py), without a server: the backoff, the retryable rule,
and the schedule FleetClient runs, checked step by step against the loop it replaced."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from fleet.app.redis_server import free_port
from fleet.core.errors import InvalidArgument, NotFound, Unavailable
from fleet.sdk import NO_RETRY, FleetClient, RetryPolicy, base
from fleet.sdk import client as client_module
from fleet.sdk import retry as retry_module
from fleet.sdk.retry import Attempts, retryable


class Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details or code.name.lower()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class Clock:
    """Fake time: attempts and sleeps advance it; every sleep is logged."""

    now: float = 100.0
    sleeps: list[float] = field(default_factory=list)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_backoff_grows_by_the_multiplier_is_capped_and_jittered() -> None:
    p = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.2)
    for attempt, base_s in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        got = [p.backoff(attempt) for _ in range(200)]
        assert all(base_s * 0.8 <= g <= base_s * 1.2 for g in got)
        assert max(got) - min(got) > base_s * 0.2  # really jittered
    assert RetryPolicy(jitter=0.0).backoff(3) == pytest.approx(0.8)


@pytest.mark.parametrize("bad", [dict(max_attempts=0), dict(multiplier=0.5), dict(jitter=1.0), dict(deadline_s=0),
                                 dict(initial_backoff_s=-1), dict(max_backoff_s=-1), dict(max_backoff_s=float("nan")),
                                 dict(initial_backoff_s=float("inf")), dict(deadline_s=float("nan")),
                                 dict(max_attempts=2.5), dict(jitter="0.1"), dict(max_attempts=True)])
def test_a_policy_refuses_nonsense_naming_the_field(bad: dict[str, Any]) -> None:
    # before: a bare AssertionError (nothing at all under python -O), and max_backoff_s -1 or nan was taken: every
    # pause 0, the retries spun
    (field_name,) = bad
    with pytest.raises(InvalidArgument, match=f"RetryPolicy.{field_name} must be"):
        RetryPolicy(**bad)


def test_a_client_refuses_a_retry_that_is_not_a_policy() -> None:
    with pytest.raises(InvalidArgument, match="retry must be a RetryPolicy"):  # before: AttributeError at a call
        FleetClient("127.0.0.1:1", retry=3)  # type: ignore[arg-type]


def test_a_policy_of_many_attempts_keeps_its_longest_backoff() -> None:
    # before: multiplier ** attempt overflowed past about 1,000 doublings and the call's retries raised OverflowError
    assert RetryPolicy(jitter=0.0).backoff(1100) == 3.0 and RetryPolicy(initial_backoff_s=0).backoff(1100) == 0.0
    port = free_port()  # nothing listens: every attempt is refused at once, over real gRPC on loopback
    many = RetryPolicy(max_attempts=1100, initial_backoff_s=0.0, max_backoff_s=0.0, deadline_s=120.0)
    with FleetClient(f"127.0.0.1:{port}", retry=many) as c, pytest.raises(Unavailable, match="1100 attempt"):
        c.whoami()


def test_only_unavailable_is_retryable() -> None:
    assert retryable(Status(grpc.StatusCode.UNAVAILABLE))
    assert [c for c in grpc.StatusCode if retryable(Status(c))] == [grpc.StatusCode.UNAVAILABLE]
    assert not retryable(Status(grpc.StatusCode.DEADLINE_EXCEEDED))  # the attempt may still be running


def test_the_schedule_stops_at_max_attempts_and_at_the_deadline() -> None:
    clock = Clock()
    tries = Attempts(RetryPolicy(max_attempts=3, initial_backoff_s=1.0, jitter=0.0, deadline_s=10.0), clock.monotonic)
    assert tries.next() == 10.0 and tries.failed(Status(grpc.StatusCode.UNAVAILABLE)) == 1.0
    clock.now += 1.0
    assert tries.next() == 9.0 and tries.failed(Status(grpc.StatusCode.UNAVAILABLE)) == 2.0
    clock.now += 2.0
    assert tries.next() == 7.0 and tries.failed(Status(grpc.StatusCode.UNAVAILABLE)) is None  # the last one
    assert tries.next() is None and tries.num_attempts == 3 and tries.elapsed() == 3.0

    # with a per-attempt timeout: all of it for the first attempt, past the deadline too; a retry stops at it
    cut = Attempts(RetryPolicy(max_attempts=3, initial_backoff_s=1.0, jitter=0.0, deadline_s=10.0), clock.monotonic)
    assert cut.next(120.0) == 120.0 and cut.failed(Status(grpc.StatusCode.UNAVAILABLE)) == 1.0
    clock.now += 1.0
    assert cut.next(120.0) == 9.0 == cut.timeout and cut.failed(Status(grpc.StatusCode.UNAVAILABLE)) == 2.0
    clock.now += 2.0
    assert cut.next(5.0) == 5.0

    late = Attempts(RetryPolicy(max_attempts=9, initial_backoff_s=5.0, jitter=0.0, deadline_s=2.0), clock.monotonic)
    assert late.next() == 2.0
    clock.now += 1.5
    assert late.failed(Status(grpc.StatusCode.UNAVAILABLE)) == 0.5  # the pause stops at the deadline
    clock.now += 0.5
    assert late.next() is None and late.num_attempts == 1


def test_no_retry_makes_one_attempt() -> None:
    tries = Attempts(NO_RETRY, Clock().monotonic)
    assert tries.next() == NO_RETRY.deadline_s and tries.failed(Status(grpc.StatusCode.UNAVAILABLE)) is None
    assert tries.next() is None


# -- FleetClient._call against the loop it replaced (the sync and async twins before the table) ------

def old_call(retry: RetryPolicy, clock: Clock, target: str, method: str, fn: Callable[[float], Any],
             timeout: float | None, default_timeout: float) -> Any:
    """The retry loop FleetClient._call ran before fleet/sdk/retry.py, verbatim but for the fake clock and one
    change made since: the first attempt has its whole per-attempt timeout, never cut by the retry deadline."""
    start, last, attempts = clock.monotonic(), None, 0
    for attempt in range(retry.max_attempts):
        remaining = retry.deadline_s - (clock.monotonic() - start)
        if remaining <= 0:
            break
        attempts += 1
        try:
            return fn(min(timeout or default_timeout, remaining) if attempt else timeout or default_timeout)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise base.to_error(e, method, target) from e
            last = e
        if attempt + 1 < retry.max_attempts:
            left = retry.deadline_s - (clock.monotonic() - start)
            clock.sleep(max(0.0, min(retry.backoff(attempt), left)))
    raise base.gave_up(method, target, attempts, clock.monotonic() - start, last)


def scripted(clock: Clock, rng: random.Random, trace: list[Any]) -> Callable[[float], str]:
    """An RPC that takes a random time and mostly fails UNAVAILABLE (sometimes NOT_FOUND, sometimes ok)."""
    outcomes = [rng.choice(["unavailable"] * 6 + ["not_found", "ok"]) for _ in range(20)]
    durations = [rng.choice([0.0, 0.05, 0.3, 1.0]) for _ in range(20)]
    calls = iter(range(20))

    def fn(timeout: float) -> str:
        i = next(calls)
        trace.append(("attempt", round(timeout, 9)))
        clock.now += min(durations[i], timeout)
        if outcomes[i] == "unavailable":
            raise Status(grpc.StatusCode.UNAVAILABLE, f"down {i}")
        if outcomes[i] == "not_found":
            raise Status(grpc.StatusCode.NOT_FOUND, f"no blob {i}")
        return f"ok {i}"
    return fn


def run(call: Callable[[Callable[[float], str]], str], seed: int, clock: Clock) -> list[Any]:
    trace: list[Any] = []
    fn = scripted(clock, random.Random(seed), trace)
    random.seed(seed)  # the policy's jitter
    try:
        trace.append(("result", call(fn)))
    except (Unavailable, NotFound) as e:
        trace.append((type(e).__name__, str(e)))
    return [*trace, ("sleeps", [round(s, 9) for s in clock.sleeps])]


@pytest.mark.parametrize("seed", range(60))
def test_fleet_client_retries_exactly_as_before(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(1000 + seed)
    policy = RetryPolicy(max_attempts=rng.randint(1, 7), initial_backoff_s=rng.choice([0.0, 0.1, 0.5]),
                         max_backoff_s=rng.choice([0.2, 3.0]), multiplier=rng.choice([1.0, 2.0]),
                         jitter=rng.choice([0.0, 0.2]), deadline_s=rng.choice([0.5, 2.0, 30.0]))
    per_attempt = rng.choice([None, 0.2, 120.0])

    old_clock = Clock()
    before = run(lambda fn: old_call(policy, old_clock, "t:1", "GetBlob", fn, per_attempt, 10.0), seed, old_clock)

    new_clock = Clock()
    monkeypatch.setattr(retry_module, "time", new_clock)
    monkeypatch.setattr(client_module, "time", new_clock)
    c = FleetClient("t:1", retry=policy)
    try:
        after = run(lambda fn: c._call("GetBlob", fn, per_attempt), seed, new_clock)
    finally:
        c.close()
    assert after == before
