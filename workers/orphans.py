"""A host's orphans: kernels no registry record names (workers/host.py's KernelHost takes these as a mixin, the base
of workers/host_slots.py's HostSlots, whose `_insert` replaces an orphan).

An orphan is left by a create or fork whose call timed out and that the host ran after the fleet had cleaned up (its
record, its log), or by a close that never reached the host. The registry decides what is one: a record is saved
before a create or fork asks a host, so a kernel of a session in the making always has one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fleet.core.oplog import made_by, parse_log
from workers.placement import delete_log

if TYPE_CHECKING:
    from fleet.cas import BlobStore
    from workers.registry import SessionRegistry
    from workers.session_kernel import SessionKernel

ORPHAN_SWEEP_S = 10.0  # the most often a full host reads its sessions' records for orphans (`offer`)
ORPHAN_WAIT_S = 0.5  # the most a placement probe waits for a sweep (placement waits 1 s for a node's answer)
log = logging.getLogger("kvfleet.workers")


class Orphans:
    """Finding, replacing and sweeping a host's orphans."""

    registry: SessionRegistry
    store: BlobStore
    sessions: dict[tuple[str, str], SessionKernel]
    _swept_at: float
    _sweep: asyncio.Task[None] | None

    async def close(self, tenant: str, session_id: str, owner: str | None = None,
                    create_op_id: str | None = None) -> None:
        raise NotImplementedError

    async def _orphaned(self, held: SessionKernel, owner: str) -> bool:
        """Whether `held` is an orphan a create or fork of op id `owner` replaces: the session's record (read off the
        event loop) names `owner`, not `held`'s session. Such a kernel was opened by a try whose caller gave up on it
        (its call timed out) and had removed its record already, so no record can name it again; it would otherwise
        hold the name on this host until the host restarts. A try with no op id replaces nothing."""
        if not owner:
            return False
        rec = await asyncio.to_thread(self.registry.get, held.tenant, held.session_id)
        return rec is not None and rec.create_op_id == owner and held.create_op_id != owner

    async def _sweep_for_room(self) -> None:
        """A full host asked for room: start a sweep for orphans (`_sweep_orphans`) if none ran within ORPHAN_SWEEP_S,
        and wait for the one running at most ORPHAN_WAIT_S; past that it goes on in the background, and the host
        answers as it stands (a later probe sees the room it made). NOTE: the probe waited for the whole sweep, one
        record read per held session, seconds for a full host on Redis, past placement's 1 s wait for an answer."""
        now = asyncio.get_running_loop().time()
        task = self._sweep
        if (task is None or task.done()) and now - self._swept_at >= ORPHAN_SWEEP_S:
            self._swept_at = now
            task = self._sweep = asyncio.create_task(self._sweep_orphans())
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=ORPHAN_WAIT_S)

    async def _sweep_orphans(self) -> None:
        """Close every held kernel whose session has no record at all: a try its caller gave up on, and whose name no
        later try took, or a close that never reached the host. A record is saved before a create or fork asks a
        host, so a kernel of a session in the making always has one. Each orphan's slot is free as its close begins
        (an op in flight on it finishes first). NOTE: before, such an orphan held its slot until the host restarted
        (placement skips a full host)."""
        try:
            held = list(self.sessions.values())
            records = await asyncio.to_thread(lambda: [self.registry.get(s.tenant, s.session_id) for s in held])
            orphans = [s for s, rec in zip(held, records, strict=True)
                       if rec is None and self.sessions.get((s.tenant, s.session_id)) is s]
            await asyncio.gather(*(self._replace_orphan(s) for s in orphans))
        except Exception:  # a sweep never takes the host down; the next probe past ORPHAN_SWEEP_S tries again
            log.exception("kernel host: sweeping for orphans failed")

    async def _replace_orphan(self, held: SessionKernel) -> None:
        """Close the orphan `held` (its op in flight finishes first, or writes nothing), then delete its op log
        if it made that log (its create or fork wrote it after the fleet's cleanup had looked)."""
        await self.close(held.tenant, held.session_id, held.owner)

        def drop_log() -> None:
            log = parse_log(self.store.oplog_read(held.tenant, held.session_id))
            if made_by(log, held.create_op_id):
                delete_log(self.store, held.tenant, held.session_id, log)

        await asyncio.to_thread(drop_log)
