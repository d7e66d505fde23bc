"""QuarantineService: the proxy's tool-result verdicts (tenant), operator verdicts, recent quarantines.

Thin: authenticate, translate, run controller.verdicts.Judge in the caller's judge lane (its CPU on the
judge pool, paced per tenant: controller/judge_lanes.py; never the store executor that uploads use),
translate back. The Judge is the controller's one (ServiceContext.judge, shared with
SessionService.AdmitToolResult) and is built on first use, so a controller that never sees a tool result
never loads a detector. A heavy layer's verdict is not waited for (ServiceContext.judge_now).
"""

from __future__ import annotations

import grpc

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, unary
from fleet.api.kvfleet.v1 import quarantine_pb2 as pb
from fleet.api.kvfleet.v1 import quarantine_pb2_grpc as pbg
from fleet.cas.types import check_tenant
from fleet.core.errors import PermissionDenied
from fleet.sdk.quarantine import QuarantineRecord

DEFAULT_LIMIT, MAX_LIMIT = 100, 1000


class QuarantineServicer(pbg.QuarantineServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(Role.TENANT)
    async def JudgeToolResults(self, request: pb.JudgeToolResultsRequest, context: grpc.aio.ServicerContext,
                               ident: Identity) -> pb.JudgeToolResultsResponse:
        j = await self.ctx.judge()
        out = await self.ctx.judge_now(ident.tenant, list(request.results), request.action)
        self.ctx.metrics.quarantines.inc(sum(x.quarantined for x in out))
        return pb.JudgeToolResultsResponse(
            judgements=[pb.Judgement(ref=x.ref, quarantined=x.quarantined, reasons=x.reasons, source=x.source)
                        for x in out],
            detector_config_id=j.config_id_for(ident.tenant))

    @unary(Role.TENANT)
    async def KnownVerdicts(self, request: pb.KnownVerdictsRequest, context: grpc.aio.ServicerContext,
                            ident: Identity) -> pb.KnownVerdictsResponse:
        j = await self.ctx.judge()  # NOTE: store reads only, in the tenant's lane as its judging is
        out = await self.ctx.judge_lanes.run(ident.tenant, j.known, list(request.refs), ident.tenant)
        return pb.KnownVerdictsResponse(
            judgements=[pb.Judgement(ref=x.ref, quarantined=x.quarantined, reasons=x.reasons, source=x.source)
                        for x in out])

    @unary(Role.OPERATOR)
    async def SetVerdict(self, request: pb.SetVerdictRequest, context: grpc.aio.ServicerContext,
                         ident: Identity) -> pb.SetVerdictResponse:
        j = await self.ctx.judge()
        await self.ctx.blocking(j.set_verdict, request.ref, request.verdict, list(request.reasons))
        return pb.SetVerdictResponse(ref=request.ref, verdict=request.verdict)

    @unary(Role.TENANT)
    async def ListQuarantines(self, request: pb.ListQuarantinesRequest, context: grpc.aio.ServicerContext,
                              ident: Identity) -> pb.ListQuarantinesResponse:
        tenant: str | None = request.tenant or ident.tenant
        if ident.role is Role.OPERATOR:
            # NOTE: unchecked, a name no tenant can have reached the store, which refused the namespace it makes
            # ("invalid namespace 'quarantine.seen/a b'"), naming neither the field nor the rule
            tenant = check_tenant(request.tenant) if request.tenant else None
        elif tenant != ident.tenant:
            # NOTE: another tenant's records answer like none at all would leak nothing, but a refusal is clearer
            raise PermissionDenied("a tenant token lists only its own tenant's quarantines; leave --tenant out")
        limit = min(request.limit or DEFAULT_LIMIT, MAX_LIMIT)
        # NOTE: within the caller's share of the store threads, as blob calls are: with any thread (ctx.blocking), one
        # tenant's listings (each a scan of every tenant's records) held all four, and another's StatBlob waited
        recs = await self.ctx.tenant_blocking(ident.tenant, (await self.ctx.judge()).recent, tenant, limit)
        return pb.ListQuarantinesResponse(records=[_to_proto(r) for r in recs])


def _to_proto(r: QuarantineRecord) -> pb.QuarantineRecord:
    return pb.QuarantineRecord(tenant=r.tenant, ref=r.ref, reasons=r.reasons, source=r.source, action=r.action,
                               first_seen=r.first_seen, last_seen=r.last_seen, num_seen=r.num_seen)
