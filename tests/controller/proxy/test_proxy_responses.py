"""vLLM keeps a stored /v1/responses answer in the memory of the server that answered it: a follow-up naming it
(`previous_response_id`), GET /v1/responses/{id} and its cancel are answered there only, and any other worker answers
404. The proxy pins each response id to the worker that answered it, and a proxy without the pin (restarted, or
another replica) finds the worker by asking.

NOTE: before, the proxy routed a follow-up by load like any /v1/responses request: with the load elsewhere it reached
a worker that did not hold the response and the client got vLLM's 404; GET and cancel were the proxy's own 404.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import MODEL, Fleet, served, start_fleet

from controller.cost import CostConfig
from controller.proxy.responses import ResponsePins, response_id, valid_id


async def _get(fleet: Fleet, path: str, method: str = "GET", who: str = "a") -> tuple[int, dict[str, str], Any]:
    async with fleet.http.request(method, fleet.proxy.url + path, headers=fleet.headers(who)) as r:
        return r.status, dict(r.headers), await r.json()


async def test_a_follow_up_get_and_cancel_reach_the_worker_that_stored_the_response(tmp_path: Path) -> None:
    # NOTE: no /metrics look may end the routes held below (30 s grace)
    fleet = await start_fleet(tmp_path, cost=CostConfig(reconcile_grace_s=30.0))
    router = fleet.ctl.ctx.need_router()
    try:
        status, h, raw = await fleet.post("/v1/responses", {"model": MODEL, "input": "Say hello.", "max_output_tokens": 4})
        assert status == 200, raw
        holder, rid = h["x-kvfleet-worker"], json.loads(raw)["id"]
        routes = []  # load on the holder: two routes that stay in flight there, so routing by load goes elsewhere
        while sum(d.worker == holder for d in routes) < 2:
            routes.append(await router.route([], MODEL, owner="acme", track=True))
        held = [d for d in routes if d.worker == holder]
        for d in routes:
            if d.worker != holder:
                router.release_route(d.route_id, owner="acme")
        status, h, _ = await fleet.post("/v1/responses", {"model": MODEL, "input": "Something else."})
        assert status == 200 and h["x-kvfleet-worker"] != holder  # control: a request naming no response goes by load

        follow = {"model": MODEL, "input": "And then?", "max_output_tokens": 4, "previous_response_id": rid}
        status, h, raw = await fleet.post("/v1/responses", follow)
        assert (status, h["x-kvfleet-worker"]) == (200, holder), raw  # NOTE: before, 404 from another worker
        answer = json.loads(raw)
        assert answer["previous_response_id"] == rid
        status, h, got = await _get(fleet, f"/v1/responses/{rid}")
        assert (status, h["x-kvfleet-worker"], got["id"]) == (200, holder, rid)  # NOTE: before, the proxy's 404
        status, h, got = await _get(fleet, f"/v1/responses/{rid}/cancel", "POST")
        assert (status, h["x-kvfleet-worker"]) == (400, holder)  # vLLM's answer for a finished response, from it
        assert "synchronous" in got["error"]["message"]

        fleet.proxy.responses = ResponsePins()  # a restarted proxy, or another replica: no pins
        status, h, raw = await fleet.post("/v1/responses", {**follow, "previous_response_id": answer["id"]})
        assert (status, h["x-kvfleet-worker"]) == (200, holder), raw  # found by asking the workers
        assert fleet.proxy.responses.get("acme", answer["id"]) == holder

        missing = "resp_" + "0" * 32
        status, _, got = await _get(fleet, f"/v1/responses/{missing}")
        assert status == 404 and got["error"]["message"] == f"Response with id '{missing}' not found."
        assert got["error"]["type"] == "invalid_request_error"  # vLLM's (it was the proxy's NotFoundError)
        asked = sum(len(served(s, f"/v1/responses/{missing}")) for s in fleet.sims.values())
        assert asked == len(fleet.sims)  # every worker was asked once
        status, _, _ = await _get(fleet, f"/v1/responses/{missing}")
        assert status == 404 and asked == sum(len(served(s, f"/v1/responses/{missing}")) for s in fleet.sims.values())
        status, _, raw = await fleet.post("/v1/responses", {**follow, "previous_response_id": missing})
        assert status == 404 and missing in json.loads(raw)["error"]["message"]  # vLLM's own answer, passed on
        for d in held:
            router.release_route(d.route_id, owner="acme")
    finally:
        await fleet.stop()


async def test_one_tenants_unknown_ids_never_push_out_anothers(tmp_path: Path) -> None:
    """An id no worker holds is answered 404 for a while without asking the workers again; one tenant's stream of
    made-up ids must not push out another tenant's. NOTE: before, the ids were one queue, oldest out first: bravo's 17
    made-up ids pushed out acme's, and acme's next GET of its unknown id cost every worker a GET again."""
    fleet = await start_fleet(tmp_path, num_workers=2)
    try:
        fleet.proxy.responses = ResponsePins(per_tenant=4, miss_s=3600.0)  # 16 ids no worker held; none ages out here

        def asked(rid: str) -> int:
            return sum(len(served(s, f"/v1/responses/{rid}")) for s in fleet.sims.values())

        mine = "resp_" + "a" * 32
        assert (await _get(fleet, f"/v1/responses/{mine}"))[0] == 404 and asked(mine) == 2  # each worker asked once
        flood = [f"resp_b{i:031d}" for i in range(17)]
        for rid in flood:  # one past the bound
            assert (await _get(fleet, f"/v1/responses/{rid}", who="b"))[0] == 404
        assert fleet.proxy.responses.num_misses() == 16
        assert (await _get(fleet, f"/v1/responses/{mine}"))[0] == 404
        assert asked(mine) == 2  # acme's is still held: no worker asked again (before: 4)
        assert (await _get(fleet, f"/v1/responses/{flood[0]}", who="b"))[0] == 404
        assert asked(flood[0]) == 4  # control: the bound binds, on bravo's own oldest
    finally:
        await fleet.stop()


def test_the_response_id_is_read_off_an_answers_first_bytes() -> None:
    assert response_id(b'{"id":"resp_abc123","object":"response","output":[{"id":"msg_1"}]}') == "resp_abc123"
    streamed = b'event: response.created\ndata: {"type":"response.created","response":{"id": "resp_9f"'
    assert response_id(streamed) == "resp_9f"
    assert response_id(b'{"id":"chatcmpl-1"}') is None
    assert valid_id("resp_ab-C_9") == "resp_ab-C_9"
    assert valid_id("resp_/../x") is None and valid_id(7) is None and valid_id("resp_") is None


def test_pins_are_bounded_per_tenant() -> None:
    pins = ResponsePins(per_tenant=2, max_tenants=2)
    pins.pin("a", "resp_1", "w0")
    for i in range(10):  # one tenant's flood pushes out its own pins only
        pins.pin("b", f"resp_b{i}", "w1")
    assert pins.get("a", "resp_1") == "w0" and len(pins) == 3
    assert pins.get("b", "resp_1") is None  # a tenant's pins are its own
    pins.get("a", "resp_1")  # a tenant reading its pins is active
    pins.pin("c", "resp_c", "w2")  # a third tenant: the least recently active one leaves
    assert pins.get("b", "resp_b9") is None and pins.get("a", "resp_1") == "w0" and pins.get("c", "resp_c") == "w2"
    pins.forget_worker("w0")
    assert len(pins) == 1
    assert not pins.missed("a", "resp_x", now=0.0) and pins.missed("a", "resp_x", now=0.0, seen=True)
    assert not pins.missed("b", "resp_x", now=1.0) and not pins.missed("a", "resp_x", now=5.0)  # per tenant; 5 s
