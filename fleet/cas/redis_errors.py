"""What a Redis store call does when Redis refuses it or cannot be reached (redis-py is imported only here and in
fleet.cas.redis, i.e. only when a redis:// URL is opened).

A refusal becomes a fleet.core.errors error with an actionable message (Unavailable, ResourceExhausted).

A failover behind a stable address (Sentinel, a managed Redis, a Kubernetes Service) demotes the primary the
store's pooled connections reach and sends new connections to the new primary; the demoted one keeps the old
connections open and refuses their writes READONLY. So READONLY drops the pool's idle connections, which then
reconnect through the address, and runs the call once more:

- a call with one write: READONLY means Redis did not apply it (a replica refuses a write before applying it,
  and a script stops at its first write), so running it again never applies it twice;
- a call with several writes has only writes that leave the same result when applied twice (a put of the same
  bytes, a lease extended to the same time, a delete): a failover between two of them is harmless.
  NOTE: a new method with two writes of which one is not so (an RPUSH, a counter) must not be retried.

A connection error or timeout drops the idle connections too (the next call connects afresh, to whatever the
address names by then) but is NOT retried: its reply may be lost after Redis applied it.

NOTE: only the idle connections: closing those in use by other threads would cut their calls off and lose
replies. One in use at the reset that reaches the demoted primary is given back afterwards, and its next write
meets READONLY and resets the pool again: the pool converges in a few calls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn, Protocol, TypeVar

import redis

from fleet.core.errors import ResourceExhausted, Unavailable

F = TypeVar("F", bound=Callable[..., Any])


class _RedisStore(Protocol):
    host: str
    port: int
    r: redis.Redis


def is_readonly(e: BaseException) -> bool:
    """Redis refused a write: the server reached is a replica (a plain command's READONLY is parsed into
    ReadOnlyError; a script's is a ResponseError that quotes it)."""
    return isinstance(e, redis.exceptions.ReadOnlyError) or (
        isinstance(e, redis.exceptions.ResponseError) and "READONLY" in str(e))


def is_connection_lost(e: BaseException) -> bool:
    return isinstance(e, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError)


def _raise_translated(store: _RedisStore, e: redis.exceptions.RedisError) -> NoReturn:
    where = f"redis at {store.host}:{store.port}"
    if is_connection_lost(e):
        raise Unavailable(f"{where} unreachable: {e}; check that redis-server is running and the store URL is "
                          "right") from e
    if isinstance(e, redis.exceptions.InvalidResponse):  # NOTE: before, a traceback out of `kvfleet controller`
        raise Unavailable(f"{store.host}:{store.port} does not answer as Redis does ({e}); check that the store "
                          "URL names a redis-server") from e
    # NOTE: redis-py parses a plain command's OOM and READONLY replies into their own classes, their code cut from
    # the message, so text checks alone saw neither: a kv_put at maxmemory raised a raw OutOfMemoryError
    if isinstance(e, redis.exceptions.OutOfMemoryError) or "OOM command not allowed" in str(e):
        raise ResourceExhausted(f"{where} is out of memory (maxmemory): {e}") from e
    if is_readonly(e) or (isinstance(e, redis.exceptions.ResponseError)
                          and any(code in str(e) for code in ("MISCONF", "LOADING"))):
        raise Unavailable(f"{where} cannot accept writes now: {e}") from e
    raise e


def _reset_after(store: _RedisStore, e: redis.exceptions.RedisError) -> bool:
    """Drop the pool's idle connections after READONLY or a lost connection; True: READONLY (run it again)."""
    readonly = is_readonly(e)
    if readonly or is_connection_lost(e):
        store.r.connection_pool.disconnect(inuse_connections=False)
    return readonly


def store_call(fn: F) -> F:
    """One store call on Redis: errors translated, READONLY retried once on fresh connections (module doc)."""

    @functools.wraps(fn)
    def wrapper(self: _RedisStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except redis.exceptions.RedisError as e:
            if not _reset_after(self, e):
                _raise_translated(self, e)
        try:
            return fn(self, *args, **kwargs)
        except redis.exceptions.RedisError as e:
            _reset_after(self, e)
            _raise_translated(self, e)

    return wrapper  # type: ignore[return-value]
