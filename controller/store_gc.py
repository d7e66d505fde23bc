"""The store's garbage collection on a schedule: only the leader runs it (DESIGN §6).

    gc = StoreGc(store, metrics, GcConfig(interval_s=300))
    await gc.start()          # one run now (a restarted leader collects what expired while it was down),
    ...                       # then one every interval_s
    await gc.stop()

A run deletes every unpinned, unreferenced blob whose lease ran out (`BlobStore.gc`), then prunes the
quarantine records no request carried for `record_ttl_s` (controller.quarantine_records.prune_records), then the
cached verdicts idle for `verdict_ttl_s` (`record_ttl_s` for a QUARANTINED one; fleet.core.quarantine.cache.
prune): at most PRUNE_ROWS rows of them per run, the next run going on where this one stopped, so a backlog
of millions is worked off over runs instead of holding one. A failing run (the store down) is logged and
counted and the loop goes on: GC never takes the controller down.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller.metrics import Metrics
from controller.periodic import Periodic
from controller.quarantine_records import RECORD_TTL_S, prune_records
from fleet.core.errors import InvalidArgument
from fleet.core.quarantine.cache import TOUCH_INTERVAL_S
from fleet.core.quarantine.cache import prune as prune_verdicts

log = logging.getLogger("kvfleet.controller.gc")
DEFAULT_GC_INTERVAL_S = 300.0
# A cached verdict no request used for this long is pruned: an agent resends its tool results every turn, so
# one not seen for a day belongs to a finished conversation; seen again, it is judged again (once).
DEFAULT_VERDICT_TTL_S = 86400.0

Blocking = Callable[..., Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class GcConfig:
    """interval_s: seconds between two runs of the leader's GC; 0 turns the schedule off (the
    CollectGarbage RPC still runs it on demand). verdict_ttl_s: a cached verdict idle this long is pruned
    (at least twice TOUCH_INTERVAL_S: a verdict in use has a last use at most that old)."""

    interval_s: float = DEFAULT_GC_INTERVAL_S
    verdict_ttl_s: float = DEFAULT_VERDICT_TTL_S

    def __post_init__(self) -> None:
        if not self.interval_s >= 0 or self.interval_s == float("inf"):
            raise InvalidArgument(f"--gc-interval must be a finite number of seconds >= 0 (0: off), "
                                  f"got {self.interval_s}")
        if not 2 * TOUCH_INTERVAL_S <= self.verdict_ttl_s < float("inf"):
            raise InvalidArgument(f"--verdict-ttl must be a finite number of seconds >= {2 * TOUCH_INTERVAL_S:.0f}, "
                                  f"got {self.verdict_ttl_s}")


def add_gc_flag(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """--gc-interval and --verdict-ttl (env KVFLEET_GC_INTERVAL, KVFLEET_VERDICT_TTL), shared by
    `kvfleet controller` and `kvfleet up`.

    The default is a string on purpose: argparse converts it like a command-line value, so a bad
    KVFLEET_GC_INTERVAL is a usage error naming the flag, never a traceback."""
    p.add_argument(
        "--gc-interval",
        type=float,
        default=env.get("KVFLEET_GC_INTERVAL", str(DEFAULT_GC_INTERVAL_S)),
        help=f"seconds between the leader's store GC runs; 0: off (default {DEFAULT_GC_INTERVAL_S:.0f}; "
        "env KVFLEET_GC_INTERVAL)",
    )
    p.add_argument(
        "--verdict-ttl",
        type=float,
        default=env.get("KVFLEET_VERDICT_TTL", str(DEFAULT_VERDICT_TTL_S)),
        help=f"seconds a cached verdict no request used is kept before the leader's GC prunes it (default "
        f"{DEFAULT_VERDICT_TTL_S:.0f}, at least {2 * TOUCH_INTERVAL_S:.0f}; env KVFLEET_VERDICT_TTL)",
    )


def gc_interval_from(args: argparse.Namespace) -> float:
    """The --gc-interval given, validated (InvalidArgument names the flag)."""
    return GcConfig(float(args.gc_interval)).interval_s


def verdict_ttl_from(args: argparse.Namespace) -> float:
    """The --verdict-ttl given, validated (InvalidArgument names the flag)."""
    return GcConfig(verdict_ttl_s=float(args.verdict_ttl)).verdict_ttl_s


async def _to_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


class StoreGc:
    """Runs `store.gc()` now and then; records every run in `metrics`."""

    def __init__(self, store: Any, metrics: Metrics, cfg: GcConfig | None = None,
                 blocking: Blocking = _to_thread, record_ttl_s: float = RECORD_TTL_S) -> None:
        self.store, self.metrics, self.cfg, self._blocking = store, metrics, cfg or GcConfig(), blocking
        self.record_ttl_s = record_ttl_s
        self._verdicts_cursor = ""  # where the next run's verdict prune goes on
        self._lock = asyncio.Lock()
        self._runs: set[asyncio.Task[int]] = set()  # runs in progress, a caller gone or not
        self._collecting: asyncio.Task[Any] | None = None  # the run holding the lock
        self._schedule = Periodic("kvfleet-store-gc", self.cfg.interval_s, self._scheduled, self._failed)

    async def run_once(self) -> int:
        """One collection; returns the blobs deleted. Raises what the store raised (counted).

        A caller cancelled meanwhile (a CollectGarbage whose client gave up, the schedule stopped) returns at once;
        the run goes on, holding the lock until its store calls end. NOTE: the cancel let go of the lock while the
        store's thread went on collecting, so every retry of a cut-off CollectGarbage started one more collection
        beside it, each holding one of the store threads that every tenant's blob calls share."""
        run = asyncio.ensure_future(self._run())
        self._runs.add(run)
        run.add_done_callback(self._ended)
        try:
            return await asyncio.shield(run)
        except asyncio.CancelledError:
            if run is not self._collecting:  # still waiting for the lock: nothing to finish, no run to queue
                run.cancel()
            raise

    def _ended(self, run: asyncio.Task[int]) -> None:
        self._runs.discard(run)
        if not run.cancelled():
            run.exception()  # counted in _run; retrieved here for a run whose caller is gone

    async def _run(self) -> int:
        async with self._lock:  # the schedule and the RPC never collect at the same time
            self._collecting = asyncio.current_task()
            try:
                return await self._collect()
            finally:
                self._collecting = None

    async def _collect(self) -> int:
        t0 = time.monotonic()
        try:
            n = int(await self._blocking(self.store.gc))
            pruned = await self._blocking(prune_records, self.store, time.time(), self.record_ttl_s)
            idle = await self._blocking(prune_verdicts, self.store, time.time(), self.cfg.verdict_ttl_s,
                                        max(self.cfg.verdict_ttl_s, self.record_ttl_s), self._verdicts_cursor)
            self._verdicts_cursor = idle.cursor
        except Exception:
            self.metrics.store_gc_runs.labels(outcome="error").inc()
            raise
        finally:
            self.metrics.store_gc_duration.observe(time.monotonic() - t0)
        self.metrics.store_gc_runs.labels(outcome="ok").inc()
        self.metrics.store_gc_collected.inc(n)
        self.metrics.store_gc_last_success.set(time.time())
        if pruned:
            log.info("store gc pruned %d quarantine record(s) older than %.0fs", pruned, self.record_ttl_s)
        if idle.num_pruned:
            log.info("store gc pruned %d of %d cached verdict(s) looked at", idle.num_pruned, idle.num_seen)
        return n

    async def _scheduled(self) -> None:
        n = await self.run_once()
        if n:
            log.info("store gc collected %d blob(s)", n)

    def _failed(self, e: Exception) -> None:  # counted in run_once; logged here
        log.warning("store gc failed (retrying in %.0fs): %s", self.cfg.interval_s, e)

    async def start(self) -> None:
        """Start the schedule (no-op when interval_s is 0 or it already runs)."""
        await self._schedule.start()

    async def stop(self, *, drain: bool = False) -> None:
        """Stop the schedule; with `drain`, wait for the runs in progress too (before the store closes)."""
        await self._schedule.stop()
        if drain and self._runs:
            await asyncio.gather(*self._runs, return_exceptions=True)

    @property
    def running(self) -> bool:
        return self._schedule.running
