"""The kvfleet Python SDK: a gRPC client of the controller, sync (FleetClient) and asyncio (AsyncFleetClient).

    from fleet.sdk import FleetClient
    with FleetClient("127.0.0.1:50051", token="kvf_...") as c:
        ref = c.put_blob(b"tool output")
        d = c.route([1, 2, 3], model="m")   # d.worker, d.url, d.verdict, d.matched_tokens, d.epoch

Errors are raised as fleet.core.errors.* carrying the server's message; UNAVAILABLE is retried with
exponential backoff and jitter (RetryPolicy) until its deadline, and so is DEADLINE_EXCEEDED of the calls that
carry an op id (append, add_tool_result, generate), whose errors carry it (`e.op_id`).
"""

from __future__ import annotations

from fleet.sdk.aio import AsyncFleetClient
from fleet.sdk.client import FleetClient
from fleet.sdk.retry import NO_RETRY, RetryPolicy
from fleet.sdk.types import (
    BlobInfo,
    BlobRef,
    Caller,
    FleetInfo,
    RankInfo,
    RouteCandidate,
    RouteCost,
    RouteDecision,
    Witness,
    WorkerInfo,
)

__all__ = [
    "FleetClient",
    "AsyncFleetClient",
    "RetryPolicy",
    "NO_RETRY",
    "BlobRef",
    "BlobInfo",
    "RouteDecision",
    "RouteCandidate",
    "RouteCost",
    "Witness",
    "WorkerInfo",
    "RankInfo",
    "Caller",
    "FleetInfo",
]
