"""KeyedSlots as it was before its waiting keys were kept in a heap and its keys in use counted by slots held: each
freed slot looked over every waiting key, and a key past its share summed over every key in use. Kept as the
reference tests/controller/test_keyed_slots_same.py compares the class against (grant order and counts)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Hashable

from fleet.core.errors import Unavailable


@dataclasses.dataclass(slots=True)
class _Share:
    held: int = 0
    users: int = 0
    waiters: deque[asyncio.Future[None]] = dataclasses.field(default_factory=deque)


class ReferenceSlots:
    def __init__(self, per_key: int, total: int | None = None, key_name: str = "caller", name: str = "slots") -> None:
        self.per_key, self.total, self.key_name, self.name = per_key, total, key_name, name
        self.num_held = 0
        self._shares: dict[Hashable, _Share] = {}
        self._waiting: dict[Hashable, _Share] = {}

    def __len__(self) -> int:
        return len(self._shares)

    def share(self) -> int:
        if self.total is None:
            return self.per_key
        return max(1, self.per_key // max(1, len(self._shares)))

    def _may_take(self, share: _Share) -> bool:
        if not self._within(share):
            return False
        fair = self.share()
        return share.held < fair or self._lendable(fair)

    def _lendable(self, fair: int) -> bool:
        owed = sum(fair - s.held for s in self._shares.values() if s.held < fair)
        return self.num_held + 1 + owed <= self.per_key

    def _within(self, share: _Share) -> bool:
        if self.total is None:
            return share.held < self.per_key
        return self.num_held < self.per_key or (share.held == 0 and self.num_held < self.total)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable, timeout_s: float | None, what: str,
                   key_name: str | None = None) -> AsyncIterator[None]:
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = _Share()
            if self._waiting and self.total is not None:
                self._grant()
        share.users += 1
        try:
            if share.waiters or not self._may_take(share):
                await self._wait(key, share, timeout_s, what, key_name)
            else:
                share.held += 1
                self.num_held += 1
            try:
                yield
            finally:
                self._give_back(share)
        finally:
            share.users -= 1
            if share.users == 0:
                del self._shares[key]
                if self._waiting:
                    self._grant()

    def _give_back(self, share: _Share) -> None:
        share.held -= 1
        self.num_held -= 1
        if self._waiting:
            self._grant()

    def _grant(self) -> None:
        while self._waiting:
            fair = self.share()
            ready = [(s.held, k) for k, s in self._waiting.items() if self._within(s)]
            if not ready:
                return
            held, key = min(ready, key=lambda hk: hk[0])
            if held >= fair and not self._lendable(fair):
                return
            share = self._waiting[key]
            fut = share.waiters.popleft()
            if not share.waiters:
                del self._waiting[key]
            if fut.done():
                continue
            share.held += 1
            self.num_held += 1
            fut.set_result(None)

    async def _wait(self, key: Hashable, share: _Share, timeout_s: float | None, what: str,
                    key_name: str | None) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        share.waiters.append(fut)
        self._waiting.setdefault(key, share)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        except BaseException as e:
            if fut.done() and not fut.cancelled():
                self._give_back(share)
            else:
                with contextlib.suppress(ValueError):
                    share.waiters.remove(fut)
                if not share.waiters and self._waiting.get(key) is share:
                    del self._waiting[key]
            if isinstance(e, TimeoutError):
                raise self._refusal(share, what, timeout_s, key_name) from None
            raise

    def _refusal(self, share: _Share, what: str, timeout_s: float | None, key_name: str | None) -> Unavailable:
        if share.held >= self.share():
            busy = f"this {key_name or self.key_name} already has {share.held} of them"
            if self.total is not None and len(self._shares) > 1:
                busy += f" (its share while {len(self._shares)} callers use them)"
        else:
            busy = f"all {self.total} were busy"
        return Unavailable(f"{what}: {self.name}: {busy}, and none was free within {timeout_s}s")
