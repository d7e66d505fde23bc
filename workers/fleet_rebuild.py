"""Calls to a session's host, and rebuilds of a session its host lost (KernelFleet's, workers/fleet.py): a call
that finds its session gone rebuilds it from its op log, once, and is retried; `reconcile` rebuilds every lost
session at once. A rebuild writes its record by compare-and-set, and is placed again when its host is full."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fleet.core.errors import NotFound, ResourceExhausted, Unavailable
from workers.call_timeout import session_timeout
from workers.fleet_base import FleetBase
from workers.nodes import CallTimeout, NodeGone
from workers.packed import Packed
from workers.registry import CREATING, IDLE, LOST, SessionRecord, Stored
from workers.session_kernel import SessionGone, SessionKernel

log = logging.getLogger("workers.fleet")  # NOTE: the fleet's logger, named as before this module was split out of it

RECONCILE_THREADS = 8  # sessions `reconcile` rebuilds at once (a host rebuilds them on its lanes)
PLACE_TRIES = 3  # placements of one create, fork or rebuild (its host was full after all, its node died) before giving up
REBUILD_TRIES = 3  # reads of a record another controller changed during a rebuild before giving up


class _Changed(Exception):
    """The record changed under a rebuild (another controller wrote it): read it again."""


def _rebuild_owner(rec: SessionRecord) -> str:
    """The token a rebuild of this session at its epoch opens its kernel with (one per session and loss)."""
    return f"{rec.create_op_id}@{rec.epoch}"


class FleetRebuild(FleetBase):
    """A KernelFleet's calls to its sessions' hosts, and its rebuilds (workers/fleet.py)."""

    def _call(self, tenant: str, session_id: str, method: Callable[..., Any], *args: Any) -> Any:
        """`method` (a SessionKernel method, named by reference so readers and tools can follow it) called
        with `args` on the session's host, and its answer; a session its host lost is regenerated and the
        call retried once."""
        key = (tenant, session_id)
        for attempt in range(2):
            node = self._where.get(key)
            if node is None:
                rec = self._record(tenant, session_id)             # NotFound when unknown or closed
                if not rec.live:                                    # released, or a rebuild that failed: rebuild
                    rec, _ = self._rebuild(tenant, session_id)
                node = self._where[key] = rec.node
            try:
                out = self.nodes.call(node, "call", tenant, session_id, method.__name__, *args)
                return out.unpack() if isinstance(out, Packed) else out   # packed on its tenant's lane there
            except CallTimeout as e:  # NOTE: before, "a worker did not answer within 60s": no session, no advice
                raise session_timeout(session_id, method.__name__, args, e) from e
            except (SessionGone, NodeGone) as e:
                self._where.pop(key, None)
                if attempt:
                    with self._names.hold(key):           # a close in flight finishes first
                        self._record(tenant, session_id)  # NotFound when it was closed meanwhile
                    raise Unavailable(f"session {session_id}: lost again after regeneration") from e
            self._rebuild(tenant, session_id)
        raise Unavailable(f"session {session_id}: unreachable")  # pragma: no cover - loop returns or raises

    def _rebuild(self, tenant: str, session_id: str) -> tuple[SessionRecord, bool]:
        """Rebuild a session its host lost, once: callers (and `reconcile`) that saw the same loss at
        the same time wait for one rebuild instead of each replaying the log and stepping the epoch
        (the name's lock, which a close waits for too). Returns its record, and whether this call rebuilt it."""
        with self._names.hold((tenant, session_id)):
            for _ in range(REBUILD_TRIES):
                stored = self._stored(tenant, session_id)      # NotFound when closed meanwhile
                if stored.rec.live and self._holds(stored.rec):
                    return stored.rec, False                    # another caller rebuilt it meanwhile
                try:
                    return self._regenerate(stored), True
                except _Changed:                                # another controller wrote it: read it again
                    continue
        raise Unavailable(f"session {session_id}: its record kept changing while it was rebuilt; try again")

    def _holds(self, rec: SessionRecord) -> bool:
        """Whether the host of the record's node holds the session now, whole: its info answers. A session
        whose call failed after logging its op (SessionTorn) is held but not served (SessionGone): rebuilt."""
        try:
            self.nodes.call(rec.node, "call", rec.tenant, rec.session, SessionKernel.info.__name__)
        except (SessionGone, Unavailable):  # NodeGone included
            return False
        return True

    def _regenerate(self, stored: Stored) -> SessionRecord:
        """Mark the session lost (kv forgotten), rebuild it from its op log, mark it regenerated.

        The record names the node that rebuilds it before that host is asked, so when the call
        times out (a replay longer than `call_timeout_s`) the next rebuild of the same loss asks the
        same host, which joins the replay it still runs, or answers at once once it is done
        (KernelHost.regenerate), instead of starting the whole replay over: a slow rebuild settles.
        Each write is conditional on the record read or written last: a record a close removed meanwhile
        is never written back (NotFound), one another controller changed is read again (_Changed)."""
        rec, raw = stored
        rec.lose()
        raw = self._replace(rec, raw)
        node = rec.node if self.nodes.answers(rec.node) else self.nodes.place(rec.tenant, [], model_id=rec.model_id)
        raw, node, model_id = self._regenerate_placed(rec, raw, node)
        if rec.rebuilt(node, model_id):
            log.warning("session %s/%s was rebuilt on node %s by a kernel of model_id %s, not its own %s (no survivor "
                        "has it): its KV and logits are close to, not bit-identical with, what was acknowledged",
                        rec.tenant, rec.session, node, model_id, rec.rebuilt_from_model_id)
        if self.registry.replace(rec, raw) is None:
            self._forsake(rec)
        with self._guard:
            self.num_regenerations += 1
        return rec

    def _regenerate_placed(self, rec: SessionRecord, raw: bytes, node: str) -> tuple[bytes, str, str]:
        """`_regenerate_on` `node`, placed again when its host refuses the rebuild as full (its own host filled up
        since it was released, or another create took the last slot since the placement read the offers) or its
        node died just now: the refused node skipped, a kernel of the session's model_id preferred, up to
        PLACE_TRIES nodes. The record's bytes, the node that rebuilt it and its kernel's model_id. NOTE: a host
        did not refuse a rebuild when full: one on the session's own host overfilled it (3 of 2 sessions)."""
        for attempt in range(PLACE_TRIES):
            try:
                raw, model_id = self._regenerate_on(rec, raw, node)
                return raw, node, model_id
            except (NodeGone, ResourceExhausted) as e:
                if attempt == PLACE_TRIES - 1:
                    raise
                node = self._place_elsewhere(rec.tenant, [], node, e, rec.model_id)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _place_elsewhere(self, tenant: str, tokens: list[int], node: str, refused: Exception,
                         model_id: str = "") -> str:
        """Another node than `node`, whose host turned a create, fork or rebuild away (`refused`: ResourceExhausted,
        it is full after all) or whose node died (NodeGone). Where no other node has room, a host's refusal is what
        the caller gets (it names the node, what it has free and the flag to raise), and placement's word on the rest
        its cause. NOTE: placement's word alone said "0 eligible nodes, the most free: 0 bytes" when the one node
        there was full: it had refused a create that raced another for its last KV bytes."""
        try:
            return self.nodes.place(tenant, tokens, exclude=node, model_id=model_id)
        except ResourceExhausted as e:
            if not isinstance(refused, ResourceExhausted):
                raise
            raise ResourceExhausted(f"{refused}; no other node has room for it either") from e

    def _regenerate_on(self, rec: SessionRecord, raw: bytes, node: str) -> tuple[bytes, str]:
        """Ask `node`'s host to rebuild the lost session, the record naming that node first; the record's bytes,
        and the model_id of the kernel that rebuilt it ("" from a host that does not say)."""
        if rec.node != node:
            rec.node = node
            raw = self._replace(rec, raw)  # still lost: the node a later rebuild of this loss asks first
        try:
            out = self.nodes.call(node, "regenerate", rec.tenant, rec.session, rec.epoch, _rebuild_owner(rec),
                                  rec.create_op_id)
        except NodeGone:
            raise                       # placed again (`_regenerate_placed`)
        except Unavailable as e:        # the call timed out (a long log): the host goes on with the rebuild
            raise Unavailable(f"session {rec.session!r} was lost with its kernel host and is being rebuilt from its op "
                              f"log on node {node}, which took longer than this call ({e}); the rebuild goes on: "
                              "retry the call (it joins the rebuild, or finds the session rebuilt)") from e
        return raw, str(out.get("model_id", ""))

    def _replace(self, rec: SessionRecord, raw: bytes) -> bytes:
        """Write `rec` over the record read or written last (`raw`); _Changed when another writer changed it,
        NotFound when it was removed (closed)."""
        new = self.registry.replace(rec, raw)
        if new is None:
            if self.registry.read(rec.tenant, rec.session) is None:
                raise NotFound(f"session {rec.session!r} not found (closed while it was rebuilt)")
            raise _Changed
        return new

    def _forsake(self, rec: SessionRecord) -> None:
        """After a rebuild whose record changed or went meanwhile: close the kernel it made unless the record
        now names that very kernel (another controller's rebuild of the same loss, joined on its host); then
        NotFound (closed) or _Changed (read it again)."""
        now = self.registry.read(rec.tenant, rec.session)
        if now is None or (now.rec.node, now.rec.epoch) != (rec.node, rec.epoch):
            self._close_kernel(rec.node, rec.tenant, rec.session, _rebuild_owner(rec))
        if now is None:
            raise NotFound(f"session {rec.session!r} not found (closed while it was rebuilt)")
        raise _Changed

    def reconcile(self) -> int:
        """Proactively regenerate every session that lost its kernel (instead of on its next call):
        its node left the cluster, its host answered without it (the host died and Ray restarted
        it empty), or a rebuild of it did not finish (`lost`: one that timed out is joined, not
        started over). Idle sessions stay idle. Returns how many were regenerated."""
        alive = set(self.refresh_nodes(force=True))
        ask = self.nodes.ask_all("rows")
        held = {(r["tenant"], r["session"]) for rows in ask.values() if isinstance(rows, list) for r in rows}
        answered = {nid for nid, rows in ask.items() if isinstance(rows, list)}
        lost = [r for r in self.registry.records() if r.state not in (CREATING, IDLE)
                and (r.state == LOST or r.node not in alive
                     or (r.node in answered and (r.tenant, r.session) not in held))]
        for rec in lost:
            self._where.pop((rec.tenant, rec.session), None)
        with ThreadPoolExecutor(RECONCILE_THREADS, thread_name_prefix="reconcile") as pool:  # the hosts' lanes run them
            rebuilt = list(pool.map(lambda r: self._rebuild(r.tenant, r.session)[1], lost))
        return sum(rebuilt)  # a host that was slow to list (held down) but holds its sessions rebuilds nothing
