"""CORS: the proxy answers a browser's preflight and marks its answers as vLLM's own server does (allowed origins
["*"] by default), so a web client that calls vLLM directly works through the proxy. Before, a preflight got
405 and no answer carried Access-Control-Allow-Origin: the browser refused every call. Real controller,
stand-in workers and proxy on loopback.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.proxy_fleet import start_fleet

from controller.proxy.main import config_from, parse_args

ORIGIN = "https://app.example"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


async def test_a_browser_preflight_and_a_streamed_answer_carry_cors_headers(tmp_path: Path) -> None:
    f = await start_fleet(tmp_path, num_workers=1)
    try:
        async with f.http.options(f.proxy.url + "/v1/chat/completions", headers=PREFLIGHT) as r:
            assert r.status == 200  # before: 405
            assert r.headers["Access-Control-Allow-Origin"] in ("*", ORIGIN)
            assert "POST" in r.headers["Access-Control-Allow-Methods"]
            assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
        body = {"model": (await f.op.workers())[0].model, "stream": True, "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}]}
        async with f.http.post(f.proxy.url + "/v1/chat/completions", json=body,
                               headers={**f.headers(), "Origin": ORIGIN}) as r:
            assert r.status == 200 and b"[DONE]" in await r.read()
            assert r.headers["Access-Control-Allow-Origin"] in ("*", ORIGIN)
            assert r.headers.get("Access-Control-Expose-Headers")  # x-kvfleet-* readable by the page
        async with f.http.get(f.proxy.url + "/v1/models", headers={**f.headers(), "Origin": ORIGIN}) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] in ("*", ORIGIN)
    finally:
        await f.stop()


async def test_origins_named_or_none(tmp_path: Path) -> None:
    f = await start_fleet(tmp_path, num_workers=1, allowed_origins=(ORIGIN,))
    try:
        async with f.http.options(f.proxy.url + "/v1/completions", headers=PREFLIGHT) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == ORIGIN
        other = {**PREFLIGHT, "Origin": "https://elsewhere.example"}
        async with f.http.options(f.proxy.url + "/v1/completions", headers=other) as r:
            assert r.status == 403 and "Access-Control-Allow-Origin" not in r.headers
    finally:
        await f.stop()
    f = await start_fleet(tmp_path / "off", num_workers=1, allowed_origins=())  # the control: CORS off
    try:
        async with f.http.options(f.proxy.url + "/v1/completions", headers=PREFLIGHT) as r:
            assert r.status == 405 and "Access-Control-Allow-Origin" not in r.headers
    finally:
        await f.stop()


def test_cors_flags_take_vllms_json_lists() -> None:
    cfg = config_from(parse_args([], {}))
    assert (cfg.allowed_origins, cfg.allow_credentials, cfg.allowed_methods) == (("*",), False, ("*",))
    cfg = config_from(parse_args(["--allowed-origins", '["https://a.example"]', "--allow-credentials"], {}))
    assert cfg.allowed_origins == ("https://a.example",) and cfg.allow_credentials
    assert config_from(parse_args([], {"KVFLEET_PROXY_ALLOWED_ORIGINS": "[]"})).allowed_origins == ()
    with pytest.raises(SystemExit):
        parse_args(["--allowed-origins", "https://a.example"], {})  # not a JSON list: argparse's clear error
