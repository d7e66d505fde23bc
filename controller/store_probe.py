"""The store's own health, probed on a schedule: `kvfleet_store_up` (1/0) and the gRPC health service name
"kvfleet.store" (SERVING/NOT_SERVING), on every controller, leader or standby.

    probe = StoreProbe(store, metrics, health_servicer, interval_s=5.0)
    await probe.start()       # one probe now, then one every interval_s (0: off, neither is set)
    await probe.stop()

A probe is one read of the store's marker (`kv_get`: one HGET on Redis, one SELECT on SQLite) on a thread of its
own, so it never waits behind the store threads' queue, and counts as failed when the store raises or has not
answered within timeout_s. At most one read is in flight: while a hung one waits (the Redis client's socket
timeout is 60 s) the next probes wait on it instead of starting another, so a hung store holds one thread.

Data lost: the first probe that finds no marker writes it (kv_swap: absent -> written, with a nonce), and nothing
deletes it. A probe that later finds it gone, or replaced by another controller that found it gone (another nonce),
after one had read it means the store lost its data (a Redis restarted without
persistence, flushed, or swapped for another behind its address): logged as an error naming what went with it,
counted in kvfleet_store_data_lost_total, the marker written again, and `on_lost` awaited on the event loop (the
controller writes back the cache_salt secret it holds, so a controller started later derives the same salts, and the
leader writes back the worker registrations and rank states it holds, so a controller started later watches the same
workers, then watches those another controller wrote back). NOTE: before, a Redis that came
back empty was only "up" again: nothing said that every blob, verdict, quota count and registration was gone.

Unfit: each probe also asks whether the store can keep its data (BlobStore.unfit: one INFO on Redis, whose
maxmemory-policy must not evict keys); while it cannot, "kvfleet.store" and the overall health read NOT_SERVING, as a
store refused when it is opened (fleet/cas/redis.py), and `on_unfit` is awaited at each change.

NOTE: otherwise the overall health ("" and the kvfleet.v1 services, what a readiness probe asks) stays set by
leadership alone. Every controller shares the one store, so a Redis blip would take every controller out of its Service
at once: clients would find no controller (no reason given) instead of one that answers UNAVAILABLE naming the
store, calls that need no store would fail too, and the way back would wait on the readiness probe's period.
Alert on kvfleet_store_up, or probe "kvfleet.store" where a store outage should count (docs/metrics.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from grpc_health.v1 import health_pb2

from controller.metrics import Metrics
from controller.periodic import Periodic

log = logging.getLogger("kvfleet.controller.store")
STORE_HEALTH_SERVICE = "kvfleet.store"
DEFAULT_STORE_PING_INTERVAL_S = 5.0
STORE_PING_TIMEOUT_S = 2.0
_PROBE_KEY = ("controller", "store_marker")  # written once (the first probe), never deleted: gone = data lost
_MARK = b"kvfleet store marker (gone or replaced: the store lost its data): "  # + a nonce per writing
LOST_WHAT = ("every blob and its pins and verdict, the tenants' stored-byte counts, the quarantine verdicts and "
             "records (operators' verdicts too), the session op logs, the worker registrations and the kernel "
             "placement it held")


class _Read(NamedTuple):
    lost: bool  # the store lost its data since this controller's last read
    unfit: str | None  # why the store cannot keep its data (BlobStore.unfit), else None


class StoreProbe:
    def __init__(self, store: Any, metrics: Metrics, health: Any, interval_s: float = DEFAULT_STORE_PING_INTERVAL_S,
                 timeout_s: float = STORE_PING_TIMEOUT_S, on_lost: Callable[[], Awaitable[None]] | None = None,
                 on_unfit: Callable[[], Awaitable[None]] | None = None) -> None:
        self.store, self.metrics, self.health, self.timeout_s = store, metrics, health, timeout_s
        self.on_lost = on_lost  # awaited when the store is found to have lost its data
        self.on_unfit = on_unfit  # awaited when `unfit` changes
        self.up: bool | None = None  # None: not probed yet
        self.unfit: str | None = None  # why the store cannot keep its data, from the last probe that answered
        # the marker this controller last read (or wrote): from then on, its absence or another one is a loss
        # NOTE: one marker, no nonce, was lost to the leader where a standby's probe found it gone first and wrote it
        # again: the leader read it present and never wrote back the registrations it held (found by review)
        self._mark: bytes | None = None
        self._read: asyncio.Future[Any] | None = None
        self._schedule = Periodic("kvfleet-store-probe", interval_s, self.probe, self._failed)

    @property
    def scheduled(self) -> bool:
        """Whether probes run on a schedule (a loss is found only by a controller that has read the marker before)."""
        return self._schedule.interval_s > 0

    async def probe(self) -> bool:
        """Probe once and publish the answer; True: the store answered within timeout_s."""
        if self._read is None or self._read.done():
            self._read = asyncio.ensure_future(asyncio.to_thread(self._check))
            self._read.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "never retrieved"
        # NOTE: asyncio.wait, not wait_for: on Python 3.11 wait_for swallows a cancel that comes as the read ends,
        # and the stopped schedule went on for ever (a controller's stop() hung, 1 run in 6)
        done, _ = await asyncio.wait({self._read}, timeout=self.timeout_s)
        error = self._read.exception() if done else TimeoutError(f"no answer within {self.timeout_s:g} s")
        read: _Read | None = self._read.result() if error is None else None
        if read is not None and read.unfit != self.unfit:
            await self._unfit(read.unfit)
        await self._publish(error is None, str(error))
        if read is not None and read.lost and self.on_lost is not None:  # this read found the data lost
            await self.on_lost()
        return error is None

    def _check(self) -> _Read:
        """The probe's read (a thread); the marker written when absent, and a loss reported where this controller had
        seen another marker (gone, or written anew by another controller that found it gone); then whether the store
        can keep its data (one INFO on Redis: BlobStore.unfit)."""
        mark = self.store.kv_get(*_PROBE_KEY)
        if mark is None:
            new = _MARK + os.urandom(8).hex().encode()
            mark = new if self.store.kv_swap(*_PROBE_KEY, None, new) else self.store.kv_get(*_PROBE_KEY)
        seen, self._mark = self._mark, mark
        unfit = self.store.unfit()
        if seen is None or mark == seen:
            return _Read(False, unfit)
        self._lost()
        return _Read(True, unfit)

    async def _unfit(self, why: str | None) -> None:
        """NOTE: a Redis refused at open (an evicting maxmemory-policy) that replaced the store behind its address, or
        was set so while it ran, was served as if fit: health SERVING while one tenant's puts evicted another's
        blobs. Now the store and the controller's overall health read NOT_SERVING until the policy is fixed."""
        if why is not None:
            log.error("the store cannot keep its data, %s and the controller NOT_SERVING: %s", STORE_HEALTH_SERVICE, why)
        else:
            log.warning("the store can keep its data again: %s and the controller serve again", STORE_HEALTH_SERVICE)
        self.unfit = why
        if self.on_unfit is not None:
            await self.on_unfit()

    def _lost(self) -> None:
        log.error("the store lost its data (its marker key is gone: a Redis restarted without persistence, flushed, "
                  "or another store behind its address): %s are gone; blobs must be put again", LOST_WHAT)
        self.metrics.store_data_lost.inc()

    async def _publish(self, up: bool, why: str) -> None:
        if not up and self.up is not False:
            log.warning("store probe failed, %s NOT_SERVING: %s", STORE_HEALTH_SERVICE, why)
        elif up and self.up is False:
            log.info("the store answers probes again")
        self.up = up
        self.metrics.store_up.set(1 if up else 0)
        serving = up and self.unfit is None
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(STORE_HEALTH_SERVICE, status)

    def _failed(self, e: Exception) -> None:  # probe() catches the store's errors: only a bug lands here
        log.warning("store probe failed: %s", e)

    async def start(self) -> None:
        """Start the schedule; until its first probe answers, "kvfleet.store" reads UNKNOWN. NOTE: it was not set, and
        a health check in that moment got NOT_FOUND, as for a service the controller does not have (seen in a test
        whose store answered through a relay)."""
        if self._schedule.interval_s > 0:
            await self.health.set(STORE_HEALTH_SERVICE, health_pb2.HealthCheckResponse.UNKNOWN)
        await self._schedule.start()

    async def stop(self) -> None:
        await self._schedule.stop()
