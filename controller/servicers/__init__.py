"""gRPC servicers: typed grpc.aio adapters translating proto <-> domain (one module per service)."""

from __future__ import annotations

import grpc

from controller.servicers.blobs import BlobServicer
from controller.servicers.common import ServiceContext
from controller.servicers.fleet import FleetServicer
from controller.servicers.quarantine import QuarantineServicer
from controller.servicers.route import RouteServicer
from controller.servicers.sessions import SessionServicer
from controller.servicers.workers import WorkerServicer
from fleet.api.kvfleet.v1 import (
    blobs_pb2,
    blobs_pb2_grpc,
    fleet_pb2,
    fleet_pb2_grpc,
    quarantine_pb2,
    quarantine_pb2_grpc,
    route_pb2,
    route_pb2_grpc,
    sessions_pb2,
    sessions_pb2_grpc,
    workers_pb2,
    workers_pb2_grpc,
)

SERVICE_NAMES = tuple(m.DESCRIPTOR.services_by_name[n].full_name for m, n in (
    (blobs_pb2, "BlobService"), (workers_pb2, "WorkerService"), (route_pb2, "RouteService"), (fleet_pb2, "FleetService"),
    (sessions_pb2, "SessionService"), (quarantine_pb2, "QuarantineService")))


def add_servicers(server: grpc.aio.Server, ctx: ServiceContext) -> tuple[str, ...]:
    """Register every kvfleet.v1 service on `server`; return their full names."""
    blobs_pb2_grpc.add_BlobServiceServicer_to_server(BlobServicer(ctx), server)
    workers_pb2_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(ctx), server)
    route_pb2_grpc.add_RouteServiceServicer_to_server(RouteServicer(ctx), server)
    fleet_pb2_grpc.add_FleetServiceServicer_to_server(FleetServicer(ctx), server)
    sessions_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(ctx), server)
    quarantine_pb2_grpc.add_QuarantineServiceServicer_to_server(QuarantineServicer(ctx), server)
    return SERVICE_NAMES


__all__ = ["ServiceContext", "add_servicers", "SERVICE_NAMES"]
