"""Proxy configurations: no token passthrough (one trusted tenant), and a proxy token that cannot list workers."""

from __future__ import annotations

import json

from support.proxy_fleet import MODEL, Fleet

from controller.proxy import Proxy, ProxyConfig


async def _second_proxy(fleet: Fleet, **kw: object) -> Proxy:
    return await Proxy(ProxyConfig(controller=fleet.ctl.address, listen="127.0.0.1:0", refresh_s=0.2,
                                   **kw)).start()  # type: ignore[arg-type]


async def test_without_passthrough_every_request_is_the_proxys_tenant(fleet: Fleet) -> None:
    proxy = await _second_proxy(fleet, token=fleet.tokens["op"], token_passthrough=False)
    try:
        body = {"model": MODEL, "prompt": "one shared tenant", "max_tokens": 1}
        async with fleet.http.post(proxy.url + "/v1/completions", json=body) as r:  # no Authorization at all
            assert r.status == 200, await r.text()
        async with fleet.http.post(proxy.url + "/v1/completions", json=body,
                                   headers={"Authorization": "Bearer kvf_ignored"}) as r:
            assert r.status == 200  # the client's header is not used in this mode
        # control: the passthrough proxy refuses the same anonymous request
        async with fleet.http.post(fleet.proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 401
    finally:
        await proxy.stop()


async def test_a_proxy_token_without_the_operator_role_is_reported(fleet: Fleet) -> None:
    proxy = await _second_proxy(fleet, token=fleet.tokens["a"])
    try:
        async with fleet.http.get(proxy.url + "/health") as r:
            health = await r.json()
        async with fleet.http.post(proxy.url + "/v1/completions", headers=fleet.headers(),
                                   json={"model": MODEL, "prompt": "hi"}) as r:
            status, err = r.status, json.loads(await r.read())["error"]
        print("health:", health["directory_error"][:80], "| request:", status, err["message"][:100])
        assert health["workers"] == 0 and "operator" in health["directory_error"]  # the role ListWorkers needs
        assert status == 503 and "cannot see the fleet" in err["message"]
    finally:
        await proxy.stop()


async def test_headers_the_worker_gets(fleet: Fleet) -> None:
    from support.proxy_fleet import served

    proxy = await _second_proxy(fleet, token=fleet.tokens["op"], worker_api_key="vllm-key")
    try:
        for url in (fleet.proxy.url, proxy.url):
            async with fleet.http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "trace me"},
                                       headers={**fleet.headers(), "X-Request-Id": "req-42"}) as r:
                assert r.status == 200
                worker = r.headers["x-kvfleet-worker"]
            got = served(fleet.sims[worker], "/v1/completions")[-1].headers
            print(url, {k: got.get(k) for k in ("X-Request-Id", "Accept-Encoding", "Authorization")})
            assert got["X-Request-Id"] == "req-42" and got["Accept-Encoding"] == "gzip, deflate"  # the client's
            assert fleet.tokens["a"] not in str(got)  # the client's bearer token never reaches a worker
            assert got.get("Authorization") == (None if url == fleet.proxy.url else "Bearer vllm-key")
        async with fleet.http.post(proxy.url + "/v1/completions", json={"model": MODEL, "prompt": "no encoding"},
                                   headers=fleet.headers(), skip_auto_headers={"Accept-Encoding"}) as r:
            worker = r.headers["x-kvfleet-worker"]
        assert served(fleet.sims[worker], "/v1/completions")[-1].headers["Accept-Encoding"] == "identity"
    finally:
        await proxy.stop()
