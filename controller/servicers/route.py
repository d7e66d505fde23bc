"""RouteService: Route, ReleaseRoute and MoveRoute, unary; the tenant's cache_salt and ownership come from its token.

A Route carries at most ctx.max_route_tokens tokens (--max-route-tokens) and a model name of at most
MAX_MODEL_CHARS characters; the router hashes a prompt over router.INLINE_HASH_TOKENS tokens off the event loop.
"""

from __future__ import annotations

import grpc

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, clip, unary
from controller.servicers.convert import decision_to_proto
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.core.errors import InvalidArgument

MAX_MODEL_CHARS = 1024


class RouteServicer(pbg.RouteServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(Role.TENANT)
    async def Route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext, ident: Identity
    ) -> pb.RouteResponse:
        if not request.model:
            raise InvalidArgument("route needs a model name (the one the workers were registered with)")
        if len(request.model) > MAX_MODEL_CHARS:
            raise InvalidArgument(f"model name of {len(request.model)} characters ({clip(request.model)}) is over "
                                  f"the limit of {MAX_MODEL_CHARS}; use the name the workers were registered with")
        if len(request.token_ids) > self.ctx.max_route_tokens:
            raise InvalidArgument(f"route of {len(request.token_ids)} tokens is over the controller's limit of "
                                  f"{self.ctx.max_route_tokens} (--max-route-tokens); send at most the model's "
                                  "context length, or raise the limit")
        salt = self.ctx.auth.cache_salt(ident.tenant)
        decision = await self.ctx.need_router().route(
            list(request.token_ids),
            request.model,
            cache_salt=salt,
            lora=request.lora if request.HasField("lora") else None,
            probe=request.probe if request.HasField("probe") else None,
            track=request.track,
            owner=ident.tenant,
        )
        return decision_to_proto(decision)

    @unary(Role.TENANT)
    async def ReleaseRoute(
        self, request: pb.ReleaseRouteRequest, context: grpc.aio.ServicerContext, ident: Identity
    ) -> pb.ReleaseRouteResponse:
        if not request.route_id:
            raise InvalidArgument("ReleaseRoute needs the route_id a Route answer carried")
        released = self.ctx.need_router().release_route(request.route_id, owner=ident.tenant)
        return pb.ReleaseRouteResponse(released=released)

    @unary(Role.TENANT)
    async def MoveRoute(
        self, request: pb.MoveRouteRequest, context: grpc.aio.ServicerContext, ident: Identity
    ) -> pb.MoveRouteResponse:
        if not request.route_id or not request.worker:
            raise InvalidArgument("MoveRoute needs the route_id a Route answer carried and the worker it went to")
        moved = self.ctx.need_router().move_route(request.route_id, request.worker, request.dp_rank, owner=ident.tenant)
        return pb.MoveRouteResponse(moved=moved)
