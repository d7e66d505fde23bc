"""A step run on the event loop now and then every interval: the controller's schedules (store GC,
fleet metrics, the proxy's worker directory) share this one loop.

    task = Periodic("kvfleet-store-gc", 300.0, step, on_error=lambda e: log.warning(...))
    await task.start()        # runs `step` now, then every interval_s (interval_s 0: never starts)
    await task.stop()         # cancels and waits

A step that raises is passed to `on_error` and the loop goes on: a schedule never takes its owner down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class Periodic:
    def __init__(self, name: str, interval_s: float, step: Callable[[], Awaitable[object]],
                 on_error: Callable[[Exception], None]) -> None:
        self.name, self.interval_s, self.step, self.on_error = name, interval_s, step, on_error
        self._task: asyncio.Task[None] | None = None

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except Exception as e:  # noqa: BLE001 - reported; the next run retries
                self.on_error(e)
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        """Start the schedule (no-op when interval_s is 0 or it already runs)."""
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()
