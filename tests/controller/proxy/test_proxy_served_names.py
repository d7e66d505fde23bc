"""A model served under several names (vLLM's `--served-model-name a b`: one card per name, each with parent null)
is routed as the model its workers registered, and forwarded under the client's name.

NOTE: before, the proxy took each parentless card for a model of its own: it listed the alias, then answered a
request for it 503 "no registered worker of model 'sim-alias' to tokenize with", and a request without a model
400 "the fleet serves 2 models" (found by review), where vLLM serves both names and fills in the first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import BLOCK, MODEL, Fleet, start_fleet, until

from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimVllm
from fleet.app.testkit.sim_vllm.parts import SimConfig

ALIAS = "sim-alias"
MESSAGES = [{"role": "system", "content": "You are a careful assistant. " * 8}, {"role": "user", "content": "Hi."}]


def _last_model(fleet: Fleet, worker: str) -> Any:
    """The model the worker's last chat request named, as it received the body."""
    path, raw, _ = fleet.sims[worker].received.items[-1]
    assert path == "/v1/chat/completions"
    return json.loads(raw).get("model")


async def _chat(fleet: Fleet, **model: str) -> dict[str, str]:
    status, headers, raw = await fleet.post("/v1/chat/completions", {**model, "messages": MESSAGES, "max_tokens": 4})
    assert status == 200, raw
    return headers


async def test_an_alias_is_routed_as_its_workers_model_and_forwarded_by_its_own_name(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, engine_kw={"served_model_names": (MODEL, ALIAS)})
    try:
        async with fleet.http.get(fleet.proxy.url + "/v1/models", headers=fleet.headers()) as r:
            assert [(c["id"], c["parent"]) for c in (await r.json())["data"]] == [(MODEL, None), (ALIAS, None)]
        h = await _chat(fleet, model=ALIAS)  # before: 503
        worker = h["x-kvfleet-worker"]
        assert _last_model(fleet, worker) == ALIAS  # the client's name, as the worker serves it
        await until(lambda: fleet.blocks_known(worker), lambda n: n >= 3)  # the prompt's 3 full blocks (KV events)
        # one model under two names: the alias's blocks are the model's, so its name finds them warm
        again = await _chat(fleet, model=MODEL)
        assert (again["x-kvfleet-worker"], again["x-kvfleet-verdict"]) == (worker, "WARM")
        none = await _chat(fleet)  # no model: the first served name, as vLLM fills it in (before: 400)
        assert _last_model(fleet, none["x-kvfleet-worker"]) == MODEL
        print("alias", h["x-kvfleet-verdict"], "-> model", again["x-kvfleet-verdict"], again["x-kvfleet-matched-tokens"])
    finally:
        await fleet.stop()


async def test_without_a_model_two_registered_models_are_still_a_400(tmp_path: Path) -> None:
    """The control: a fleet of two distinct models (each under its own name) cannot guess which one is meant."""
    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw={"served_model_names": (MODEL, ALIAS)})
    other = await SimVllm(SimConfig(engine=SimEngineConfig(model="other-model", block_size=BLOCK))).start()
    try:
        await fleet.op.register_worker("x0", url=other.url, kv_events=other.kv_events, replay=other.replay or "",
                                       model="other-model", block_size=BLOCK)
        await until(lambda: _ids(fleet), lambda ids: "other-model" in ids)
        status, _, raw = await fleet.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
        assert status == 400 and b"the fleet serves 2 models (other-model, sim-model)" in raw, raw
        assert (await _chat(fleet, model="other-model"))["x-kvfleet-worker"] == "x0"
        assert (await _chat(fleet, model=ALIAS))["x-kvfleet-worker"] == "w0"
    finally:
        await fleet.stop()
        await other.stop()


async def _ids(fleet: Fleet) -> list[str]:
    async with fleet.http.get(fleet.proxy.url + "/v1/models", headers=fleet.headers()) as r:
        return [c["id"] for c in (await r.json())["data"]]
