"""A worker's tail polls (controller/vllm/subscriber.py `poll_tail`), one per rank each reconcile tick, side by side.

Each rank's polls run one after another (a rank whose last poll is still out gets no new one this tick), at most
`most` ranks' at once, and no rank waits for another's: a rank whose replay endpoint does not answer holds only its
own poll (for up to its StreamLimits), never another rank's recovery of a lost final batch.
NOTE: one after another, each tick polling every rank in turn, a silent replay endpoint held every other rank's
poll for its replay timeout each tick (1 s of silence by default, up to the replay deadline for a trickle).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol


class Tail(Protocol):
    async def poll_tail(self) -> int: ...


class TailPolls:
    """Starts each rank's next tail poll (`start`) and reports how each ended (`done(rank, error or None)`)."""

    def __init__(self, most: int, done: Callable[[int, Exception | None], None]) -> None:
        self._gate, self._done = asyncio.Semaphore(most), done
        self._polls: dict[int, asyncio.Task[None]] = {}

    def start(self, subs: Sequence[tuple[int, Tail]]) -> None:
        """A poll of each (rank, stream) in `subs` whose previous poll has ended (or that has none yet)."""
        loop = asyncio.get_running_loop()
        for rank, sub in subs:
            prev = self._polls.get(rank)
            if prev is None or prev.done():
                self._polls[rank] = loop.create_task(self._poll(rank, sub))

    async def _poll(self, rank: int, sub: Tail) -> None:
        async with self._gate:
            try:
                await sub.poll_tail()
            except Exception as e:
                self._done(rank, e)
                return
        self._done(rank, None)

    async def stop(self) -> None:
        """Cancel the polls still out and wait for them to end."""
        polls, self._polls = list(self._polls.values()), {}
        for t in polls:
            t.cancel()
        for t in polls:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
