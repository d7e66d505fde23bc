"""FleetService: who am I (any valid token) and the fleet listing (reader or operator role)."""

from __future__ import annotations

from urllib.parse import urlsplit

import grpc

from controller.auth import ANYONE, Identity, Role
from controller.servicers.common import ServiceContext, unary
from controller.servicers.convert import statuses_to_proto
from fleet.api.kvfleet.v1 import fleet_pb2 as pb
from fleet.api.kvfleet.v1 import fleet_pb2_grpc as pbg
from fleet.cas.url import redact as redact  # re-exported: the controller's log lines and GetFleet use it

VERSION = "0.1.0"
class FleetServicer(pbg.FleetServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(ANYONE)
    async def WhoAmI(self, request: pb.WhoAmIRequest, context: grpc.aio.ServicerContext,
                     ident: Identity) -> pb.WhoAmIResponse:
        return pb.WhoAmIResponse(tenant=ident.tenant, role=ident.role.value, name=ident.name)

    @unary(Role.READER)
    async def GetFleet(self, request: pb.GetFleetRequest, context: grpc.aio.ServicerContext,
                       ident: Identity) -> pb.GetFleetResponse:
        workers = self.ctx.router.workers() if self.ctx.router is not None else []
        # a reader (the proxy's token) gets the kind of store only; the operator its URL, redacted
        url = self.ctx.store_url
        store = redact(url) if ident.role is Role.OPERATOR else urlsplit(url).scheme
        return pb.GetFleetResponse(controller_version=VERSION, store=store,
                                   leader=self.ctx.leader, workers=statuses_to_proto(workers))
