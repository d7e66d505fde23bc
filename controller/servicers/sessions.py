"""SessionService: agent sessions on the Ray fleet of session kernels (workers.fleet.KernelFleet).

Thin: authenticate, translate proto -> domain, call KernelFleet off the event loop (its calls
block on Ray), translate back. The fleet is built on the first session call (it joins the Ray
cluster `ray.init` already started in this process, or starts a local one). The kernel spec lives
in the store (`controller/kernel_spec`), so a restarted controller regenerates every session
with the same model, bit-identically.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, unary
from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.api.kvfleet.v1 import sessions_pb2_grpc as pbg
from fleet.errors import InvalidArgument, NotFound

T = TypeVar("T")
KERNEL_SPEC_KEY = ("controller", "kernel_spec")
MAX_GENERATE = 256


def kernel_spec_of(store: Any, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fleet's kernel spec from the store; `default` (or the synthetic tiny model) is written
    there the first time, so every later controller on this store runs the same kernel."""
    raw = store.kv_get(*KERNEL_SPEC_KEY)
    if raw is None:
        store.kv_put(*KERNEL_SPEC_KEY, json.dumps(default or {"block_size": 16}).encode())
        raw = store.kv_get(*KERNEL_SPEC_KEY)
    return dict(json.loads(raw))


def piece_to_proto(p: Any) -> pb.Piece:
    return pb.Piece(piece_id=p.piece_id, kind=p.kind, start=p.start, length=p.length, state=p.state,
                    ref=p.ref or "", role=p.role or "", token_ids=list(p.tokens))


def row_to_proto(r: dict[str, Any]) -> pb.SessionRow:
    return pb.SessionRow(
        session_id=r.get("session", ""), tenant=r.get("tenant", ""), node=r.get("node", ""),
        actor=r.get("actor", ""), num_tokens=int(r.get("tokens", 0)), bytes_alone=int(r.get("bytes_alone", 0)),
        bytes_shared=int(r.get("bytes_shared", 0)), hit_rate=float(r.get("hit_rate", 0.0)),
        quarantined_spans=int(r.get("quarantined_spans", 0)), state=str(r.get("state", "")),
        epoch=int(r.get("epoch", 0)), last_active=float(r.get("last_active", 0.0) or 0.0),
        parent=str(r.get("parent", "") or ""), adopted_tokens=int(r.get("adopted_tokens", 0)))


def node_to_proto(s: dict[str, Any]) -> pb.NodeRow:
    return pb.NodeRow(node=s["node"], num_sessions=s["sessions"], cached_tokens=s["cached_tokens"],
                      capacity_tokens=s["capacity_tokens"], queried_tokens=s["queried_tokens"],
                      hit_tokens=s["hit_tokens"], evicted_blocks=s["evicted_blocks"], hit_rate=s["hit_rate"])


def witness_to_proto(w: dict[str, Any]) -> pb.QuarantineWitness:
    known = {"piece_id", "start", "length", "mode", "write_time", "exact", "num_recomputed",
             "max_abs_delta_evict_vs_never", "control_kept_vs_never", "cache_digest_equal"}
    detail = {k: v for k, v in w.items() if k not in known}
    return pb.QuarantineWitness(
        piece_id=w["piece_id"], start=w["start"], length=w["length"], mode=w["mode"],
        write_time=w["write_time"], exact=w["exact"], num_recomputed=w["num_recomputed"],
        max_abs_delta_evict_vs_never=w["max_abs_delta_evict_vs_never"],
        control_kept_vs_never=w["control_kept_vs_never"], cache_digest_equal=w["cache_digest_equal"],
        detail_json=json.dumps(detail, default=str, sort_keys=True))


def _session_id(sid: str) -> str:
    from fleet.cas.base import check_name

    if not sid:
        raise InvalidArgument("session_id is empty: name the session (1-128 characters of [A-Za-z0-9_.:/@-])")
    return check_name("session_id", sid)


