"""FleetService: who am I (any valid token) and the fleet listing (reader or operator role)."""

from __future__ import annotations

import re

import grpc

from controller.auth import ANYONE, Identity, Role
from controller.servicers.common import ServiceContext, unary
from controller.servicers.convert import statuses_to_proto
from fleet.api.kvfleet.v1 import fleet_pb2 as pb
from fleet.api.kvfleet.v1 import fleet_pb2_grpc as pbg

VERSION = "0.1.0"


def redact(url: str) -> str:
    """Hide a URL's password. Up to the LAST '@' of the authority: redis-py (urlparse) reads
    `redis://:p@ss@host` as password 'p@ss', so stopping at the first '@' would print 'ss'."""
    return re.sub(r"//([^/@:]*):[^/]*@", r"//\1:***@", url)


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
        return pb.GetFleetResponse(controller_version=VERSION, store=redact(self.ctx.store_url),
                                   leader=self.ctx.leader, workers=statuses_to_proto(workers))
