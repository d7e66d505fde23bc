"""SessionService: agent sessions on the Ray fleet of session kernels (workers.fleet.KernelFleet).

Thin: authenticate, validate, check the tenant's quotas, translate proto -> domain, call
KernelFleet off the event loop on the tenant's own lane of threads (its calls block on Ray; a
stuck actor parks only its own tenant's lane), translate back. The fleet is built on the first
session call (it joins the Ray cluster `ray.init` already started in this process, or starts a
local one), and with it the idle reaper. The kernel spec lives in the store
(`controller/kernel_spec`), so a restarted controller regenerates every session with the same
model, bit-identically. Limits and their flags: controller/quotas.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from controller.auth import Identity, Role
from controller.kernel_placement import kernel_spec_of
from controller.quotas import SessionLimits, TenantLanes, TenantLedger
from controller.servicers.common import ServiceContext, unary
from controller.servicers.session_convert import (
    admission_to_proto,
    evict_to_proto,
    node_to_proto,
    piece_to_proto,
    row_to_proto,
)
from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.api.kvfleet.v1 import sessions_pb2_grpc as pbg
from fleet.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from fleet.kernel.tokenizer import encode_message
from fleet.oplog import num_tokens, own_op_ids, parse_log
from fleet.quarantine.detector import Verdict
from fleet.session_types import (
    SessionRow,
    ToolAdmission,
    check_op_id,
    check_session_id,
    check_token_ids,
)
from fleet.verdict import QUARANTINED

log = logging.getLogger("kvfleet.controller")
T = TypeVar("T")
MAX_GENERATE = 256


class SessionServicer(pbg.SessionServiceServicer):
    """kvfleet.v1.SessionService over one KernelFleet (built on first use).

    Invariants: a call reserves its tenant's quota (and a create its session's name) before it
    runs and releases it when it ends, so nothing that passes a quota is ever logged or spawned;
    every fleet call of a tenant runs on that tenant's lane (`TenantLanes`).
    """

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.fleet: Any = None
        self._init = asyncio.Lock()
        self._seed_lock = asyncio.Lock()
        self._admin = ThreadPoolExecutor(2, thread_name_prefix="kvfleet-sessions-admin")  # build, seed, reap
        self._lanes = TenantLanes(1)  # its width is set from the limits when the fleet is built
        self._ledger: TenantLedger | None = None
        self._creating: set[tuple[str, str]] = set()
        self._in_flight: dict[tuple[str, str], int] = {}
        self._touched: dict[tuple[str, str], float] = {}
        self._reaping: dict[tuple[str, str], asyncio.Event] = {}  # sessions whose actor is being released
        self._reaper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def limits(self) -> SessionLimits:
        return getattr(self.ctx, "session_limits", None) or SessionLimits()

    # -- the fleet, its lanes and the ledger ------------------------------------------------------

    async def _fleet(self) -> Any:
        if self.fleet is None:
            async with self._init:
                if self.fleet is None:
                    fleet = await self._run_admin(self._build)
                    self._ledger = TenantLedger(fleet.kernel.block_bytes // fleet.kernel.block_size)
                    self._lanes.width = self.limits.tenant_concurrency
                    self._loop = asyncio.get_running_loop()
                    self._reaper = asyncio.create_task(self._reap_loop())
                    self.fleet = fleet
        return self.fleet

    def _build(self) -> Any:
        import ray

        from workers.fleet import KernelFleet
        from workers.placement import NAMESPACE

        if self.ctx.ray_address and not ray.is_initialized():
            ray.init(address=self.ctx.ray_address, namespace=NAMESPACE, log_to_driver=False)
        # On a cluster (--ray-address) the fleet is detached: a restarted or newly elected controller
        # reattaches to its supervisors and sessions (no re-prefill); a local Ray dies with us anyway.
        detached = bool(self.ctx.ray_address)
        fleet = KernelFleet(self.ctx.store_url, kernel_spec_of(self.ctx.store), detached=detached,
                            node_kv_bytes=self.ctx.node_kv_bytes)
        self.ctx.kernel_fleet = fleet  # the fleet metrics poller reads it (controller/fleet_metrics.py)
        self.ctx.on_stop.append(self.close)         # the reaper first, then the fleet
        self.ctx.on_stop.append(fleet.release if detached else fleet.shutdown)
        return fleet

    async def _run_admin(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._admin, functools.partial(fn, *args, **kw))

    async def _run(self, tenant: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run a blocking call on `tenant`'s lane (never on a thread another tenant needs)."""
        pool = self._lanes.acquire(tenant)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kw))
        finally:
            self._lanes.release(tenant)

    async def _call(self, method: str, tenant: str, *args: Any, **kw: Any) -> Any:
        """A KernelFleet call for `tenant` (args[0], when given, is the session: marked in flight
        and touched, so the reaper leaves it alone). A call for a session whose actor the reaper
        is releasing waits for the release to end, then runs on the regenerated actor (never on
        an actor being stopped under it)."""
        fleet = await self._fleet()
        key = (tenant, str(args[0])) if args else None
        if key is not None:
            while (releasing := self._reaping.get(key)) is not None:
                await releasing.wait()
            self._in_flight[key] = self._in_flight.get(key, 0) + 1  # NOTE: no await since the check above
        exists = True
        try:
            return await self._run(tenant, getattr(fleet, method), tenant, *args, **kw)
        except NotFound:
            exists = False  # no such session: nothing to remember about it (ids a tenant made up)
            raise
        finally:
            if key is not None:
                self._in_flight[key] -= 1
                if not self._in_flight[key]:
                    del self._in_flight[key]
                if exists:
                    self._touched[key] = time.time()
                else:
                    self._touched.pop(key, None)

    async def _quota(self, tenant: str) -> TenantLedger:
        """The ledger, with `tenant`'s sessions counted (rebuilt from the store the first time)."""
        await self._fleet()
        ledger = self._ledger
        assert ledger is not None
        if not ledger.seeded(tenant):
            async with self._seed_lock:
                if not ledger.seeded(tenant):
                    ledger.seed(tenant, await self._run_admin(self._held_tokens, tenant))
        return ledger

    def _held_tokens(self, tenant: str) -> dict[str, int]:
        """Tokens per registered session of `tenant`, from the op logs (a restart loses nothing)."""
        from workers.registry import CREATING

        store = self.fleet.store
        return {r["session"]: num_tokens(parse_log(store.oplog_read(tenant, r["session"])))
                for r in self.fleet.registry.records(tenant) if r.get("state") != CREATING}

    async def _mutate(self, tenant: str, sid: str, num_tokens: int, method: str, *args: Any, **kw: Any) -> Any:
        """A call that may grow session `sid` by up to `num_tokens` tokens, within the KV quota.
        A retry of an op already in the session's log (its `op_id`) is answered even at the quota:
        it grows nothing."""
        ledger = await self._quota(tenant)
        try:
            held = ledger.reserve(self.limits, tenant, num_tokens)
        except ResourceExhausted:
            op_id = str(kw.get("op_id") or "")
            if not op_id or not await self._run(tenant, self._logged, tenant, sid, op_id):
                raise
            held = 0  # the actor answers it from its log (replayed), applying nothing
        try:
            r = await self._call(method, tenant, sid, *args, **kw)
        finally:
            ledger.release(tenant, held)
        if getattr(r, "num_tokens", None) is not None:
            ledger.update(tenant, sid, r.num_tokens)  # the session's count after the call, replayed or not
        return r

    def _logged(self, tenant: str, sid: str, op_id: str) -> bool:
        """Whether op `op_id` is one of the session's own ops in its log (written before an op is
        applied); a fork's log starts with its parent's ops, whose ids are not the child's."""
        return op_id in own_op_ids(parse_log(self.fleet.store.oplog_read(tenant, sid)))

    async def _new_session(self, tenant: str, sid: str, num_tokens: int, method: str, *args: Any) -> Any:
        """A create or fork of session `sid`: one session and `num_tokens` tokens within quota,
        and its name held (a concurrent create of the same name is refused, never interleaved)."""
        key = (tenant, sid)
        if key in self._creating:
            raise AlreadyExists(f"session {sid!r} is being created by another call")
        self._creating.add(key)  # NOTE: before any await, so two creates of one name never interleave
        try:
            ledger = await self._quota(tenant)
            existed = sid in ledger.tokens.get(tenant, {})
            # a name already counted reserves nothing: the fleet answers ALREADY_EXISTS, not the quota
            held = ledger.reserve(self.limits, tenant, 0 if existed else num_tokens, new_session=None if existed else sid)
            try:
                rec = await self._call(method, tenant, *args)
            except BaseException:
                if not existed:
                    ledger.drop(tenant, sid)
                raise
            finally:
                ledger.release(tenant, held)
        finally:
            self._creating.discard(key)
        ledger.add(tenant, sid, num_tokens)
        return rec

    async def _row(self, tenant: str, rec: dict[str, Any]) -> pb.SessionRow:
        """The session's row: its registry record `rec` and its actor's info (whose epoch is the
        registry's: one counter, kept by KernelFleet)."""
        row = SessionRow.from_row({**rec, **await self._call("info", tenant, rec["session"])})
        self._set_tokens(tenant, row.session_id, row.num_tokens)
        return row_to_proto(row)

    # -- RPCs -------------------------------------------------------------------------------------

    @unary(Role.TENANT)
    async def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext,
                            ident: Identity) -> pb.CreateSessionResponse:
        sid = check_session_id("session_id", request.session_id)
        if not request.system_prompt:
            raise InvalidArgument("the system prompt must be a non-empty str")
        fleet = await self._fleet()  # the prompt is encoded once, here: counted, placed and appended
        tokens = await self._run(ident.tenant, encode_message, fleet.tokenizer, "system", request.system_prompt)
        rec = await self._new_session(ident.tenant, sid, len(tokens), "create_session", sid, request.system_prompt,
                                      tokens)
        return pb.CreateSessionResponse(session=await self._row(ident.tenant, rec))

    @unary(Role.TENANT)
    async def Append(self, request: pb.AppendRequest, context: grpc.aio.ServicerContext,
                     ident: Identity) -> pb.AppendResponse:
        sid, which = check_session_id("session_id", request.session_id), request.WhichOneof("content")
        op_id, fleet, t = check_op_id(request.op_id), await self._fleet(), ident.tenant
        if which == "text":
            role = request.role or "user"
            n = len(await self._run(t, encode_message, fleet.tokenizer, role, request.text))
            r = await self._mutate(t, sid, n, "op", "append", request.text, role, op_id=op_id)
        elif which == "token_ids":
            ids = check_token_ids(request.token_ids.ids, fleet.kernel.config.vocab_size)  # the edge: checked once
            r = await self._mutate(t, sid, len(ids), "op", "append", ids, "user", op_id=op_id)
        elif which == "tool_result_ref":
            n = await self._run(t, self._blob_tokens, t, request.tool_result_ref)
            r = await self._mutate(t, sid, n, "op", "add_tool_result", request.tool_result_ref, op_id=op_id)
        else:
            raise InvalidArgument("append needs content: text, token_ids or tool_result_ref")
        out = pb.AppendResponse(num_tokens=r.num_tokens, replayed=r.replayed,
                                op_index=-1 if r.op_index is None else r.op_index)
        if r.result is not None:
            out.piece.CopyFrom(piece_to_proto(r.result))
        if request.return_logits and r.logits is not None:
            out.logits_f32 = np.asarray(r.logits, dtype="<f4").tobytes()
        return out

    def _blob_tokens(self, tenant: str, ref: str) -> int:
        """An upper bound of a stored tool result's tokens (its size: a token is >= 1 byte); 0 when
        the blob is missing or malformed (the append itself then says why)."""
        try:
            return int(self.fleet.store.stat(ref, tenant).size)
        except Exception:  # noqa: BLE001 - the append reports the real error
            return 0

    @unary(Role.TENANT)
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       ident: Identity) -> pb.GenerateResponse:
        sid, op_id = check_session_id("session_id", request.session_id), check_op_id(request.op_id)
        if not 1 <= request.num_tokens <= MAX_GENERATE:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_GENERATE}, got {request.num_tokens}")
        n = int(request.num_tokens)
        # KernelFleet.op, not .generate: its OpResult carries the session's token count, so the
        # ledger is set exactly (a replayed Generate adds nothing; see _mutate)
        r = await self._mutate(ident.tenant, sid, n, "op", "generate", n, op_id=op_id)
        return pb.GenerateResponse(token_ids=list(r.result.tokens))

    @unary(Role.TENANT)
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext,
                    ident: Identity) -> pb.EvictResponse:
        sid, mode = check_session_id("session_id", request.session_id), request.mode or "exact"
        if mode not in ("exact", "reposition"):
            raise InvalidArgument(f"evict mode must be 'exact' or 'reposition', got {mode!r}")
        a = await self._call("op", ident.tenant, sid, "evict", int(request.piece_id), mode)
        self._set_tokens(ident.tenant, sid, a.num_tokens)   # exact, like an append's
        return evict_to_proto(a.result)

    def _set_tokens(self, tenant: str, sid: str, num_tokens: int) -> None:
        """The session now holds `num_tokens` tokens (a call's answer)."""
        ledger = self._ledger
        if ledger is not None and ledger.seeded(tenant):
            ledger.update(tenant, sid, num_tokens)

    @unary(Role.TENANT)
    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext,
                   ident: Identity) -> pb.ForkResponse:
        sid, child = check_session_id("session_id", request.session_id), check_session_id("child_id", request.child_id)
        n = (await self._quota(ident.tenant)).num_tokens(ident.tenant, sid)
        rec = await self._new_session(ident.tenant, child, n, "fork", sid, child)
        return pb.ForkResponse(session=await self._row(ident.tenant, rec))

    @unary(Role.TENANT)
    async def AdmitToolResult(self, request: pb.AdmitToolResultRequest, context: grpc.aio.ServicerContext,
                              ident: Identity) -> pb.AdmitToolResultResponse:
        sid = check_session_id("session_id", request.session_id)
        if not request.ref:
            raise InvalidArgument("admit_tool_result needs the blob's ref (sha256 hex from PutBlob)")
        # the controller's Judge decides (its layers, the store-wide verdict cache, an operator's verdict);
        # the session actor only acts on it, so no session process loads a detector
        await self._call("check_session", ident.tenant, sid)  # an unknown session costs no inspection
        j = await self.ctx.admission(request.ref, ident.tenant)  # in the tenant's judge lane
        res = await self._call("op", ident.tenant, sid, "admit_tool_result", request.ref,
                               Verdict(j.quarantined, list(j.reasons)))
        self._set_tokens(ident.tenant, sid, res.num_tokens)   # a quarantine evicts: exact, like an append's
        a: ToolAdmission = res.result
        m = self.ctx.metrics
        if a.verdict == QUARANTINED:
            m.quarantines.inc()
        if a.proof is not None:
            m.witness_max_delta.labels(kind="evict_vs_never").set(a.proof.max_abs_delta_evict_vs_never)
            m.witness_max_delta.labels(kind="control_kept_vs_never").set(a.proof.control_kept_vs_never)
        return admission_to_proto(a)

    @unary(Role.TENANT)
    async def WorkingSet(self, request: pb.WorkingSetRequest, context: grpc.aio.ServicerContext,
                         ident: Identity) -> pb.WorkingSetResponse:
        sid = check_session_id("session_id", request.session_id)
        ws = await self._call("working_set", ident.tenant, sid, int(request.budget_tokens))
        items = [pb.WorkingSetItem(piece=piece_to_proto(i.piece), verdict=i.verdict, reason=i.reason or "")
                 for i in ws.items]
        return pb.WorkingSetResponse(items=items, tokens_reused=ws.tokens_reused,
                                     tokens_to_prefill=ws.tokens_to_prefill)

    @unary(Role.TENANT)
    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext,
                         ident: Identity) -> pb.GetSessionResponse:
        sid = check_session_id("session_id", request.session_id)
        out = pb.GetSessionResponse(session=await self._row(ident.tenant, {"session": sid}),
                                    digest=await self._call("digest", ident.tenant, sid))
        if request.include_tokens:
            out.token_ids.extend(await self._call("tokens", ident.tenant, sid))
        return out

    @unary(Role.TENANT)
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext,
                           ident: Identity) -> pb.CloseSessionResponse:
        sid = check_session_id("session_id", request.session_id)
        try:
            await self._call("close", ident.tenant, sid)
        except NotFound:  # not there: it holds nothing either
            self._forget(ident.tenant, sid)
            raise
        self._forget(ident.tenant, sid)
        return pb.CloseSessionResponse()

    def _forget(self, tenant: str, sid: str) -> None:
        if self._ledger is not None and (tenant, sid) not in self._creating:  # a create's reservation stays
            self._ledger.drop(tenant, sid)
        self._touched.pop((tenant, sid), None)

    @unary(Role.TENANT)
    async def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext,
                           ident: Identity) -> pb.ListSessionsResponse:
        operator = ident.role is Role.OPERATOR
        if request.tenant and not operator and request.tenant != ident.tenant:
            raise NotFound(f"no sessions visible for tenant {request.tenant!r}")
        tenant = (request.tenant or None) if operator else ident.tenant
        fleet = await self._fleet()
        rows = await self._run(ident.tenant, fleet.list_sessions, request.fleet, tenant)
        out = pb.ListSessionsResponse(sessions=[row_to_proto(SessionRow.from_row(r)) for r in rows])
        if operator:
            out.nodes.extend(node_to_proto(s) for s in await self._run(ident.tenant, fleet.node_stats))
        return out

    # -- idle reaping -----------------------------------------------------------------------------

    async def _reap_loop(self) -> None:
        """Every reap interval, release the actors of sessions idle past the TTL (0: never)."""
        while True:
            limits = self.limits
            await asyncio.sleep(limits.reap_interval_s)
            self._lanes.prune()  # the lanes of tenants with no call running or waiting
            if not limits.idle_ttl_s:
                continue
            try:
                await self.reap_idle(limits.idle_ttl_s)
            except Exception:  # noqa: BLE001 - one failed pass (a node going away) never stops reaping
                log.exception("idle-session reaping failed; retrying next interval")

    async def reap_idle(self, ttl_s: float, now: float | None = None,
                        rows: list[dict[str, Any]] | None = None) -> list[tuple[str, str]]:
        """Release the actor of every live session that no call touched for `ttl_s` seconds (none
        in flight); their records and op logs stay, so each regenerates on its next call.
        `rows`: the fleet's session rows (default: listed now). Returns the (tenant, session)
        pairs released.

        Invariant: a session is released only with no call of it in flight, and a call arriving
        during its release waits for it (`_call`), so no actor is stopped under a call."""
        now = time.time() if now is None else now
        if rows is None:
            rows = await self._run_admin(self.fleet.list_sessions, True)
        out = []
        for r in rows:
            key = (r["tenant"], r["session"])
            if r.get("state") not in ("active", "regenerated") or key in self._in_flight or key in self._creating \
                    or key in self._reaping:
                continue
            last = max(float(r.get("last_active") or 0.0), float(r.get("created") or 0.0), self._touched.get(key, 0.0))
            if now - last <= ttl_s:
                continue
            released = self._reaping[key] = asyncio.Event()  # NOTE: no await since the checks above
            try:
                with contextlib.suppress(NotFound):   # closed meanwhile
                    await self._run_admin(self.fleet.release_session, *key)
                    out.append(key)
            finally:
                del self._reaping[key]
                released.set()
        if out:
            log.info("released %d idle session actor(s) (idle > %.0fs): %s", len(out), ttl_s, out)
        return out

    def close(self) -> None:
        """Stop the reaper and the lanes (run by Controller.stop, from any thread)."""
        if self._reaper is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self._reaper.cancel)
        self._lanes.shutdown()
        self._admin.shutdown(wait=False, cancel_futures=True)
