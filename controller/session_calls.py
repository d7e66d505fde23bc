"""How a session call runs (controller/sessions.py's Sessions takes these as a mixin): on its tenant's lane, with its
session in use, and within the tenant's KV quota.

`_run` runs a blocking call on the tenant's lane (controller/quotas.py TenantLanes: never on a thread another tenant
needs); `_call` runs a KernelFleet call there with its session marked in flight (controller/session_reaper.py
SessionActivity: the reaper leaves it alone, and a release in progress ends first). `_mutate` (a call that may grow a
session) and `_new_session` (a create or a fork) reserve the call's tokens in the ledger (controller/session_quota.py)
before it runs and settle them when it ends (`_settled`), not when its caller stops waiting; a retry of an op already
in the session's log is answered even at the quota (`_logged`).

These share the Sessions' parts: its context (the limits), its fleet, its lanes, its ledger, its calls in flight and
the names being created. Single event loop; the calls themselves run on the lanes' threads.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, TypeVar

from controller.quotas import SessionLimits, TenantLanes
from controller.session_quota import SessionQuota
from controller.session_reaper import SessionActivity
from fleet.core.errors import AlreadyExists, ResourceExhausted, Unavailable
from fleet.core.oplog import call_fingerprint, check_op_reuse, history_charge, own_op_fps, parse_log
from fleet.core.session_types import OpResult

T = TypeVar("T")


class SessionCalls:
    """A session call on its tenant's lane, its session in use, its tokens reserved and settled in the quota."""

    ctx: Any
    fleet: Any
    quota: SessionQuota
    _lanes: TenantLanes
    _activity: SessionActivity
    _creating: set[tuple[str, str]]

    @property
    def limits(self) -> SessionLimits:
        return getattr(self.ctx, "session_limits", None) or SessionLimits()

    async def _run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call on `tenant`'s lane (never on a thread another tenant needs)."""
        pool = self._lanes.acquire(tenant)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))
        finally:
            self._lanes.release(tenant)

    async def _call(self, tenant: str, sid: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a KernelFleet call) on `tenant`'s lane, with session `sid` in use (`SessionActivity.calling`:
        the reaper leaves it alone, and a release in progress ends first)."""
        async with self._activity.calling((tenant, sid)):  # NOTE: callers hold the fleet already (get_fleet)
            return await self._run(tenant, fn, *args)

    async def _mutate(self, tenant: str, sid: str, grow: int, op_id: str, fn: Callable[..., OpResult],
                      *args: Any) -> OpResult:
        """`fn(tenant, sid, *args)`, a KernelFleet call that may grow session `sid` by up to `grow` tokens, within the KV quota. A retry of
        an op already in the session's log (its `op_id`) is answered even at the quota: it grows nothing."""
        ledger = await self.quota.counted(tenant)
        try:
            held = ledger.reserve(self.limits, tenant, grow)
        except ResourceExhausted:
            op_fp = call_fingerprint(fn.__name__, *args[:-1])  # the call's fingerprint: its args, op_id (last) left out
            if not op_id or not await self._run(tenant, self._logged, tenant, sid, op_id, op_fp):
                raise
            held = (0, 0)  # the actor answers it from its log (replayed), applying nothing

        def settle(t: asyncio.Future[OpResult]) -> None:
            ledger.release(tenant, held)
            e = None if t.cancelled() else t.exception()
            if not t.cancelled() and e is None:
                r = t.result()
                ledger.update(tenant, sid, r.num_tokens, r.history_tokens)  # what it holds and logged, as its host says
            elif t.cancelled() or isinstance(e, Unavailable):
                # NOTE: its host may still log it (a call timeout): charged until the session's next answer; before,
                # such an append was never charged, and its retry came back replayed
                ledger.charge(tenant, sid, held)

        return await self._settled(asyncio.ensure_future(self._call(tenant, sid, fn, tenant, sid, *args)), settle)

    @staticmethod
    async def _settled(task: asyncio.Future[T], settle: Callable[[asyncio.Future[T]], None]) -> T:
        """Await `task` (a KernelFleet call) and settle its quota reservation (`settle(task)`) when it ENDS, not when
        its caller stops waiting: a cancelled caller (its deadline, its client gone) leaves the call running in its
        lane's thread. NOTE: settled at the cancel, a create cut short by its deadline was dropped from the ledger
        while its thread went on to create the session (4 sessions against a quota of 2), and an append's tokens
        were released while its host applied them (3,032 tokens held against a quota of 1,700)."""
        task.add_done_callback(settle)
        return await asyncio.shield(task)

    def _logged(self, tenant: str, sid: str, op_id: str, op_fp: str) -> bool:
        """Whether op `op_id` is one of the session's own ops in its log (written before an op is applied).

        Raises:
            AlreadyExists: it is, but logged by a different call (its fingerprint is not `op_fp`), as the host
                refuses it (`check_op_reuse`): not a retry, so not answered at the quota either."""
        fps = own_op_fps(parse_log(self.fleet.store.oplog_read(tenant, sid)))
        if op_id not in fps:
            return False
        check_op_reuse(op_id, fps[op_id], op_fp)
        return True

    async def _new_session(self, tenant: str, sid: str, grow: int, touched: str,
                           fn: Callable[..., dict[str, Any]], *args: Any, history: int | None = None) -> dict[str, Any]:
        """`fn(*args)`, a create or fork of session `sid`: one session, `grow` tokens and `history` (default:
        one append of `grow`) within quota, and its name held (a concurrent create of the same name is
        refused, never interleaved). `touched`: the session the call touches (the new one; a fork's parent)."""
        history = history_charge(grow) if history is None else history
        key = (tenant, sid)
        if key in self._creating:
            raise AlreadyExists(f"session {sid!r} is being created by another call")
        self._creating.add(key)  # NOTE: before any await, so two creates of one name never interleave
        try:
            ledger = await self.quota.counted(tenant)
            existed = sid in ledger.tokens.get(tenant, {})
            # a name already counted reserves nothing: the fleet answers ALREADY_EXISTS, not the quota
            held = ledger.reserve(self.limits, tenant, 0 if existed else grow, new_session=None if existed else sid,
                                  history=0 if existed else history)
        except BaseException:
            self._creating.discard(key)
            raise

        def settle(t: asyncio.Future[dict[str, Any]]) -> None:  # when the create ends: the name is free again
            ledger.release(tenant, held)
            self._creating.discard(key)
            if not t.cancelled() and t.exception() is None:
                ledger.add(tenant, sid, grow, history)
            elif not existed:
                ledger.drop(tenant, sid)  # KernelFleet leaves nothing of a create that failed

        return await self._settled(asyncio.ensure_future(self._call(tenant, touched, fn, *args)), settle)

    def _forget(self, tenant: str, sid: str) -> None:
        if (tenant, sid) not in self._creating:  # a create's reservation stays
            self.quota.forget(tenant, sid)
        self._activity.touched.pop((tenant, sid), None)
