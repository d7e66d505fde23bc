"""vLLM's routes beyond the completions, through the proxy: the pooling family and /v1/responses are routed by load
alone (COLD) and forwarded as the completions are; /tokenize, /detokenize and /version are sent on to a worker.

NOTE: before, the proxy registered only the completions, /v1/models and its own routes: every one of these got the
proxy's own 404 (found by review), while the worker behind it answered them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import MODEL, Fleet, proxy_released, served, start_fleet, until

from controller.cost import CostConfig
from fleet.app.testkit.sim_vllm.app import VERSION

BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"input": "the quick brown fox"},
    "/pooling": {"input": "the quick brown fox"},
    "/classify": {"input": ["good", "bad"]},
    "/score": {"text_1": "a fox", "text_2": ["a dog", "a cat"]},
    "/v1/score": {"text_1": "a fox", "text_2": "a dog"},
    "/rerank": {"query": "a fox", "documents": ["a dog", "a cat"]},
    "/v1/rerank": {"query": "a fox", "documents": ["a dog"]},
    "/v2/rerank": {"query": "a fox", "documents": [{"text": "a dog"}]},
    "/v1/responses": {"input": "Say hello.", "max_output_tokens": 4},
}


def _received(fleet: Fleet, worker: str, path: str) -> list[dict[str, Any]]:
    """The bodies of `path` requests that `worker` received, as it read them."""
    return [json.loads(raw) for p, raw, _ in fleet.sims[worker].received.items if p == path]


async def test_the_pooling_routes_and_responses_are_routed_by_load_and_forwarded(tmp_path: Path) -> None:
    # NOTE: no /metrics look may end a route here (30 s grace): only the proxy's release does
    fleet = await start_fleet(tmp_path, cost=CostConfig(reconcile_grace_s=30.0), fair_priority=True,
                              max_body_bytes=1 << 16)
    salt = fleet.ctl.ctx.auth.cache_salt("acme", "mine")
    router = fleet.ctl.ctx.need_router()
    try:
        for path, body in BODIES.items():
            sent = {"model": MODEL, **body, "cache_salt": "mine", "priority": -100}
            status, h, raw = await fleet.post(path, sent)
            assert status == 200, (path, raw)
            assert (h["x-kvfleet-verdict"], h["x-kvfleet-matched-tokens"], h["x-kvfleet-attempts"]) == ("COLD", "0", "1")
            (got,) = _received(fleet, h["x-kvfleet-worker"], path)
            # the controller's salt (the tenant's, derived with the client's own) and the proxy's fair priority replace
            # the client's; the rest is forwarded as sent
            assert got == {**sent, "cache_salt": salt, "priority": 0}, path
            print(f"{path}: {status} via {h['x-kvfleet-worker']}, {json.loads(raw).get('object')}")
        assert not any(served(s, "/tokenize") for s in fleet.sims.values())  # nothing was tokenized to route them
        await until(lambda: _num(router.flights), lambda n: n == 0)  # every route released
        await proxy_released(fleet, len(BODIES))
        # control: auth, model and body limits hold as for the completions; none of these reaches a worker
        async with fleet.http.post(fleet.proxy.url + "/v1/embeddings", json=BODIES["/v1/embeddings"]) as r:
            assert r.status == 401
        status, _, raw = await fleet.post("/v1/embeddings", {"model": "no-such-model", "input": "x"})
        assert status == 404 and b"no-such-model" in raw
        status, _, _ = await fleet.post("/v1/embeddings", {"model": MODEL, "input": "x" * (1 << 16)})
        assert status == 413
        assert sum(len(_received(fleet, w, "/v1/embeddings")) for w in fleet.sims) == 1
    finally:
        await fleet.stop()


async def _num(flights: Any) -> int:
    return len(flights)


async def test_tokenize_detokenize_and_version_are_sent_on_to_a_serving_worker(fleet: Fleet) -> None:
    body = {"model": MODEL, "prompt": "hello there, world"}
    async with fleet.http.post(fleet.sims["w0"].url + "/tokenize", json=body) as r:
        direct = await r.json()
    status, h, raw = await fleet.post("/tokenize", body)
    assert status == 200 and json.loads(raw) == direct and h["x-kvfleet-worker"] in fleet.sims
    assert "x-kvfleet-verdict" not in h  # not routed: no Route asked of the controller
    status, _, raw = await fleet.post("/detokenize", {"model": MODEL, "tokens": direct["tokens"]})
    assert status == 200 and json.loads(raw)["prompt"].count(" t") == len(direct["tokens"])
    status, _, raw = await fleet.post("/tokenize", {"prompt": body["prompt"]})  # no model: the fleet's one model
    assert status == 200 and json.loads(raw) == direct
    async with fleet.http.get(fleet.proxy.url + "/version", headers=fleet.headers()) as r:
        assert r.status == 200 and await r.json() == {"version": VERSION}
    # control: the tenant's token is needed, and a model no worker serves is the proxy's 404
    for method, path, sent in (("GET", "/version", None), ("POST", "/tokenize", body)):
        async with fleet.http.request(method, fleet.proxy.url + path, json=sent) as r:
            assert r.status == 401, path
    status, _, _ = await fleet.post("/detokenize", {"model": "no-such-model", "tokens": [1]})
    assert status == 404
