"""The asyncio shell of the clock: plays a SimEngine's modelled steps out in (scaled) real time.

    loop:  wait for a kick -> deliver outputs -> plan a step -> sleep duration_s * time_scale
           -> finish it (tokens, events) -> deliver outputs -> plan the next ... until none

Each request gets a `Ticket`: its Seq and a queue of `sched.Output`s. A handler that leaves (client
gone, cancelled) must `release` its ticket, which aborts the seq and frees its slot and blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.sched import FINISHED, Output, Seq

log = logging.getLogger("kvfleet.sim_vllm")


@dataclass(slots=True)
class Ticket:
    seq: Seq
    queue: asyncio.Queue[Output] = field(default_factory=asyncio.Queue)

    async def next(self) -> Output:
        return await self.queue.get()


class EngineLoop:
    """Owns the task that steps one engine; `submit` / `release` are called by the HTTP handlers."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self._tickets: dict[int, Ticket] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Abort what is in flight (its handlers end), then stop stepping."""
        self.engine.sched.abort_all("abort")
        self._deliver()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        report_full: bool = False,
        priority: int = 0,
        skip_cache: bool = False,
    ) -> Ticket:
        """Queue a request; raises EnginePaused while paused with abort|wait."""
        seq = self.engine.submit(
            token_ids, max_tokens, lora=lora, cache_salt=cache_salt, report_full=report_full, priority=priority,
            skip_cache=skip_cache,
        )
        t = self._tickets[seq.seq_id] = Ticket(seq)
        return t

    def release(self, t: Ticket) -> None:
        """The handler is done with the ticket; a seq still in flight is aborted (vLLM: client disconnect)."""
        self._tickets.pop(t.seq.seq_id, None)
        if t.seq.state != FINISHED:
            self.engine.abort(t.seq)

    async def _run(self) -> None:
        try:
            await self._steps()
        except Exception:  # NOTE: a dead loop would hang every request: say so loudly
            log.exception("sim-vllm engine loop crashed")
            raise

    async def _steps(self) -> None:
        eng = self.engine
        while True:
            await eng.kick.wait()
            eng.kick.clear()
            self._deliver()
            while (step := eng.plan()) is not None:
                await asyncio.sleep(step.duration_s * eng.cfg.time_scale)
                eng.finish(step)
                self._deliver()
            self._deliver()

    def _deliver(self) -> None:
        for out in self.engine.sched.take_outputs():
            t = self._tickets.get(out.seq_id)
            if t is not None:
                t.queue.put_nowait(out)
