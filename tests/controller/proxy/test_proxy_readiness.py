"""The proxy's /ready (readiness) and /health (liveness) against a controller that refuses its token, goes away,
or was never there; and what the proxy says to do in each case. Real controller and proxy on loopback.

Found by review: /health answered ok while the proxy could list no workers, so the chart's readiness probe kept
it in the Service with a dead controller; and every listing error said "give it a reader (or operator) token",
a refused connection too. Before the fix this test failed at its first /ready (404: no such path).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
from support.controller import make_tokens, start_controller, store_url
from support.proxy_fleet import until

from controller.proxy import Proxy, ProxyConfig
from fleet.app.redis_server import free_port


async def _get(http: aiohttp.ClientSession, proxy: Proxy, path: str) -> tuple[int, dict[str, Any]]:
    async with http.get(proxy.url + path) as r:
        return r.status, json.loads(await r.read())


async def _proxy(controller: str, token: str | None) -> Proxy:
    cfg = ProxyConfig(controller=controller, listen="127.0.0.1:0", token=token, refresh_s=0.1, ready_stale_s=0.5)
    return await Proxy(cfg).start()


async def test_ready_fails_while_the_proxy_cannot_see_the_fleet_and_says_why(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, start_router=True)
    proxies = [await _proxy(ctl.address, tok.op), await _proxy(ctl.address, tok.a),
               await _proxy(f"127.0.0.1:{free_port()}", tok.op)]
    good, tenant_token, nowhere = proxies
    try:
        async with aiohttp.ClientSession() as http:
            assert await _get(http, good, "/ready") == (200, {"ready": True, "reason": None})  # control
            # a token the controller refuses for ListWorkers: the token is the fix, and the message says so
            status, body = await _get(http, tenant_token, "/ready")
            print("tenant token:", body["reason"])
            assert status == 503 and "operator or reader role" in body["reason"] and "--token" in body["reason"]
            # no controller at the address: named unreachable, no word of tokens
            status, body = await _get(http, nowhere, "/ready")
            print("nothing there:", body["reason"])
            assert status == 503 and f"the controller at {nowhere.cfg.controller} is unreachable" in body["reason"]
            assert "token" not in body["reason"]
            # the controller goes away: ready until ready_stale_s after the last listing, then 503; /health stays
            # 200 (liveness: a restart would not bring the controller back)
            await ctl.stop(0)
            status, body = await until(lambda: _get(http, good, "/ready"), lambda sb: sb[0] == 503, timeout=10)
            print("controller gone:", body["reason"])
            assert "last listed the workers" in body["reason"] and "unreachable" in body["reason"]
            assert "token" not in body["reason"]
            for p in proxies:
                status, health = await _get(http, p, "/health")
                assert status == 200 and health["status"] == "ok" and health["directory_error"]
    finally:
        for p in proxies:
            await p.stop()
        await ctl.stop(0)
