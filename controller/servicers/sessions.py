"""SessionService: agent sessions, translated between kvfleet.v1 and the session service (controller/sessions.py).

Thin: authenticate, validate, translate proto -> domain, call `Sessions` (which owns the fleet, the tenants'
quotas and lanes, and the idle reaper), translate back. Text is encoded once, by `Sessions.append_text`: the
same tokens are counted against the quota and appended (the kernel host never encodes text).
Limits and their flags: controller/quotas.py.
"""

from __future__ import annotations

import grpc
import numpy as np

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, unary
from controller.servicers.session_convert import (
    admission_to_proto,
    evict_to_proto,
    node_to_proto,
    piece_to_proto,
    row_to_proto,
)
from controller.sessions import Sessions
from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.api.kvfleet.v1 import sessions_pb2_grpc as pbg
from fleet.cas.types import check_tenant
from fleet.core.errors import InvalidArgument, NotFound
from fleet.core.quarantine.detector import Verdict
from fleet.core.roles import check_role
from fleet.core.session_types import ToolAdmission, check_op_id, check_session_id
from fleet.core.verdict import QUARANTINED


class SessionServicer(pbg.SessionServiceServicer):
    """kvfleet.v1.SessionService over one `Sessions` (its fleet is built on first use)."""

    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.sessions = Sessions(ctx)

    async def _judge(self, ref: str, tenant: str) -> Verdict:
        j = await self.ctx.admission(ref, tenant)  # in the tenant's judge lane
        return Verdict(j.quarantined, list(j.reasons))

    @unary(Role.TENANT)
    async def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext,
                            ident: Identity) -> pb.CreateSessionResponse:
        sid = check_session_id("session_id", request.session_id)
        row = await self.sessions.create(ident.tenant, sid, request.system_prompt)
        return pb.CreateSessionResponse(session=row_to_proto(row))

    @unary(Role.TENANT)
    async def Append(self, request: pb.AppendRequest, context: grpc.aio.ServicerContext,
                     ident: Identity) -> pb.AppendResponse:
        sid, which = check_session_id("session_id", request.session_id), request.WhichOneof("content")
        op_id, t, s = check_op_id(request.op_id), ident.tenant, self.sessions
        if which == "text":
            role = check_role(request.role or "user")  # NOTE: before, any text, logged with the message ("bogus")
            r = await s.append_text(t, sid, role, request.text, op_id)
        elif which == "token_ids":
            r = await s.append_output(t, sid, request.token_ids.ids, op_id)  # NOTE: not list(): refused if too long
        elif which == "tool_result_ref":
            r = await s.add_tool_result(t, sid, request.tool_result_ref, op_id)
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
        sid, op_id = check_session_id("session_id", request.session_id), check_op_id(request.op_id)
        r = await self.sessions.generate(ident.tenant, sid, int(request.num_tokens), op_id)
        return pb.GenerateResponse(token_ids=list(r.result.tokens))

    @unary(Role.TENANT)
    async def Evict(self, request: pb.EvictRequest, context: grpc.aio.ServicerContext,
                    ident: Identity) -> pb.EvictResponse:
        sid = check_session_id("session_id", request.session_id)
        r = await self.sessions.evict(ident.tenant, sid, int(request.piece_id), request.mode or "exact")
        return evict_to_proto(r.result)

    @unary(Role.TENANT)
    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext,
                   ident: Identity) -> pb.ForkResponse:
        sid, child = check_session_id("session_id", request.session_id), check_session_id("child_id", request.child_id)
        return pb.ForkResponse(session=row_to_proto(await self.sessions.fork(ident.tenant, sid, child)))

    @unary(Role.TENANT)
    async def AdmitToolResult(self, request: pb.AdmitToolResultRequest, context: grpc.aio.ServicerContext,
                              ident: Identity) -> pb.AdmitToolResultResponse:
        sid = check_session_id("session_id", request.session_id)
        if not request.ref:
            raise InvalidArgument("admit_tool_result needs the blob's ref (sha256 hex from PutBlob)")
        r = await self.sessions.admit_tool_result(ident.tenant, sid, request.ref, self._judge)
        a: ToolAdmission = r.result
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
        ws = await self.sessions.working_set(ident.tenant, sid, int(request.budget_tokens))
        items = [pb.WorkingSetItem(piece=piece_to_proto(i.piece), verdict=i.verdict, reason=i.reason or "")
                 for i in ws.items]
        return pb.WorkingSetResponse(items=items, tokens_reused=ws.tokens_reused,
                                     tokens_to_prefill=ws.tokens_to_prefill)

    @unary(Role.TENANT)
    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext,
                         ident: Identity) -> pb.GetSessionResponse:
        sid = check_session_id("session_id", request.session_id)
        row, digest, tokens = await self.sessions.get(ident.tenant, sid, request.include_tokens)
        out = pb.GetSessionResponse(session=row_to_proto(row), digest=digest)
        out.token_ids.extend(tokens)
        return out

    @unary(Role.TENANT)
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext,
                           ident: Identity) -> pb.CloseSessionResponse:
        await self.sessions.close_session(ident.tenant, check_session_id("session_id", request.session_id))
        return pb.CloseSessionResponse()

    @unary(Role.TENANT)
    async def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext,
                           ident: Identity) -> pb.ListSessionsResponse:
        operator = ident.role is Role.OPERATOR
        if request.tenant and not operator and request.tenant != ident.tenant:
            raise NotFound(f"no sessions visible for tenant {request.tenant!r}")
        if request.tenant and operator:  # NOTE: a name no tenant can have listed nothing, as a tenant without sessions
            check_tenant(request.tenant)
        tenant = (request.tenant or None) if operator else ident.tenant
        rows, nodes = await self.sessions.list_sessions(ident.tenant, tenant, request.fleet, operator)
        out = pb.ListSessionsResponse(sessions=[row_to_proto(r) for r in rows])
        out.nodes.extend(node_to_proto(s) for s in nodes)
        return out
