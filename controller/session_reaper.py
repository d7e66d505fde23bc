"""Which sessions are in use, and the idle reaper (controller/sessions.py's): a session is released by the reaper
only with no call of it in flight, and a call arriving during its release waits for it.

The reaper releases the actor of every live session that no call touched for the idle TTL; its record and op log
stay, so it regenerates on its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container
from typing import Any

from controller.quotas import SessionLimits
from fleet.core.errors import NotFound

log = logging.getLogger("kvfleet.controller")
Key = tuple[str, str]  # (tenant, session)


class SessionActivity:
    """The sessions' calls in flight, when each was last touched, and those whose actor is being released."""

    def __init__(self) -> None:
        self.in_flight: dict[Key, int] = {}
        self.touched: dict[Key, float] = {}
        self.reaping: dict[Key, asyncio.Event] = {}  # sessions whose actor is being released

    @contextlib.asynccontextmanager
    async def calling(self, key: Key) -> AsyncIterator[None]:
        """Session `key` is marked in flight and touched while the block runs, so the reaper leaves it alone. A call
        for a session whose actor the reaper is releasing waits for the release to end, then runs on the
        regenerated actor (never on an actor being stopped under it)."""
        while (releasing := self.reaping.get(key)) is not None:
            await releasing.wait()
        self.in_flight[key] = self.in_flight.get(key, 0) + 1  # NOTE: no await since the check above
        exists = key in self.touched
        try:
            yield
            exists = True
        except NotFound:
            exists = False  # no such session: nothing to remember about it (ids a tenant made up)
            raise
        finally:
            self.in_flight[key] -= 1
            if not self.in_flight[key]:
                del self.in_flight[key]
            if exists:
                self.touched[key] = time.time()
            else:
                # NOTE: a call that failed on a session never seen to exist (a create refused: the fleet had no room)
                # left an entry for good, one per new id a tenant tried (review finding)
                self.touched.pop(key, None)

    async def reap_idle(self, listed: list[dict[str, Any]], ttl_s: float, now: float, creating: Container[Key],
                        release: Callable[..., Awaitable[Any]]) -> list[Key]:
        """Release (`release(tenant, session)`) every live session of the fleet's rows `listed` that no call touched
        for `ttl_s` seconds (none in flight, none being created). Returns the (tenant, session) pairs released."""
        out = []
        for r in listed:
            key = (r["tenant"], r["session"])
            if r.get("state") not in ("active", "regenerated") or key in self.in_flight or key in creating \
                    or key in self.reaping:
                continue
            last = max(float(r.get("last_active") or 0.0), float(r.get("created") or 0.0), self.touched.get(key, 0.0))
            if now - last <= ttl_s:
                continue
            released = self.reaping[key] = asyncio.Event()  # NOTE: no await since the checks above
            try:
                with contextlib.suppress(NotFound):   # closed meanwhile
                    await release(*key)
                    out.append(key)
            finally:
                del self.reaping[key]
                released.set()
        if out:
            log.info("released %d idle session kernel(s) (idle > %.0fs): %s", len(out), ttl_s, out)
        return out


async def reap_loop(limits: Callable[[], SessionLimits], prune: Callable[[], object],
                    reap_idle: Callable[[float], Awaitable[Any]]) -> None:
    """Every reap interval, release the actors of sessions idle past the TTL (0: never)."""
    while True:
        lim = limits()
        await asyncio.sleep(lim.reap_interval_s)
        prune()  # the lanes of tenants with no call running or waiting
        if not lim.idle_ttl_s:
            continue
        try:
            await reap_idle(lim.idle_ttl_s)
        except Exception:  # noqa: BLE001 - one failed pass (a node going away) never stops reaping
            log.exception("idle-session reaping failed; retrying next interval")
