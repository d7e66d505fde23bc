"""RouteService: one unary call on the hot path; the tenant's cache_salt comes from its token."""

from __future__ import annotations

import grpc

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, unary
from controller.servicers.convert import decision_to_proto
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.errors import InvalidArgument


class RouteServicer(pbg.RouteServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(Role.TENANT)
    async def Route(self, request: pb.RouteRequest, context: grpc.aio.ServicerContext,
                    ident: Identity) -> pb.RouteResponse:
        if not request.model:
            raise InvalidArgument("route needs a model name (the one the workers were registered with)")
        salt = self.ctx.auth.cache_salt(ident.tenant)
        decision = await self.ctx.need_router().route(
            list(request.token_ids), request.model, cache_salt=salt,
            lora=request.lora if request.HasField("lora") else None,
            probe=request.probe if request.HasField("probe") else None,
        )
        return decision_to_proto(decision, salt)
