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
Cost: a slot taken or given back with none waiting is a few dict and list steps. The waiting keys are kept in a
heap by slots held, then by when the key began to wait (the order the shares keep among equals), so a freed slot
finds the one holding the fewest in O(log of the keys waiting); the keys in use are counted by slots held (at most
`per_key` of them), so what the keys under their share are owed, for a key past its share, is O(per_key).
NOTE: before, each freed slot with callers waiting looked over every waiting key, and a key past its share summed
over every key in use. CPU per held slot, 1 / 100 / 1000 keys flooding 38 of 50 slots (the proxy's default; 4
callers a key, 200 at least, each holding its slot one loop pass), side by side in one run: 9.2 / 21.7 / 155 us
before, 9.0 / 9.5 / 10.8 now (a semaphore per key and one for the total, before the shares: 11.8 / 12.1 / 15.0).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import itertools
import operator
from collections import deque
from collections.abc import AsyncIterator, Hashable

from fleet.core.errors import Unavailable


class SlotsBusy(Unavailable):
    """No slot was free in time. `local`: refused by this process's own slots, not relayed from another (the proxy
    answers it as its own, controller/proxy/errors.py from_fleet)."""

    local = True


@dataclasses.dataclass(slots=True)
class _Share:
    held: int = 0
    users: int = 0  # callers holding or waiting for one of its slots
    waiters: deque[asyncio.Future[None]] = dataclasses.field(default_factory=deque)  # in arrival order
    since: int = 0  # when the key began to wait (a count): the line's order among keys holding as many
    place: _Place | None = None  # its place in the line while it waits; the line's other entries for it are stale


_Place = tuple[int, int, Hashable, _Share]  # (held, since, key, share): since is unique, so no key is compared


class KeyedSlots:
    """`total` slots (None: no bound but the keys'), at most `per_key` of them per key (split between the keys in
    use where there is a total). For the error: what the slots are (`name`) and what a key is (`key_name`)."""

    def __init__(self, per_key: int, total: int | None = None, key_name: str = "caller", name: str = "slots") -> None:
        self.per_key, self.total, self.key_name, self.name = per_key, total, key_name, name
        self.num_held = 0
        self._shares: dict[Hashable, _Share] = {}
        self._waiting: dict[Hashable, _Share] = {}  # keys with a caller waiting
        self._line: list[_Place] = []  # a heap of the waiting keys' places (and stale ones, dropped as met)
        self._since = itertools.count()
        self._num_by_held = [0] * (per_key + 2)  # keys in use, by slots held (a key holds at most per_key)

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
        owed: int = sum(map(operator.mul, self._num_by_held[:fair], range(fair, 0, -1)))  # fair - held, each key under
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
            self._num_by_held[0] += 1
            if self._waiting and self.total is not None:
                self._grant()  # one key more: the shares shrank, so a slot may be lendable now
        share.users += 1
        try:
            if share.waiters or not self._may_take(share):  # NOTE: a key's callers get its slots in arrival order
                await self._wait(key, share, timeout_s, what, key_name)
            else:
                self._add(share, 1)
            try:
                yield
            finally:
                self._give_back(share)
        finally:
            share.users -= 1
            if share.users == 0:
                del self._shares[key]
                self._num_by_held[0] -= 1
                if self._waiting:
                    self._grant()  # one key fewer: the others' shares grew

    def _give_back(self, share: _Share) -> None:
        self._add(share, -1)
        if self._waiting:
            self._grant()

    def _add(self, share: _Share, num: int) -> None:
        """`num` slots more held by `share` (one, or one given back): counted, and its place in the line moved."""
        num_by_held = self._num_by_held
        num_by_held[share.held] -= 1
        share.held += num
        num_by_held[share.held] += 1
        self.num_held += num
        if share.place is not None:
            self._place(share.place[2], share)

    def _place(self, key: Hashable, share: _Share) -> None:
        """Put `share` in the line at its slots held (the place it had, if any, goes stale)."""
        share.place = (share.held, share.since, key, share)
        heapq.heappush(self._line, share.place)
        if len(self._line) > 2 * len(self._waiting) + 64:  # NOTE: stale places dropped at once now and then
            self._line = [s.place for s in self._waiting.values() if s.place is not None]
            heapq.heapify(self._line)

    def _first(self) -> _Place:
        """The waiting key holding the fewest, the first to wait among those holding as many."""
        line = self._line
        while line[0][3].place is not line[0]:
            heapq.heappop(line)
        return line[0]

    def _leave_line(self, key: Hashable, share: _Share) -> None:
        del self._waiting[key]
        share.place = None

    def _grant(self) -> None:
        """Free slots to the waiting keys under their share, the one holding the fewest first; then, where lendable,
        to the waiting key past its share holding the fewest."""
        while self._waiting:
            fair = self.share()
            _, _, key, share = self._first()  # NOTE: the others are within per_key only where it is (holding more)
            if not self._within(share) or (share.held >= fair and not self._lendable(fair)):
                return
            fut = share.waiters.popleft()
            if not share.waiters:
                self._leave_line(key, share)
            if fut.done():  # NOTE: cancelled, its caller not resumed yet; it takes itself out of the queue
                continue
            self._add(share, 1)
            fut.set_result(None)

    async def _wait(self, key: Hashable, share: _Share, timeout_s: float | None, what: str,
                    key_name: str | None) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        share.waiters.append(fut)
        if key not in self._waiting:
            self._waiting[key] = share
            share.since = next(self._since)
            self._place(key, share)
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
                    self._leave_line(key, share)
            if isinstance(e, TimeoutError):  # NOTE: the message is built only here, never on the way in
                raise self._refusal(share, what, timeout_s, key_name) from None
            raise

    def _refusal(self, share: _Share, what: str, timeout_s: float | None, key_name: str | None) -> SlotsBusy:
        if share.held >= self.share():
            busy = f"this {key_name or self.key_name} already has {share.held} of them"
            if self.total is not None and len(self._shares) > 1:
                busy += f" (its share while {len(self._shares)} callers use them)"
        else:
            busy = f"all {self.total} were busy"
        return SlotsBusy(f"{what}: {self.name}: {busy}, and none was free within {timeout_s}s")
