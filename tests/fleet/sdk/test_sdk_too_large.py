"""A request past the controller's message limit is refused saying so: its size, the limit and the flag.

NOTE: before, the SDK raised ResourceExhausted with gRPC's own words, "SERVER: Received message larger than max
(5983496 vs. 4194304)", naming neither the call nor what to change (found by review).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.controller import make_tokens, start_controller, store_url

from fleet.core.errors import ResourceExhausted, Unavailable
from fleet.sdk import NO_RETRY, AsyncFleetClient, FleetClient

IDS = list(range(2_000_000))  # about 6 MB on the wire, past the default 4 MiB


async def test_a_request_past_the_message_limit_names_the_limit_and_the_flag(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    said = r"Route: the request is [\d,]+ bytes, over the controller's limit of 4,194,304 bytes per message " \
           r"\(its --grpc-max-receive-bytes\)"
    try:
        async with AsyncFleetClient(ctl.address, tok.a, retry=NO_RETRY) as c:
            with pytest.raises(ResourceExhausted, match=said):
                await c.route(IDS, model="m")
            # control: the same call under the limit reaches the controller, which answers it (here: no router)
            with pytest.raises(Unavailable, match="the router is not running"):
                await c.route(IDS[:1000], model="m")
        with pytest.raises(ResourceExhausted, match=said):
            await asyncio.to_thread(_route, ctl.address, tok.a)
    finally:
        await ctl.stop(0)


def _route(address: str, token: str) -> object:
    with FleetClient(address, token) as c:
        return c.route(IDS, model="m")
