"""Slots shared by many callers, at most `per_key` of them held by one key (a tenant, a client token).

One key's flood waits on its own share, so the others still find slots (one tenant never slows another). A
key's share exists only while a caller holds or waits for one of its slots, so the map holds keys in use only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Hashable

from fleet.core.errors import Unavailable


@dataclasses.dataclass(slots=True)
class _Share:
    slots: asyncio.Semaphore
    users: int = 0  # callers holding or waiting for one of its slots


class KeyedSlots:
    """`total` slots (None: no bound but the keys'), at most `per_key` of them per key. For the error: what the
    slots are (`name`) and what a key is (`key_name`)."""

    def __init__(self, per_key: int, total: int | None = None, key_name: str = "caller", name: str = "slots") -> None:
        self.per_key, self.total, self.key_name, self.name = per_key, total, key_name, name
        self._all = asyncio.Semaphore(total) if total is not None else None
        self._shares: dict[Hashable, _Share] = {}

    def __len__(self) -> int:
        return len(self._shares)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable, timeout_s: float | None, what: str,
                   key_name: str | None = None) -> AsyncIterator[None]:
        """One slot for `key` while the block runs; waited for at most `timeout_s` (None: as long as it takes),
        then Unavailable naming `what` (the call), the slots and the bound that was full (`key_name`: what this
        key is, where it is not the slots' `key_name`)."""
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = _Share(asyncio.Semaphore(self.per_key))
        share.users += 1
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        try:
            await self._acquire(share.slots, deadline, what, timeout_s, key_name, whole=False)
            try:
                if self._all is not None:
                    await self._acquire(self._all, deadline, what, timeout_s, key_name, whole=True)
            except BaseException:
                share.slots.release()
                raise
            try:
                yield
            finally:
                if self._all is not None:
                    self._all.release()
                share.slots.release()
        finally:
            share.users -= 1
            if share.users == 0:
                self._shares.pop(key, None)

    async def _acquire(self, sem: asyncio.Semaphore, deadline: float | None, what: str, timeout_s: float | None,
                       key_name: str | None, *, whole: bool) -> None:
        if deadline is None or not sem.locked():  # NOTE: a free slot is taken at once (wait_for: one loop pass more)
            await sem.acquire()
            return
        try:
            await asyncio.wait_for(sem.acquire(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:  # NOTE: the message is built only here, never on the way in
            busy = (f"all {self.total} were busy" if whole
                    else f"this {key_name or self.key_name} already has {self.per_key} of them")
            raise Unavailable(f"{what}: {self.name}: {busy}, and none was free within {timeout_s}s") from None
