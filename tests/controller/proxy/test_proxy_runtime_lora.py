"""LoRA adapters loaded and unloaded at runtime (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, with
VLLM_ALLOW_RUNTIME_LORA_UPDATING) are routed as the workers serve them.

NOTE: before, the controller read each worker's adapters once, at registration (watcher.discover): an adapter
loaded later was listed by the proxy's /v1/models but every request for it got the controller's 404 for good,
and an unloaded one kept being routed to the worker (found by review).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from support.proxy_fleet import MODEL, Fleet, start_fleet, until

from controller import router as router_module
from fleet.core.errors import NotFound

ADAPTER = {"lora_name": "sql-lora", "lora_path": "/adapters/sql"}
BODY = {"model": "sql-lora", "prompt": "SELECT name FROM users", "max_tokens": 2}


async def _call(fleet: Fleet, worker: str, verb: str, body: dict[str, Any]) -> tuple[int, str]:
    async with fleet.http.post(f"{fleet.sims[worker].url}/v1/{verb}_lora_adapter", json=body) as r:
        return r.status, await r.text()


async def _listed(fleet: Fleet) -> list[str]:
    async with fleet.http.get(fleet.proxy.url + "/v1/models", headers=fleet.headers()) as r:
        return [c["id"] for c in (await r.json())["data"]]


def _models_gets(fleet: Fleet) -> dict[str, int]:
    return {n: sum(s.path == "/v1/models" for s in sim.seen) for n, sim in fleet.sims.items()}  # type: ignore[attr-defined]


async def test_an_adapter_loaded_at_runtime_is_routed_from_its_first_request(tmp_path: Path) -> None:
    # NOTE: the periodic look (lora_refresh_s) never comes here: the first request's NotFound makes the workers look
    fleet = await start_fleet(tmp_path, num_workers=2, models_refresh_s=0.2, router_kw={"lora_refresh_s": 3600.0},
                              engine_kw={"runtime_lora": True, "served_model_names": (MODEL, "sim-alias")})
    router = fleet.ctl.ctx.need_router()
    try:
        assert await _call(fleet, "w0", "load", ADAPTER) == (200, "Success: LoRA adapter 'sql-lora' added successfully.")
        await until(lambda: _listed(fleet), lambda ids: "sql-lora" in ids)
        for i in range(4):  # NOTE: several, so that tokenizing would also be asked of w1 (which 404s the adapter)
            status, h, raw = await fleet.post("/v1/completions", {**BODY, "prompt": f"SELECT {i}"})
            assert status == 200, raw  # before: the controller's 404, for good
            assert h["x-kvfleet-worker"] == "w0" and json.loads(raw)["model"] == "sql-lora"  # the one that loaded it
        assert not [s for s in fleet.sims["w1"].seen if s.path == "/tokenize"]  # type: ignore[attr-defined]
        # an alias (a card with parent null) is no adapter; before: {"sim-alias": "sim-model"} on both
        assert (router.worker("w0").loras, router.worker("w1").loras) == ({"sql-lora": "/adapters/sql"}, {})
    finally:
        await fleet.stop()


async def test_tokenize_and_detokenize_of_an_adapter_go_to_the_workers_that_serve_it(tmp_path: Path) -> None:
    """NOTE: /tokenize and /detokenize were sent to any serving worker of the base model, rotated: with the adapter
    on w0 only, every other one got w1's 404 ("The model `sql-lora` does not exist."), where the routed requests
    for it were all served (found by review)."""
    fleet = await start_fleet(tmp_path, num_workers=2, models_refresh_s=0.2, engine_kw={"runtime_lora": True})
    try:
        assert (await _call(fleet, "w0", "load", ADAPTER))[0] == 200
        await until(lambda: _listed(fleet), lambda ids: "sql-lora" in ids)
        for path, body in (("/tokenize", {"model": "sql-lora", "prompt": "SELECT 1"}),
                           ("/detokenize", {"model": "sql-lora", "tokens": [101, 102]})):
            seen = [await fleet.post(path, body) for _ in range(4)]
            assert [(status, h["x-kvfleet-worker"]) for status, h, _ in seen] == [(200, "w0")] * 4, (path, seen)
        # control: the base model's are still spread over both workers
        seen = [await fleet.post("/tokenize", {"model": MODEL, "prompt": "SELECT 1"}) for _ in range(4)]
        assert {status for status, _, _ in seen} == {200} and {h["x-kvfleet-worker"] for _, h, _ in seen} == {"w0", "w1"}
    finally:
        await fleet.stop()


async def test_a_failover_of_an_adapter_request_skips_the_workers_without_it(tmp_path: Path) -> None:
    """NOTE: a request failed over to any other worker of the base model: with the adapter on w0 only and w0 asleep
    behind the controller's back, it was sent to w1, whose 404 ("The model `sql-lora` does not exist.") reached the
    client, an error the OpenAI SDKs do not retry (found by review). Now the 503 of a fleet short of a worker."""
    fleet = await start_fleet(tmp_path, num_workers=2, models_refresh_s=0.2, reconcile_s=30.0,
                              engine_kw={"runtime_lora": True})
    try:
        assert (await _call(fleet, "w0", "load", ADAPTER))[0] == 200
        await until(lambda: _listed(fleet), lambda ids: "sql-lora" in ids)
        status, h, _ = await fleet.post("/v1/completions", BODY)
        assert (status, h["x-kvfleet-worker"]) == (200, "w0")
        async with fleet.http.post(fleet.sims["w0"].url + "/sleep?level=1") as r:  # unseen by the controller (30 s)
            assert r.status == 200
        status, h, raw = await fleet.post("/v1/completions", {**BODY, "prompt": "SELECT 2"})
        assert status == 503 and "Retry-After" in h, (status, raw)  # before: w1's 404
        assert not [s for s in fleet.sims["w1"].received.prompts() if s.startswith("SELECT ")]
        # control: the base model's request fails over to w1 as before
        status, h, _ = await fleet.post("/v1/completions", {**BODY, "model": MODEL})
        assert (status, h["x-kvfleet-worker"]) == (200, "w1")
    finally:
        await fleet.stop()


async def test_an_unloaded_adapter_stops_being_routed_within_the_refresh(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=2, reconcile_s=0.1, router_kw={"lora_refresh_s": 0.5},
                              loras={"sql-lora": "/adapters/sql"}, engine_kw={"runtime_lora": True})
    router = fleet.ctl.ctx.need_router()
    try:
        assert (await _call(fleet, "w0", "unload", {"lora_name": "sql-lora"}))[0] == 200
        await until(_now(lambda: router.worker("w0").loras), lambda loras: loras == {})  # before: never
        seen = [await fleet.post("/v1/completions", {**BODY, "prompt": f"SELECT {i}"}) for i in range(6)]
        assert [(status, h.get("x-kvfleet-worker")) for status, h, _ in seen] == [(200, "w1")] * 6, seen
        assert not [s for s in fleet.sims["w0"].received.prompts() if s.startswith("SELECT ")]
        # control: the other worker's adapter, never unloaded, stays listed
        assert router.worker("w1").loras == {"sql-lora": "/adapters/sql"}
    finally:
        await fleet.stop()


async def test_routes_for_an_unknown_adapter_look_again_at_most_once_per_gap_per_worker(tmp_path: Path) -> None:
    """The cost bound: a flood of routes for an adapter no worker has asks each worker's /v1/models at most once per
    controller.router.LORA_MISS_LOOK_S (the proxy's own look and the periodic one are out of the way here)."""
    fleet = await start_fleet(tmp_path, num_workers=2, models_refresh_s=3600.0, router_kw={"lora_refresh_s": 3600.0})
    try:
        before, t0 = _models_gets(fleet), time.monotonic()
        for _ in range(4):  # 4 waves of 20 routes at once, each wave as soon as the one before is answered
            results = await asyncio.gather(*(fleet.op.route([1, 2, 3], model=MODEL, lora="nope") for _ in range(20)),
                                           return_exceptions=True)
            assert all(isinstance(e, NotFound) for e in results), results
        elapsed = time.monotonic() - t0
        looks = {n: k - before[n] for n, k in _models_gets(fleet).items()}
        print(f"80 routes for an unknown adapter in {elapsed:.2f} s; each worker's /v1/models looks: {looks}")
        assert all(k >= 1 for k in looks.values()), looks  # before: 0 (never asked again)
        bound = int(elapsed / router_module.LORA_MISS_LOOK_S) + 1
        assert all(k <= bound for k in looks.values()), (looks, bound)
    finally:
        await fleet.stop()


def _now(read: Any) -> Any:
    async def value() -> Any:
        return read()
    return value
