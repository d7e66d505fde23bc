"""The proxy's ControlClient against a real gRPC server on loopback whose Fleet and Route services a test writes
(a stub controller: what it answers, and when, is the test's). For tests of the proxy's own bookkeeping of its
calls to the controller (its RPC slots), where the real controller's answers would not be under the test's control."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from controller.proxy.control import ControlClient
from fleet.api.kvfleet.v1 import fleet_pb2_grpc, route_pb2_grpc


@contextlib.asynccontextmanager
async def stub_control(servicer: Any, max_rpcs: int = 8, timeout_s: float = 5.0) -> AsyncIterator[ControlClient]:
    """A unary ControlClient (no RouteStream) of `max_rpcs` slots, talking to `servicer` (Fleet and Route)."""
    server = grpc.aio.server()
    fleet_pb2_grpc.add_FleetServiceServicer_to_server(servicer, server)
    route_pb2_grpc.add_RouteServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    control = ControlClient(f"127.0.0.1:{port}", timeout_s=timeout_s, max_rpcs=max_rpcs, stream=False)
    try:
        yield control
    finally:
        await control.close()
        await server.stop(0)


class Holds:
    """Calls a stub holds until `release` is set: how many are held now (`held`) and at most at once (`peak`)."""

    def __init__(self) -> None:
        self.held = self.peak = 0
        self.release = asyncio.Event()

    async def hold(self) -> None:
        self.held += 1
        self.peak = max(self.peak, self.held)
        try:
            await self.release.wait()
        finally:
            self.held -= 1
