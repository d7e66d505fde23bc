"""The proxy's gRPC link to the controller: Route and WhoAmI with the CLIENT's token, ListWorkers with its own.

One channel for every caller; the bearer token travels as per-call metadata, so the controller
authenticates each client and derives its tenant's cache_salt itself. No retries here: the proxy
is on the request path and answers 503 (Retry-After) when the controller is unavailable.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc

from fleet.api.kvfleet.v1 import fleet_pb2, workers_pb2
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.sdk import base, types


class ControlClient:
    """Route / WhoAmI / ListWorkers against one controller; errors raised as fleet.errors.*."""

    def __init__(self, target: str, *, timeout_s: float = 2.0, auth_cache_s: float = 5.0) -> None:
        self.target, self.timeout_s, self.auth_cache_s = target, timeout_s, auth_cache_s
        self._channel = grpc.aio.insecure_channel(target)
        self._route = RouteServiceStub(self._channel)
        self._fleet = FleetServiceStub(self._channel)
        self._workers = WorkerServiceStub(self._channel)
        self._callers: dict[str | None, tuple[float, types.Caller]] = {}

    async def route(self, token_ids: Sequence[int], model: str, *, lora: str | None,
                    token: str | None) -> types.RouteDecision:
        req = base.route_request(token_ids, model, lora, None)
        try:
            r = await self._route.Route(req, timeout=self.timeout_s, metadata=base.metadata(token))
        except grpc.RpcError as e:
            raise base.to_error(e, "Route", self.target) from e
        return types.route_decision(r)

    async def whoami(self, token: str | None) -> types.Caller:
        """Who the controller says `token` is; good answers are cached auth_cache_s (Route re-checks anyway)."""
        hit = self._callers.get(token)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        try:
            r = await self._fleet.WhoAmI(fleet_pb2.WhoAmIRequest(), timeout=self.timeout_s,
                                         metadata=base.metadata(token))
        except grpc.RpcError as e:
            raise base.to_error(e, "WhoAmI", self.target) from e
        caller = types.Caller(r.tenant, r.role, r.name)
        if len(self._callers) > 10000:
            self._callers.clear()
        self._callers[token] = (time.monotonic() + self.auth_cache_s, caller)
        return caller

    async def workers(self, token: str | None) -> list[types.WorkerInfo]:
        try:
            r = await self._workers.ListWorkers(workers_pb2.ListWorkersRequest(), timeout=self.timeout_s,
                                                metadata=base.metadata(token))
        except grpc.RpcError as e:
            raise base.to_error(e, "ListWorkers", self.target) from e
        return [types.worker_info(w) for w in r.workers]

    async def close(self) -> None:
        await self._channel.close()
