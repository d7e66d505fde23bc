"""Leader election for controllers sharing one store: a Redis lock, or a no-op on the embedded store.

Only the leader serves. A standby keeps its gRPC port open with health NOT_SERVING and answers
kvfleet RPCs with UNAVAILABLE (clients retry), until it takes the lock.
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any, Protocol

KEY = "kvfleet:controller:leader"
# Renew only if we still hold it; release only our own lock.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class LeaderLock(Protocol):
    ttl_s: float

    async def acquire(self) -> None: ...
    async def renew(self) -> bool: ...
    async def release(self) -> None: ...
    async def close(self) -> None: ...


class NoopLock:
    """The embedded store serves one controller: it always leads."""

    ttl_s = 3600.0

    async def acquire(self) -> None:
        return None

    async def renew(self) -> bool:
        return True

    async def release(self) -> None:
        return None

    async def close(self) -> None:
        return None


class RedisLock:
    """SET NX PX lock with a random owner id; renewed at ttl/3 by the holder."""

    def __init__(self, url: str, ttl_s: float = 10.0, key: str = KEY) -> None:
        import redis.asyncio as aredis

        self.ttl_s, self.key = ttl_s, key
        self.owner = secrets.token_hex(16)
        self._r: Any = aredis.Redis.from_url(url)

    async def acquire(self) -> None:
        while True:
            try:
                if await self._r.set(self.key, self.owner, nx=True, px=int(self.ttl_s * 1000)):
                    return
            except OSError:
                pass  # redis down: keep waiting, a standby must not crash
            except Exception as e:  # redis.exceptions.ConnectionError is not an OSError
                if "Connection" not in type(e).__name__:
                    raise
            await asyncio.sleep(self.ttl_s / 5)

    async def renew(self) -> bool:
        try:
            return bool(await self._r.eval(_RENEW, 1, self.key, self.owner, int(self.ttl_s * 1000)))
        except Exception:
            return False  # cannot prove we still hold it: step down

    async def release(self) -> None:
        try:
            await self._r.eval(_RELEASE, 1, self.key, self.owner)
        except Exception:
            pass  # redis down: the lock expires on its own after ttl_s

    async def close(self) -> None:
        await self._r.aclose()


def make_leader_lock(store_url: str, ttl_s: float = 10.0) -> LeaderLock:
    if store_url.startswith(("redis://", "rediss://", "unix://")):
        return RedisLock(store_url, ttl_s)
    return NoopLock()
