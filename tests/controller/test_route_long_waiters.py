"""A tenant's long Routes waiting for a hashing thread are bounded, and hold no list of their ids while they wait.

A prompt over hash_lane.INLINE_HASH_TOKENS is hashed in a thread, HASH_THREADS_PER_TENANT of a tenant's at a time
(tests/controller/test_route_hash_lanes.py). Its others wait; before, without limit, each holding its ids as
a list of Python ints built on the event loop (36 MB per 1M tokens): 24 waiting 1M-token Routes took the
controller from 75 to 889 MiB. Now the tokens of a tenant's waiting long prompts are capped at
LONG_WAIT_TOKENS_PER_TENANT (eight prompts of the default --max-route-tokens), past which a Route is
RESOURCE_EXHAUSTED; a waiting one holds its request's packed ids only. Another tenant is not refused, nor is a
short prompt. Real Router and controller, no workers (a route that got its turn ends NOT_FOUND, after hashing).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tracemalloc
from pathlib import Path

import grpc

from controller.auth import mint_token
from controller.config import ControllerConfig
from controller.hash_lane import HASH_THREADS_PER_TENANT, INLINE_HASH_TOKENS
from controller.keyed_slots import KeyedSlots
from controller.metrics import Metrics
from controller.router import Router, RouterConfig
from controller.server import build_server
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.cas import open_store
from fleet.core.errors import NotFound, ResourceExhausted
from fleet.sdk import base

LONG = 1 << 20  # the default --max-route-tokens
WAITING = 4 * HASH_THREADS_PER_TENANT  # of those, a tenant's waiting ones fill its limit
OVER = 2


def _waiting(slots: KeyedSlots, tenant: str, held: int) -> int:
    """The tenant's callers waiting for one of its slots (holding or waiting, less the `held` ones)."""
    share = slots._shares.get(tenant)
    return 0 if share is None else share.users - held


async def test_a_tenants_long_prompts_past_its_waiting_limit_are_refused_and_others_are_not(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path}/kv.db")
    r = Router(store, Metrics(), RouterConfig())
    prompt = [300 + k % 150_000 for k in range(LONG)]  # one list for every route: the test holds it once

    async def route(tenant: str, ids: list[int]) -> str:
        try:
            await r.route(ids, "m", cache_salt=tenant, owner=tenant)
        except ResourceExhausted as e:
            return f"refused: {e}"
        except NotFound:  # no worker registered: the route ends after its hashing
            return "hashed"
        return "routed"

    try:
        # started together: the first HASH_THREADS_PER_TENANT take the tenant's threads, the rest wait or are refused
        flood = [asyncio.ensure_future(route("a", prompt)) for _ in range(HASH_THREADS_PER_TENANT + WAITING + OVER)]
        await asyncio.sleep(0)
        control = [asyncio.ensure_future(route("b", prompt)), asyncio.ensure_future(route("a", prompt[:64]))]
        outcomes = await asyncio.gather(*flood)
        assert await asyncio.gather(*control) == ["hashed", "hashed"]  # another tenant's long prompt, a's short one
    finally:
        store.close()
    refused = [o for o in outcomes if o.startswith("refused")]
    assert len(refused) == OVER, outcomes
    assert outcomes.count("hashed") == HASH_THREADS_PER_TENANT + WAITING
    assert "'a' has 8,388,608 tokens of long prompts" in refused[0] and "retry" in refused[0]
    assert len(r.hash_lane.slots) == 0 and not r.hash_lane.waiting
    # its flood answered, the tenant's next long prompt is taken again
    assert await route("a", prompt) == "hashed"


async def test_long_routes_waiting_over_grpc_hold_no_list_of_their_ids(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.json"
    acme, bravo = mint_token(tokens, "acme", "tenant"), mint_token(tokens, "bravo", "tenant")
    ctl = await build_server(
        ControllerConfig(listen="127.0.0.1:0", store_url=f"sqlite:///{tmp_path}/ctl.db", tokens_file=str(tokens),
                         gc_interval_s=0, fleet_metrics_interval_s=0),
        metrics=Metrics(),
    )
    router = ctl.ctx.need_router()
    channel = grpc.aio.insecure_channel(ctl.address, options=[("grpc.max_send_message_length", 8 << 20)])
    stub = RouteServiceStub(channel)
    ids = [300 + k % 150_000 for k in range(LONG)]
    one_list = sys.getsizeof(ids) + sum(map(sys.getsizeof, ids[:1000])) * (LONG // 1000)  # ~36 MB as Python ints
    request = pb.RouteRequest(token_ids=ids, model="m")
    del ids
    sent = WAITING + OVER
    answers: list[pb.RouteStreamResponse] = []
    try:
        async with contextlib.AsyncExitStack() as held:
            # NOTE: acme's hashing threads are taken, as two long prompts being hashed would: all its Routes wait
            for _ in range(HASH_THREADS_PER_TENANT):
                await held.enter_async_context(router.hash_lane.slots.hold("acme", None, "test"))
            tracemalloc.start()
            try:
                call = stub.RouteStream(metadata=base.metadata(acme))
                for i in range(sent):
                    await call.write(pb.RouteStreamRequest(id=i, route=request))

                async def read() -> None:
                    async for a in call:
                        answers.append(a)
                        if len(answers) == sent:
                            return

                reader = asyncio.ensure_future(read())
                for _ in range(3000):  # until every message waits or was refused
                    if _waiting(router.hash_lane.slots, "acme", HASH_THREADS_PER_TENANT) + len(answers) == sent:
                        break
                    await asyncio.sleep(0.01)
                waiting, refused_early = _waiting(router.hash_lane.slots, "acme", HASH_THREADS_PER_TENANT), len(answers)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert peak < one_list, f"{peak / 2**20:.0f} MiB traced while {waiting} waited"
            assert (waiting, refused_early) == (WAITING, OVER)
            # control: another tenant's long Route, and acme's short one, are hashed meanwhile (no worker: NOT_FOUND)
            for token, n in ((bravo, LONG), (acme, INLINE_HASH_TOKENS)):
                try:
                    await stub.Route(pb.RouteRequest(token_ids=request.token_ids[:n], model="m"),
                                     metadata=base.metadata(token))
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.NOT_FOUND, e.details()
                else:
                    raise AssertionError("routed with no worker registered")
        await asyncio.wait_for(reader, 60)  # the held threads freed: the waiting ones are answered
        codes = sorted(a.error.code for a in answers)
        assert codes == ["NOT_FOUND"] * WAITING + ["RESOURCE_EXHAUSTED"] * OVER
        refusal = next(a.error.message for a in answers if a.error.code == "RESOURCE_EXHAUSTED")
        assert "8,388,608 tokens waiting per tenant" in refusal
        assert not router.hash_lane.waiting and len(router.hash_lane.slots) == 0
        call.cancel()
    finally:
        await channel.close()
        await ctl.stop(0)
