"""One client token cannot take every one of the proxy's RPC slots to the controller (rule: one tenant never
slows another).

The proxy keeps at most `controller_max_rpcs` RPCs open to the controller; the others wait (at most the route
timeout, then 503). A token may hold at most three quarters of them, so a flood from one token leaves room
for the rest.
The controller here is a real grpc.aio server whose Route holds the flooding token's calls for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import grpc
import pytest

from controller.proxy.control import ControlClient
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.core.errors import Unavailable

HOLD_S = 1.0


class _SlowForOne(pbg.RouteServiceServicer):
    """Answers Route at once, except for the token "flood", whose calls it holds HOLD_S."""

    def __init__(self) -> None:
        self.routes = 0

    async def Route(self, request: pb.RouteRequest, context: Any) -> pb.RouteResponse:
        self.routes += 1
        if dict(context.invocation_metadata()).get("authorization") == "Bearer flood":
            await asyncio.sleep(HOLD_S)
        return pb.RouteResponse(worker="w0", url="http://127.0.0.1:1", route_id=f"r{self.routes}")


async def _route_s(control: ControlClient, token: str) -> float:
    t0 = time.perf_counter()
    await control.route([1, 2], "m", lora=None, token=token)
    return time.perf_counter() - t0


async def test_a_flooding_token_leaves_slots_for_the_others() -> None:
    server = grpc.aio.server()
    pbg.add_RouteServiceServicer_to_server(_SlowForOne(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    control = ControlClient(f"127.0.0.1:{port}", timeout_s=5.0, max_rpcs=8, stream=False)
    try:
        flood = [asyncio.ensure_future(_route_s(control, "flood")) for _ in range(16)]
        await asyncio.sleep(0.2)  # the flood's calls hold their slots (and wait for more)
        calm = await _route_s(control, "calm")
        assert calm < HOLD_S / 2, f"another token's route waited {calm:.2f}s behind the flood"
        took = await asyncio.gather(*flood)
        # control: the flood itself was held, 6 calls at a time (three quarters of the 8 slots): 3 rounds of HOLD_S
        assert min(took) >= HOLD_S * 0.9 and max(took) >= HOLD_S * 2.7
    finally:
        await control.close()
        await server.stop(0)


async def test_a_call_past_its_tokens_share_fails_saying_so() -> None:
    control = ControlClient("127.0.0.1:1", timeout_s=0.2, max_rpcs=4, stream=False)  # no RPC is sent
    try:
        async with contextlib.AsyncExitStack() as held:
            for _ in range(3):  # the token's share: 3 of the 4 slots
                await held.enter_async_context(control._slot("Route", "flood"))
            with pytest.raises(Unavailable, match="this client token already has 3 of them, and none was free within 0.2s"):
                async with control._slot("Route", "flood"):
                    pass
            async with control._slot("Route", "calm"):  # the quarter left is taken at once
                with pytest.raises(Unavailable, match="the proxy.s RPCs to the controller: all 4 were busy"):
                    async with control._slot("Route", "third"):
                        pass
        assert len(control._slots) == 0  # no caller left: no share kept
    finally:
        await control.close()
