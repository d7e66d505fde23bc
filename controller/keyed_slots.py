"""Slots shared by many callers, at most a share of them held by one key (a tenant, a client token).

One key's flood waits on its own share, so the others still find slots (one tenant never slows another). A
key's share exists only while a caller holds or waits for one of its slots, so the map holds keys in use only.

Where the slots have a `total`, a key's share is `per_key` split evenly between the keys in use (holding or
waiting): `per_key // n`, at least 1. Alone, a key holds `per_key` (three quarters of the slots, as each user
sets it); two keys flooding at once hold half of that each. The keys together take at most `per_key` slots, except
a key's first one: so the rest stays free for a key that comes, which takes one at once, even while the keys that
held more than their share before it came still hold it. A freed slot goes to the waiting key that holds the
fewest, among those under their share. A key past its share takes (is lent) a slot still free within `per_key`
where, that one taken, every key in use could still reach its share within `per_key` (the fewest-held first
again): the slots the others leave idle are used, and no key under its share waits for a lent one to come back.
NOTE: before, a key at its share waited whatever was free: with 4 tenants in use (a share of 6 // 4 = 1 of 8
slots), a tenant whose one slot was held by a slow call had its next Route wait the route timeout beside 4 idle
slots, then a 503 (test_proxy_fair_slots.py). A lent slot comes back as its call ends, as a share does.
NOTE: before, each key's share was `per_key` whatever the others held: two keys flooding at once held every slot
between them, and a third key's caller waited behind their waiters for a freed slot, in arrival order, until its
timeout (tests/controller/proxy/test_proxy_fair_slots.py).
Cost: a slot taken with one free is a dict lookup and a `len` of the map (past the key's share, a look over the
keys in use); a freed slot with callers waiting looks over the keys that wait (a loop over them per slot granted,
and over the keys in use for a key past its share: only when some wait).
"""

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
    users: int = 0  # callers holding or waiting for one of its slots
    waiters: deque[asyncio.Future[None]] = dataclasses.field(default_factory=deque)  # in arrival order


class KeyedSlots:
    """`total` slots (None: no bound but the keys'), at most `per_key` of them per key (split between the keys in
    use where there is a total). For the error: what the slots are (`name`) and what a key is (`key_name`)."""

    def __init__(self, per_key: int, total: int | None = None, key_name: str = "caller", name: str = "slots") -> None:
        self.per_key, self.total, self.key_name, self.name = per_key, total, key_name, name
        self.num_held = 0
        self._shares: dict[Hashable, _Share] = {}
        self._waiting: dict[Hashable, _Share] = {}  # keys with a caller waiting

    def __len__(self) -> int:
        return len(self._shares)

    def share(self) -> int:
        """How many slots one key may hold now."""
        if self.total is None:
            return self.per_key
        return max(1, self.per_key // max(1, len(self._shares)))

    def _may_take(self, share: _Share) -> bool:
        """Within `per_key` held by all the keys together, or the key's first (see above); and under its share, or
        lendable (an idle slot no key in use needs to reach its share)."""
        if not self._within(share):
            return False
        fair = self.share()
        return share.held < fair or self._lendable(fair)

    def _lendable(self, fair: int) -> bool:
        """A slot may go to a key past its share: one more taken, every key in use can still reach its share
        within `per_key` (no key under its share waits for a lent slot to come back)."""
        owed = sum(fair - s.held for s in self._shares.values() if s.held < fair)
        return self.num_held + 1 + owed <= self.per_key

    def _within(self, share: _Share) -> bool:
        """Within `per_key` held by all the keys together, or the key's first (its share aside)."""
        if self.total is None:
            return share.held < self.per_key
        return self.num_held < self.per_key or (share.held == 0 and self.num_held < self.total)

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable, timeout_s: float | None, what: str,
                   key_name: str | None = None) -> AsyncIterator[None]:
        """One slot for `key` while the block runs; waited for at most `timeout_s` (None: as long as it takes),
        then Unavailable naming `what` (the call), the slots and the bound that was full (`key_name`: what this
        key is, where it is not the slots' `key_name`)."""
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = _Share()
            if self._waiting and self.total is not None:
                self._grant()  # one key more: the shares shrank, so a slot may be lendable now
        share.users += 1
        try:
            if share.waiters or not self._may_take(share):  # NOTE: a key's callers get its slots in arrival order
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
                    self._grant()  # one key fewer: the others' shares grew

    def _give_back(self, share: _Share) -> None:
        share.held -= 1
        self.num_held -= 1
        if self._waiting:
            self._grant()

    def _grant(self) -> None:
        """Free slots to the waiting keys under their share, the one holding the fewest first; then, where lendable,
        to the waiting key past its share holding the fewest."""
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
            if fut.done():  # NOTE: cancelled, its caller not resumed yet; it takes itself out of the queue
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
            if fut.done() and not fut.cancelled():  # granted as the wait ended: the slot goes to the next
                self._give_back(share)
            else:
                with contextlib.suppress(ValueError):
                    share.waiters.remove(fut)
                if not share.waiters and self._waiting.get(key) is share:
                    del self._waiting[key]
            if isinstance(e, TimeoutError):  # NOTE: the message is built only here, never on the way in
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