class SessionServicer(pbg.SessionServiceServicer):
    """kvfleet.v1.SessionService over one KernelFleet (built on first use)."""

    def __init__(self, ctx: ServiceContext, threads: int = 8) -> None:
        self.ctx = ctx
        self.fleet: Any = None
        self._init = asyncio.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvfleet-sessions")

    async def _fleet(self) -> Any:
        if self.fleet is None:
            async with self._init:
                if self.fleet is None:
                    self.fleet = await self._run(self._build)
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
        fleet = KernelFleet(self.ctx.store_url, kernel_spec_of(self.ctx.store), detached=detached)
        self.ctx.kernel_fleet = fleet  # the fleet metrics poller reads it (controller/fleet_metrics.py)
        self.ctx.on_stop.append(fleet.release if detached else fleet.shutdown)
        return fleet

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    async def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        fleet = await self._fleet()
        return await self._run(getattr(fleet, method), *args, **kw)

    async def _row(self, tenant: str, rec: dict[str, Any]) -> pb.SessionRow:
        info = await self._call("info", tenant, rec["session"])
        return row_to_proto({**rec, **info, "epoch": max(int(rec.get("epoch", 0)), int(info.get("epoch", 0)))})

    @unary(Role.TENANT)
    async def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext,
                            ident: Identity) -> pb.CreateSessionResponse:
        sid = _session_id(request.session_id)
        rec = await self._call("create_session", ident.tenant, sid, request.system_prompt)
        return pb.CreateSessionResponse(session=await self._row(ident.tenant, rec))

    @unary(Role.TENANT)
    async def Append(self, request: pb.AppendRequest, context: grpc.aio.ServicerContext,
                     ident: Identity) -> pb.AppendResponse:
        sid, which = _session_id(request.session_id), request.WhichOneof("content")
        if which == "text":
            r = await self._call("append", ident.tenant, sid, request.text, request.role or "user")
        elif which == "token_ids":
            r = await self._call("append", ident.tenant, sid, [int(t) for t in request.token_ids.ids])
        elif which == "tool_result_ref":
            r = await self._call("add_tool_result", ident.tenant, sid, request.tool_result_ref)
        else:
            raise InvalidArgument("append needs content: text, token_ids or tool_result_ref")
        out = pb.AppendResponse(num_tokens=r.num_tokens, replayed=r.replayed,
                                op_index=-1 if r.op_index is None else r.op_index)
        if r.result is not None:
            out.piece.CopyFrom(piece_to_proto(r.result))
        if request.return_logits and r.logits is not None:
            out.logits_f32 = np.asarray(r.logits, dtype="<f4").tobytes()
        return out

    @unary(Role.TENANT)
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                       ident: Identity) -> pb.GenerateResponse:
        sid = _session_id(request.session_id)
        if not 1 <= request.num_tokens <= MAX_GENERATE:
            raise InvalidArgument(f"num_tokens must be 1..{MAX_GENERATE}, got {request.num_tokens}")
        ids = await self._call("generate", ident.tenant, sid, int(request.num_tokens))
        return pb.GenerateResponse(token_ids=ids)

    @unary(Role.TENANT)
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext,
                    ident: Identity) -> pb.EvictResponse:
        sid, mode = _session_id(request.session_id), request.mode or "exact"
        if mode not in ("exact", "reposition"):
            raise InvalidArgument(f"evict mode must be 'exact' or 'reposition', got {mode!r}")
        r = await self._call("evict", ident.tenant, sid, int(request.piece_id), mode)
        return pb.EvictResponse(mode=r.mode, start=r.start, length=r.length, tail=r.tail, num_evicted=r.num_evicted,
                                num_recomputed=r.num_recomputed, num_rerotated=r.num_rerotated, exact=r.exact)

    @unary(Role.TENANT)
    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext,
                   ident: Identity) -> pb.ForkResponse:
        sid, child = _session_id(request.session_id), _session_id(request.child_id)
        rec = await self._call("fork", ident.tenant, sid, child)
        return pb.ForkResponse(session=await self._row(ident.tenant, rec))

    @unary(Role.TENANT)
    async def AdmitToolResult(self, request: pb.AdmitToolResultRequest, context: grpc.aio.ServicerContext,
                              ident: Identity) -> pb.AdmitToolResultResponse:
        sid = _session_id(request.session_id)
        if not request.ref:
            raise InvalidArgument("admit_tool_result needs the blob's ref (sha256 hex from PutBlob)")
        a = await self._call("admit_tool_result", ident.tenant, sid, request.ref)
        out = pb.AdmitToolResultResponse(verdict=a.verdict, reasons=list(a.reasons), evicted=a.evicted)
        m = self.ctx.metrics
        if a.verdict == "QUARANTINED":
            m.quarantines.inc()
        if a.witness is not None:
            out.witness.CopyFrom(witness_to_proto(a.witness))
            m.witness_max_delta.labels(kind="evict_vs_never").set(float(a.witness["max_abs_delta_evict_vs_never"]))
            m.witness_max_delta.labels(kind="control_kept_vs_never").set(float(a.witness["control_kept_vs_never"]))
        return out

    @unary(Role.TENANT)
    async def WorkingSet(self, request: pb.WorkingSetRequest, context: grpc.aio.ServicerContext,
                         ident: Identity) -> pb.WorkingSetResponse:
        sid = _session_id(request.session_id)
        ws = await self._call("working_set", ident.tenant, sid, int(request.budget_tokens))
        items = [pb.WorkingSetItem(piece=piece_to_proto(i.piece), verdict=i.verdict, reason=i.reason or "")
                 for i in ws.items]
        return pb.WorkingSetResponse(items=items, tokens_reused=ws.tokens_reused,
                                     tokens_to_prefill=ws.tokens_to_prefill)

    @unary(Role.TENANT)
    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext,
                         ident: Identity) -> pb.GetSessionResponse:
        sid = _session_id(request.session_id)
        out = pb.GetSessionResponse(session=await self._row(ident.tenant, {"session": sid}),
                                    digest=await self._call("digest", ident.tenant, sid))
        if request.include_tokens:
            out.token_ids.extend(await self._call("tokens", ident.tenant, sid))
        return out

    @unary(Role.TENANT)
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext,
                           ident: Identity) -> pb.CloseSessionResponse:
        await self._call("close", ident.tenant, _session_id(request.session_id))
        return pb.CloseSessionResponse()

    @unary(Role.TENANT)
    async def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext,
                           ident: Identity) -> pb.ListSessionsResponse:
        operator = ident.role is Role.OPERATOR
        if request.tenant and not operator and request.tenant != ident.tenant:
            raise NotFound(f"no sessions visible for tenant {request.tenant!r}")
        tenant = (request.tenant or None) if operator else ident.tenant
        rows = await self._call("list_sessions", fleet=request.fleet, tenant=tenant)
        rows += await self._run(self._orphans, {(r["tenant"], r["session"]) for r in rows}, tenant, request.fleet)
        out = pb.ListSessionsResponse(sessions=[row_to_proto(r) for r in rows])
        if operator:
            out.nodes.extend(node_to_proto(s) for s in await self._call("node_stats"))
        return out

    def _orphans(self, seen: set[tuple[str, str]], tenant: str | None, fleet: bool) -> list[dict[str, Any]]:
        """Registered sessions whose node is not in this Ray cluster (e.g. after a restart on a
        fresh cluster): listed as lost; their next call regenerates them from the op log."""
        from workers.fleet import REGISTRY

        if not fleet:
            return []
        out = []
        for raw in self.fleet.store.kv_scan(REGISTRY).values():
            rec = json.loads(raw)
            if (rec["tenant"], rec["session"]) in seen or (tenant is not None and rec["tenant"] != tenant):
                continue
            out.append({**rec, "state": "lost", "tokens": 0})
        return sorted(out, key=lambda r: (r["tenant"], r["session"]))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
