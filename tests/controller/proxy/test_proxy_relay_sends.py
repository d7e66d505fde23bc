"""A relayed answer leaves the proxy in as few sends as its bytes allow: the status line and headers go with the
first body bytes, not in a send of their own (one send and one wake-up of the client fewer per answer; the
numbers are in controller/proxy/relay.py's _Relayed)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from support.http_stub import serving
from support.proxy_fleet import MODEL, Fleet

from controller.proxy.forward import Opened, Target
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.relay import relay

NOTE = {"quarantined": [{"ref": "ab" * 32}]}
HELD_S = 1.0
TCPI_DATA_SEGS_IN = 152  # struct tcp_info: u32 tcpi_data_segs_in (Linux >= 4.6): segments that carried data


def _data_segments_in(sock: socket.socket) -> int:
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("I", info, TCPI_DATA_SEGS_IN)[0])


async def _exchange(fleet: Fleet, body: dict[str, object]) -> tuple[bytes, int]:
    """One HTTP/1.1 request on a fresh connection to the proxy: (the whole answer, the data segments it came in).
    NOTE: on loopback each send of the proxy (TCP_NODELAY, far under the MSS) arrives as one data segment."""
    u = urlsplit(fleet.proxy.url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    sock = writer.get_extra_info("socket")
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Authorization: {fleet.headers()['Authorization']}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode()
    writer.write(head + data)
    raw = await asyncio.wait_for(reader.read(), 10)  # Connection: close: read to the end
    n = _data_segments_in(sock)
    writer.close()
    return raw, n


async def test_headers_leave_with_the_first_bytes(fleet: Fleet) -> None:
    raw, segments = await _exchange(fleet, {"model": MODEL, "prompt": "Count the trucks.", "max_tokens": 8})
    head, _, body = raw.partition(b"\r\n\r\n")
    print(f"a non-streamed answer of {len(raw)} bytes reached the client in {segments} data segment(s)")
    assert head.startswith(b"HTTP/1.1 200") and b"x-kvfleet-worker" in head.lower()
    assert b'"choices"' in body  # control: the worker's whole answer came through
    assert segments == 1  # before: 2 (the headers alone at prepare(), then the body)


async def test_headers_go_at_once_when_the_first_event_is_held_back() -> None:
    """The one case where the first write has no bytes: a noted stream whose first event is not complete yet (the
    noter holds it back). The client still gets the status and headers at once, not with the event's end."""
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'

    async def worker(req: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(req)
        await out.write(usage[:20])  # an event begun, not ended
        await asyncio.sleep(HELD_S)
        await out.write(usage[20:] + b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def proxy(req: web.Request) -> web.StreamResponse:
        r = await http.post(worker_url + "/v1/completions")
        first = await r.content.readany()
        opened = Opened(Target("w0", worker_url, "COLD", 0, 0), r, first, 0.0, 0.0, 1, ())
        out, _ = await relay(req, opened, {"x-kvfleet-worker": "w0"}, ProxyMetrics(), NOTE)
        return out

    w_app, p_app = web.Application(), web.Application()
    w_app.router.add_post("/v1/completions", worker)
    p_app.router.add_post("/v1/completions", proxy)
    async with serving(w_app) as worker_url, serving(p_app) as proxy_url, aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        async with http.post(proxy_url + "/v1/completions") as r:
            headers_s = time.monotonic() - t0
            raw = await r.read()
        print(f"headers after {headers_s:.3f}s; the held event's end came {HELD_S}s after its start")
        assert r.headers["x-kvfleet-worker"] == "w0" and headers_s < HELD_S / 2
        assert json.loads(raw.split(b"\n\n")[0][len(b"data: "):])["kvfleet"] == NOTE  # control: the event was noted
