"""A session's calls, one at a time (workers/session_kernel.py's SessionKernel takes these as a mixin): the write-ahead
op log, op ids, and the guards of a closed or torn session.

Every op carries the caller's op id and its fingerprint (oplog.call_fingerprint); a retried op already in the log
(written just before a crash, then replayed) is answered from the current state, not applied twice, and a different
call under a logged op id is refused (AlreadyExists), not answered as its retry. A closed session refuses every op
that was waiting for its lock, and an op already past it logs nothing (its write refuses: `close` waits 30 s at
most). A call that fails after it handed an op to the log (a recompute that raised mid-evict) may leave the live
state torn while the log holds the op: that state is never served again (every later call raises SessionGone, so the
fleet rebuilds the session from its log, which applies the op) and the call raises SessionTorn (UNAVAILABLE: retry
with the same op_id, answered replayed once rebuilt).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fleet.core.context import SessionContext
from fleet.core.errors import FailedPrecondition, NotFound, Unavailable
from fleet.core.kernel import Session
from fleet.core.oplog import AppendOp, Op, check_op_reuse, history_charge, last_index_of, to_dict
from fleet.core.session_types import OpResult
from workers.placement import add_blob_refs, undo_blob_ref

Runner = Callable[[str, Callable[[], Any]], Awaitable[Any]]  # (tenant, fn) -> fn's result, on a lane thread


class SessionGone(NotFound):
    """The session is not held by this host (it was closed, released, or the host restarted empty)."""


class SessionTorn(Unavailable):
    """A call failed after its op was logged: the session's live state may lack what its log holds. The
    state is not served again; a retry with the same op id is answered from the log once rebuilt."""


# NOTE: Ray pickles an exception a host raises by its module and name; these were defined in
# workers.session_kernel (which still exports them), so they keep that name on the wire: a controller from
# before the move, reattaching to detached hosts of this release, still finds them
SessionGone.__module__ = SessionTorn.__module__ = "workers.session_kernel"


class SessionOps:
    """Running one mutating call of a session (`_mutate`), writing its ops ahead (`_write`), and the guards."""

    tenant: str
    session_id: str
    store: Any
    _lanes: Runner
    ctx: SessionContext | None
    op_fps: dict[str, str]
    op_id: str
    op_fp: str
    last_op_index: int | None
    _lock: asyncio.Lock
    closed: bool
    last_active: float
    num_prefilled_tokens: int
    history_tokens: int
    in_flight: str
    num_log_writes: int
    torn: str

    def _write(self, op: Op) -> None:
        """Write-ahead (the context's sink): log the op, stamped with the call's op id, before it is
        applied and acknowledged; a logged tool result references its blob, so the store's GC never
        collects it while a session holds it.

        The reference is taken first: a blob the leader's GC collected meanwhile (its lease ran
        out after the actor read it) refuses the op with nothing logged, instead of a log entry
        no replay could ever fetch; an op log write that fails gives the reference back, unless the op
        landed all the same (`undo_blob_ref`).

        A closed session refuses the op (SessionGone) with nothing logged and no reference taken.
        NOTE: `close` stops waiting for the op in flight after its timeout and the fleet then deletes
        the log; an op still queued for a lane thread ran after that, wrote a log of its own (nobody's:
        the session was gone) and held its blob's reference forever, and its caller got an ack. Only an
        op whose store write was already under way when close gave up can still land after it."""
        if self.closed:
            raise SessionGone(f"session {self.session_id} was closed on this host: its op was not logged")
        logged = self.ctx is not None and bool(self.ctx.ops)  # its log holds ops: this one's index is not 0
        add_blob_refs(self.store, self.tenant, self.session_id, [op])
        self.num_log_writes += 1  # NOTE: before the write: one that raises may still be durable
        try:
            index = int(self.store.oplog_append(self.tenant, self.session_id, to_dict(op)))
        except BaseException:
            undo_blob_ref(self.store, self.tenant, self.session_id, op)
            raise
        if index == 0 and logged:
            self._log_gone(op)
        self.last_op_index = index
        if op.op_id:
            self.op_fps[op.op_id] = op.op_fp
        if isinstance(op, AppendOp):
            self.history_tokens += history_charge(op.length)

    def _log_gone(self, op: Op) -> None:
        """The op landed first in a log that held the session's ops: the log went (the store lost its data, and the
        session's record with it). Take the op back out, tear the session (never served again: the fleet finds its
        record gone, NotFound) and refuse the call with nothing logged. Costs no read: the append's index tells.

        NOTE: the host kept acknowledging such a session's calls from its live state, each op logged into a new log
        that began mid-session, which no rebuild could ever replay, and no record named."""
        self.num_log_writes -= 1  # taken back: the call logged nothing (SessionGone, not SessionTorn)
        try:
            self.store.oplog_delete(self.tenant, self.session_id)
            undo_blob_ref(self.store, self.tenant, self.session_id, op)
        except Exception:  # noqa: BLE001  # the store failed too: an orphan's sweep deletes the log (workers/orphans.py)
            pass
        self.torn = "its op log is gone (the store lost its data)"
        raise SessionGone(f"session {self.session_id}: {self.torn}; its op was not logged and the session is not "
                          "served again")

    @property
    def context(self) -> SessionContext:
        if self.ctx is None:
            raise FailedPrecondition(f"session {self.session_id} has no state yet")
        return self.ctx

    @property
    def _s(self) -> Session:
        return self.context.session

    async def _run(self, fn: Callable[[], Any]) -> Any:
        return await self._lanes(self.tenant, fn)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionGone(f"session {self.session_id} was closed on this host")
        self._check_served()

    def _check_served(self) -> None:
        """SessionGone for a torn session: the fleet rebuilds it from its op log, then calls again."""
        if self.torn:
            raise SessionGone(f"session {self.session_id}: {self.torn}; its state is rebuilt from its op log")

    @contextlib.asynccontextmanager
    async def _served(self) -> AsyncIterator[None]:
        """A read's hold of the session's lock, on a state that may be served (never a torn one)."""
        async with self._lock:
            self._check_served()
            yield

    def _tear(self, verb: str, op_id: str, e: BaseException) -> SessionTorn:
        """Mark the state torn (never served again) after `verb` failed with `e` past its log write."""
        self.torn = f"{verb} (op_id {op_id!r}) failed after its op was logged ({e!r})"
        return SessionTorn(f"session {self.session_id}: {self.torn}; the session is rebuilt from its op log, "
                           "which applies the op: retry with the same op_id (answered replayed)")

    async def _mutate(self, verb: str, op_id: str, fn: Callable[[], Any], op_fp: str = "",
                      logged: Callable[[], Any] | None = None) -> OpResult:
        """Run one mutating call: idempotent on `op_id` (a different call under a logged one, by its
        fingerprint `op_fp`, is refused), serialised, off the event loop. `logged`: the verb's own answer
        to its retry, read from the log (default: the piece an append added)."""
        async with self._lock:
            self._check_open()
            if op_id and op_id in self.op_fps:
                check_op_reuse(op_id, self.op_fps[op_id], op_fp)  # AlreadyExists: nothing applied
                # NOTE: on the lane: its look-up walks the log (50 ms for 200,000 ops), on the host's event loop
                # every other tenant's call on the host waited for each retry
                replayed: OpResult = await self._run(lambda: self._replayed(op_id, logged))
                return replayed
            self.op_id, self.op_fp, self.in_flight = op_id, op_fp, verb
            if self.ctx is not None:
                self.ctx.op_id, self.ctx.op_fp = op_id, op_fp  # stamped on every op this call writes
            before = self.ctx.session.num_computed if self.ctx is not None else 0  # a create: adopted blocks are free
            writes = self.num_log_writes
            try:
                result = await self._run(fn)
            except Exception as e:
                # NOTE: a create's torn log is not served either way: the host drops the session, the fleet its log
                if self.ctx is not None and verb != "create" and self.num_log_writes != writes:
                    raise self._tear(verb, op_id, e) from e
                raise  # nothing logged: nothing changed (validation refused it before the log)
            finally:
                self.op_id, self.op_fp, self.in_flight = "", "", ""
                if self.ctx is not None:
                    self.ctx.op_id = self.ctx.op_fp = ""
            self.num_prefilled_tokens += self._s.num_computed - before
            self.last_active = time.time()
            # NOTE: None when the call logged nothing (a clean verdict): it answered the previous call's index, and
            # None once the session was rebuilt (last_op_index is not kept), so the same call answered two ways
            return self._reply(result, self.last_op_index if self.num_log_writes != writes else None)

    def _reply(self, result: Any, op_index: int | None, replayed: bool = False) -> OpResult:
        s = self._s
        return OpResult(result, s.last_logits, len(s), op_index, replayed, self.history_tokens)

    def _replayed(self, op_id: str, logged: Callable[[], Any] | None = None) -> OpResult:
        """The answer to a retried op already in the log: `logged()`, or the piece its append added (None
        for other verbs), and its index in the log; nothing is applied again."""
        ops = self.context.ops
        index = last_index_of(ops, op_id)
        op = ops[index] if index is not None else None
        pieces = self.context.pieces
        piece = pieces[op.piece] if isinstance(op, AppendOp) and op.piece < len(pieces) else None
        return self._reply(logged() if logged is not None else piece, index, replayed=True)
