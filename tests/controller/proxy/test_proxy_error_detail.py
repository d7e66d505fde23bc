"""The errors the proxy answers itself say what happened without the fleet's insides: no controller address,
no worker name or address, no connection error text. Those go to the proxy's log, where an operator reads them.

Real parts: a controller, a sim-vllm worker and the proxy (support/proxy_fleet.py); a second proxy points at a
port where no controller listens."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import aiohttp
import pytest
from support.proxy_fleet import MODEL, start_fleet

from controller.proxy import Proxy, ProxyConfig

INSIDES = ("127.0.0.1", "localhost", "Error", "errno", "grpc", "ipv4")  # addresses and exception text


def _clean(message: str, *names: str) -> bool:
    return not any(x in message for x in (*INSIDES, *names))


async def test_a_dead_worker_is_not_named_to_clients_but_is_logged(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1)
    try:
        (name, sim), = fleet.sims.items()
        url = sim.url
        await fleet.sims.pop(name).stop()  # the controller still lists it as serving
        port = url.rsplit(":", 1)[1]
        caplog.set_level(logging.WARNING, logger="kvfleet.proxy")
        got = {}
        for what, body in (("ids", {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2}),  # routed, sent
                           ("again", {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 2}),  # skipped
                           ("text", {"model": MODEL, "prompt": "tokenized by the worker", "max_tokens": 2})):
            status, _, raw = await fleet.post("/v1/completions", body, who="b")
            got[what] = (status, json.loads(raw)["error"]["message"])
        print("\n".join(f"{k}: {s} {m}" for k, (s, m) in got.items()))
        assert {s for s, _ in got.values()} == {503}
        assert all(_clean(m, name, port) for _, m in got.values()), got  # before: "w0: connect: ... 127.0.0.1:port"
        assert got["ids"][1].startswith("no serving worker answered") and "unreachable" in got["ids"][1]
        assert "skipped" in got["again"][1] and got["text"][1].startswith("tokenize failed on the model's workers")
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert name in logged and port in logged  # the operator still gets the detail
    finally:
        await fleet.stop()


async def test_an_unreachable_controller_is_not_named_to_clients(caplog: pytest.LogCaptureFixture) -> None:
    with __import__("socket").socket() as s:  # a port where nothing listens
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    proxy = await Proxy(ProxyConfig(controller=nowhere, listen="127.0.0.1:0", route_timeout_s=0.5)).start()
    try:
        caplog.set_level(logging.WARNING, logger="kvfleet.proxy")
        async with aiohttp.ClientSession() as http, http.post(
                proxy.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"},
                headers={"Authorization": "Bearer some-token"}) as r:
            status, message = r.status, (await r.json())["error"]["message"]
        print(f"{status}: {message}")
        assert status == 503 and "the controller is unreachable" in message
        assert _clean(message, nowhere.rsplit(":", 1)[1])  # before: "controller: WhoAmI: the controller at 127..."
        assert nowhere in "\n".join(r.getMessage() for r in caplog.records)
    finally:
        await proxy.stop()
