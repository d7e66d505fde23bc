"""KeyedSlots grants the same slots in the same order as the class before its waiting keys were kept in a heap
(tests/controller/keyed_slots_reference.py): random callers over many keys hold, release, are cancelled and time
out, the same script against both, on an event loop whose clock moves only when the script says (so the timeouts
fall at the same steps); each caller's grant, refusal (its message) and cancellation is logged in order, with the
slots held, the keys in use and the share after each step."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from keyed_slots_reference import ReferenceSlots

from controller.keyed_slots import KeyedSlots
from fleet.core.errors import Unavailable


class _StillClock(asyncio.SelectorEventLoop):
    """Time moves only when the script moves it (the script always has a step ready: the loop never sleeps)."""

    now = 0.0

    def time(self) -> float:
        return self.now


class _Script:
    def __init__(self, slots: Any, rng: random.Random, num_keys: int) -> None:
        self.slots, self.rng, self.num_keys = slots, rng, num_keys
        self.log: list[tuple[Any, ...]] = []
        self.callers: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = {}
        self.holding: set[int] = set()

    async def caller(self, cid: int, key: str, timeout_s: float | None, done: asyncio.Event) -> None:
        try:
            async with self.slots.hold(key, timeout_s, "call"):
                self.holding.add(cid)
                self.log.append(("got", cid, key))
                await done.wait()
            self.log.append(("gave back", cid))
        except Unavailable as e:
            self.log.append(("refused", cid, str(e)))
        except asyncio.CancelledError:
            self.log.append(("cancelled", cid))
        finally:
            self.holding.discard(cid)
            del self.callers[cid]

    def start(self, cid: int) -> None:
        rng = self.rng
        key = f"k{rng.randrange(3) if rng.random() < 0.5 else rng.randrange(self.num_keys)}"  # 3 flood, many come by
        timeout_s = None if rng.random() < 0.4 else rng.choice((0.0, 1.0, 2.5, 7.0))
        done = asyncio.Event()
        self.callers[cid] = (asyncio.ensure_future(self.caller(cid, key, timeout_s, done)), done)

    def step(self, loop: _StillClock, cid: int) -> None:
        rng, op = self.rng, self.rng.random()
        holding = sorted(self.holding)
        if op < 0.5:
            self.start(cid)
        elif op < 0.75 and holding:
            self.callers[rng.choice(holding)][1].set()
        elif op < 0.85 and self.callers:
            self.callers[rng.choice(sorted(self.callers))][0].cancel()
        elif op < 0.92 and holding and self.callers:  # a release and a cancel in one pass: granted, then cancelled
            self.callers[rng.choice(holding)][1].set()
            self.callers[max(self.callers)][0].cancel()
        else:
            loop.now += rng.choice((0.5, 1.0, 3.0))

    async def run(self, num_steps: int) -> list[tuple[Any, ...]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, _StillClock)
        for cid in range(num_steps):
            self.step(loop, cid)
            for _ in range(4):
                await asyncio.sleep(0)
            self.log.append(("state", self.slots.num_held, len(self.slots), self.slots.share()))
        for task, done in list(self.callers.values()):  # the end: every holder releases, every waiter gives up
            done.set()
            task.cancel()
        for _ in range(4):
            await asyncio.sleep(0)
        assert not self.callers and self.slots.num_held == 0 and len(self.slots) == 0 and not self.slots._waiting
        return self.log


def _run(cls: type, seed: int, per_key: int, total: int | None, num_keys: int, num_steps: int) -> list[Any]:
    loop = _StillClock()
    try:
        return loop.run_until_complete(_Script(cls(per_key, total), random.Random(seed), num_keys).run(num_steps))
    finally:
        loop.close()


@pytest.mark.parametrize("seed", range(12))
def test_grants_refusals_and_counts_are_the_references(seed: int) -> None:
    rng = random.Random(seed)
    per_key = rng.randint(1, 8)
    total = None if seed % 4 == 3 else per_key + rng.randint(0, 4)
    num_keys = rng.choice((3, 20, 200))
    args = (seed, per_key, total, num_keys, 1500)
    want, got = _run(ReferenceSlots, *args), _run(KeyedSlots, *args)
    assert sum(e[0] == "got" for e in want) > 100 and sum(e[0] == "refused" for e in want) > 10  # not vacuous
    assert sum(e[0] == "cancelled" for e in want) > 10
    for i, (w, g) in enumerate(zip(want, got, strict=False)):
        assert g == w, f"step {i}: {g} where the reference has {w} (per_key={per_key}, total={total})"
    assert len(got) == len(want)
