"""The request bodies in flight in the proxy are bounded per tenant and in all, and a caller is known before
its body is read (controller/proxy/bodies.py).

NOTE: before, the proxy read every body (up to --max-body-bytes, 8 MiB) before it checked the token, and held
any number of them at once: a client with no valid token could hold 8 MiB per connection for the whole body
timeout, and one tenant's concurrent requests all of the proxy's memory. Both tests fail there: the first
waits out the body timeout for its 401, the second gets no 429.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import MODEL, start_fleet, until


def _now(read: Any) -> Any:
    """`read()` as the awaitable `until` polls."""
    async def value() -> Any:
        return read()
    return value


async def _stalled(port: int, token: str, length: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A request whose headers announce `length` body bytes, of which only the first few are sent."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {token}\r\n"
             f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode() + b'{"model": "')
    await w.drain()
    return r, w


async def _status(r: asyncio.StreamReader, timeout_s: float) -> tuple[int, bytes]:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), timeout_s)
    return int(head.split(b" ", 2)[1]), head


async def test_an_unknown_caller_gets_401_before_its_body_is_read(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, num_workers=1, client_body_timeout_s=20.0)
    try:
        r, w = await _stalled(fleet.proxy.port, "not-a-token", 4 << 20)
        status, _ = await _status(r, 5.0)      # before: the body was awaited first (20 s here), then 408
        w.close()
        print(f"a 4 MiB body announced with a bad token, 100 bytes sent: {status}")
        assert status == 401
        assert fleet.proxy.bodies.total_bytes == 0
    finally:
        await fleet.stop()


async def test_a_tenant_holds_at_most_its_budget_of_bodies_in_flight(tmp_path: Path) -> None:
    kib = 1 << 10
    fleet = await start_fleet(tmp_path, num_workers=1, client_body_timeout_s=20.0, max_body_bytes=200 * kib,
                              max_inflight_bytes_per_tenant=256 * kib, max_inflight_bytes=1 << 20)
    port, gate = fleet.proxy.port, fleet.proxy.bodies
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    try:
        held = [await _stalled(port, fleet.tokens["a"], 100 * kib) for _ in range(2)]
        await until(_now(lambda: gate.reserved["acme"]), lambda n: n >= 200 * kib)   # both have reserved theirs
        r, w = await _stalled(port, fleet.tokens["a"], 100 * kib)
        status, head = await _status(r, 5.0)
        rest = await asyncio.wait_for(r.read(2000), 5.0)
        w.close()
        print(f"acme's third request of 100 KiB beside two held: {status} {rest[-240:]!r}")
        assert status == 429 and b"Retry-After: 1" in head
        assert b"--max-inflight-bytes-per-tenant" in rest
        assert gate.reserved["acme"] == 200 * kib       # the refused one reserved nothing
        # another tenant is served meanwhile, and so is acme's small request within its budget
        b_status, _, _ = await fleet.post("/v1/chat/completions", ok, who="b")
        a_status, _, a_raw = await fleet.post("/v1/chat/completions", ok, who="a")
        assert (b_status, a_status) == (200, 200), a_raw
        # a held request whose client goes away frees its reservation; the same request then fits
        held[0][1].close()
        await until(_now(lambda: gate.reserved["acme"]), lambda n: n <= 100 * kib)
        big = {**ok, "messages": [{"role": "user", "content": "x" * (100 * kib)}]}
        status, _, raw = await fleet.post("/v1/chat/completions", big, who="a")
        assert status == 200, raw
        assert json.loads(raw)["choices"]
    finally:
        for _, w in held:
            w.close()
        await fleet.stop()
    assert gate.total_bytes == 0


async def test_a_compressed_body_is_refused_and_a_chunked_one_holds_its_own_size(tmp_path: Path) -> None:
    """A gzip body used to be inflated by aiohttp past its reservation (7 KiB reserved, 7 MiB held: review
    finding); it is refused (415). A chunked body reserves --max-body-bytes until its size is known, then only
    that (before: the whole answer long, so 8 chunked requests filled a tenant's 64 MiB)."""
    import gzip

    fleet = await start_fleet(tmp_path, num_workers=1, engine_kw={"time_scale": 1.0}, max_body_bytes=200 << 10,
                              max_inflight_bytes_per_tenant=256 << 10, max_inflight_bytes=1 << 20)
    gate, url = fleet.proxy.bodies, fleet.proxy.url + "/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 100}], "max_tokens": 30, "stream": True}
    try:
        raw = json.dumps(body).encode()
        async with fleet.http.post(url, data=gzip.compress(raw), headers={
                **fleet.headers("a"), "Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 415, await r.text()

        async def chunks() -> Any:
            yield raw[:50]
            yield raw[50:]

        async with fleet.http.post(url, data=chunks(), headers={**fleet.headers("a"),
                                                                "Content-Type": "application/json"}) as r:
            first = await r.content.readany()     # its answer streams: its body is read and sized
            held = gate.reserved["acme"]
            await r.read()
        print(f"a chunked body of {len(raw)} bytes holds {held} while its answer runs")
        assert first and held == len(raw)
        assert gate.total_bytes == 0
    finally:
        await fleet.stop()


async def test_expect_100_continue_is_answered_only_for_a_caller_that_may_send(tmp_path: Path) -> None:
    """curl sends `Expect: 100-continue` for large bodies. aiohttp's default answered 100 to anyone, inviting a
    caller with a bad token, or over its budget, to send its whole body (review finding); now the token and the
    budget are checked first."""
    fleet = await start_fleet(tmp_path, num_workers=1, max_body_bytes=200 << 10,
                              max_inflight_bytes_per_tenant=256 << 10, max_inflight_bytes=1 << 20)

    async def first_line(token: str, length: int) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", fleet.proxy.port)
        w.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nAuthorization: Bearer {token}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n\r\n").encode())
        await w.drain()
        line = await asyncio.wait_for(r.readline(), 5.0)
        w.close()
        return line

    try:
        bad, big, ok = (await first_line("not-a-token", 1000), await first_line(fleet.tokens["a"], 300 << 10),
                        await first_line(fleet.tokens["a"], 1000))
        print(f"bad token: {bad!r}; over the budget: {big!r}; allowed: {ok!r}")
        assert bad.startswith(b"HTTP/1.1 401") and big.startswith(b"HTTP/1.1 413")
        assert ok.startswith(b"HTTP/1.1 100")
    finally:
        await fleet.stop()
