"""A vLLM worker's LoRA adapters, read again from its /v1/models while it runs (Worker's part; controller/vllm/watcher.py).

NOTE: read only at registration, an adapter loaded at runtime (vLLM's /v1/load_lora_adapter) was never routed
(NotFound for good) and an unloaded one kept being routed (found by review). Now the reconcile loop looks every
`lora_refresh_s`, and a route for an adapter no worker lists makes them look (Router).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from controller.vllm.http import WorkerHttpError

if TYPE_CHECKING:
    from controller.registry import WorkerSpec
    from controller.vllm.http import VllmHttp

log = logging.getLogger("controller.vllm.watcher")  # the worker's own log, as before the move


class LoraLooks:
    """The looks at a worker's adapters; Worker sets `loras`, `_loras_at` (-inf) and `_loras_lock` in its __init__."""

    http: VllmHttp
    spec: WorkerSpec
    loras: dict[str, str]
    _loras_at: float
    _loras_lock: asyncio.Lock

    async def refresh_loras(self, min_age_s: float) -> None:
        """Look at the worker's adapters (one GET /v1/models) unless a look began less than `min_age_s` ago."""
        if time.monotonic() - self._loras_at < min_age_s:
            return
        async with self._loras_lock:
            if time.monotonic() - self._loras_at >= min_age_s:
                await self._look_loras()

    async def loras_since(self, asked: float, min_gap_s: float) -> None:
        """Return once a look that began at or after `asked` (monotonic) has ended: one already begun is shared,
        else one is taken, but no sooner than `min_gap_s` after the one before (what a flood of routes for an
        unknown adapter may cost: one GET per `min_gap_s`; each waits at most that long for its look)."""
        while self._loras_at < asked:
            wait = self._loras_at + min_gap_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            async with self._loras_lock:
                if self._loras_at < asked:
                    await self._look_loras()
        async with self._loras_lock:  # NOTE: a look holds the lock: the one that began after `asked` has ended
            pass

    async def _look_loras(self) -> None:
        """One GET /v1/models (under _loras_lock); a failed look keeps the adapters as they were."""
        self._loras_at = time.monotonic()
        try:
            loras = await self.http.loras()
        except WorkerHttpError as e:
            log.info("worker %s: its LoRA adapters are kept as they were (%s)", self.spec.name, e)
            return
        if loras != self.loras:
            log.info("worker %s serves LoRA adapters %s (before: %s)", self.spec.name, sorted(loras), sorted(self.loras))
            self.loras = loras  # NOTE: a new dict: a view already taken keeps the set it was taken with
