"""Leader election for controllers sharing one store: a Redis lock, or a no-op on the embedded store.

Only the leader serves. A standby keeps its gRPC port open with health NOT_SERVING and answers
kvfleet RPCs with UNAVAILABLE (clients retry), until it takes the lock.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from redis.exceptions import RedisError

from fleet.cas.redis_errors import is_connection_lost, is_readonly
from fleet.core.errors import Unavailable

KEY = "kvfleet:controller:leader"
LEASE_SHARE = 0.8  # of the ttl, from the start of a set or renew, that the holder trusts it still holds the lock
# Renew only if we still hold it; release only our own lock.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class LeaderLock(Protocol):
    ttl_s: float
    valid_until: float  # monotonic: until when, by this process's clock, the lock is surely still ours

    async def acquire(self) -> None: ...
    async def renew(self) -> bool: ...
    async def release(self) -> None: ...
    async def close(self) -> None: ...


class NoopLock:
    """The embedded store serves one controller: it always leads."""

    ttl_s = 3600.0
    valid_until = float("inf")

    async def acquire(self) -> None:
        return None

    async def renew(self) -> bool:
        return True

    async def release(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisLock:
    """SET NX PX lock with a random owner id; renewed at ttl/3 by the holder.

    `valid_until` is when the lock surely still holds by this process's clock: the start of the last call that
    set or renewed it, plus LEASE_SHARE of the ttl (Redis counts the ttl from when it ran the call, later). The
    holder steps down there whatever its renew is doing (controller.server: _lead), and the client's socket calls
    time out within a third of the ttl. NOTE: with neither, a leader whose path to Redis went silent (packets
    dropped, no reset) waited in its renew as long as the client's socket timeout (none in redis-py 5's asyncio
    client) and kept serving while a standby took the expired lock: two leaders.

    Every call goes through `_ask`, which resets the client's pool after a failover behind the address (module
    fleet.cas.redis_errors): before, the lock was asked of the demoted primary, READONLY, for ever.
    """

    def __init__(self, url: str, ttl_s: float = 10.0, key: str = KEY) -> None:
        import redis.asyncio as aredis

        self.ttl_s, self.key = ttl_s, key
        self.owner = secrets.token_hex(16)
        self.valid_until = 0.0
        self._r: Any = aredis.Redis.from_url(url, socket_timeout=ttl_s / 3, socket_connect_timeout=ttl_s / 3)

    async def _ask(self, call: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """One call to Redis. READONLY (the address now reaches a demoted primary, on a pooled connection) resets
        the pool and asks once more: a refused SET or script applied nothing, and a renew or release of our own
        lock gives the same result twice. A lost connection resets it too, and raises: its reply may be lost.
        NOTE: every pooled connection, in use or not: this client's calls come one at a time."""
        try:
            return await call(*args, **kwargs)
        except RedisError as e:
            if not (is_readonly(e) or is_connection_lost(e)):
                raise
            await self._r.connection_pool.disconnect()
            if not is_readonly(e):
                raise
        return await call(*args, **kwargs)

    async def acquire(self) -> None:
        while True:
            try:
                t0 = time.monotonic()
                if await self._ask(self._r.set, self.key, self.owner, nx=True, px=int(self.ttl_s * 1000)):
                    self.valid_until = t0 + LEASE_SHARE * self.ttl_s
                    return
            except (OSError, RedisError):
                # redis down, or silent (its client times out): keep waiting, a standby must not crash. NOTE: only
                # errors named "Connection..." were waited out; a timeout ended the leading task for good
                pass
            await asyncio.sleep(self.ttl_s / 5)

    async def renew(self) -> bool:
        try:
            t0 = time.monotonic()
            if await self._ask(self._r.eval, _RENEW, 1, self.key, self.owner, int(self.ttl_s * 1000)):
                self.valid_until = t0 + LEASE_SHARE * self.ttl_s
                return True
            return False
        except Exception:
            return False  # cannot prove we still hold it: step down

    async def release(self) -> None:
        try:
            await self._ask(self._r.eval, _RELEASE, 1, self.key, self.owner)
        except Exception:
            pass  # redis down: the lock expires on its own after ttl_s

    async def close(self) -> None:
        await self._r.aclose()


def make_leader_lock(store_url: str, ttl_s: float = 10.0) -> LeaderLock:
    if store_url.startswith(("redis://", "rediss://", "unix://")):
        return RedisLock(store_url, ttl_s)
    return NoopLock()


class FencedStore:
    """The store as a leader's router writes it: every kv write (kv_put, kv_delete, kv_swap) is refused (Unavailable)
    once `leading()` is false, that is once the leader's lease has run out by its own clock; reads and everything else
    go through. NOTE: a leader paused past its lease (a GC pause, a frozen VM) woke with its timers due before its
    renew: a verb that had timed out meanwhile wrote its worker's rank state over the new leader's (an older epoch,
    no fence), and the next leader read it back and routed WARM to a cache the new leader had seen reset (review
    finding, on a real Redis). A write issued within the lease and delivered after it is not caught here; the
    lease's margin (LEASE_SHARE) is what covers that window."""

    def __init__(self, store: Any, leading: Callable[[], bool]) -> None:
        self._store, self._leading = store, leading

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _fence(self, what: str, namespace: str, key: str) -> None:
        if not self._leading():
            raise Unavailable(f"{what} {namespace}/{key} refused: this controller's leader lease has run out (it "
                              "will stand by); the leader's writes are its alone")

    def kv_put(self, namespace: str, key: str, value: bytes) -> None:
        self._fence("kv_put", namespace, key)
        self._store.kv_put(namespace, key, value)

    def kv_delete(self, namespace: str, key: str) -> Any:
        self._fence("kv_delete", namespace, key)
        return self._store.kv_delete(namespace, key)

    def kv_swap(self, namespace: str, key: str, old: bytes | None, new: bytes | None) -> bool:
        self._fence("kv_swap", namespace, key)
        return bool(self._store.kv_swap(namespace, key, old, new))
