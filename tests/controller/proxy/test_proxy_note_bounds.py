"""The quarantine note costs the proxy bounded memory whatever a worker sends.

The proxy adds a "kvfleet" note to a stream's usage event (holding back the incomplete event after the last
blank line) and to a JSON answer it reads whole. A worker's stream with no blank line, or a JSON answer of no
stated length or a huge one, used to be held or read whole: now at most MAX_NOTED_BYTES is, and the rest is
relayed as it comes.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from support.http_stub import serving

from controller.proxy.forward import MAX_NOTED_BYTES, _annotatable, _SseNoter

NOTE = {"quarantined": [{"ref": "ab" * 32}]}


def test_a_usage_event_gets_the_note_and_an_endless_event_is_relayed_not_held() -> None:
    sse = _SseNoter(NOTE)
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    out = sse.feed(b'data: {"choices": [{"text": "a"}]}\n\n' + usage[:20]) + sse.feed(usage[20:])
    assert json.loads(out.split(b"\n\n")[1][len(b"data: ") :])["kvfleet"] == NOTE  # control: noted
    blob, sent = b"x" * (1 << 20), b""
    for _ in range(MAX_NOTED_BYTES // len(blob) + 1):
        sent += sse.feed(blob)
    assert sent == blob * (MAX_NOTED_BYTES // len(blob) + 1) and sse.buf == b""  # relayed whole, nothing held
    out = sse.feed(b"\n\n" + usage) + sse.flush()
    assert out.startswith(b"\n\n") and b'"kvfleet"' in out  # the stream goes on, and its usage is still noted


async def _content_length_seen(handler) -> tuple[int | None, bool]:  # type: ignore[no-untyped-def]
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with (
        serving(app) as url,
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json={}) as r,
    ):
        return r.content_length, _annotatable(r)


async def test_only_a_json_answer_of_a_stated_bounded_length_is_read_whole() -> None:
    async def small(_: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    async def huge(_: web.Request) -> web.Response:
        return web.Response(body=b" " * (MAX_NOTED_BYTES + 1) + b"{}", content_type="application/json")

    async def chunked(req: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        out.enable_chunked_encoding()
        await out.prepare(req)
        await out.write(b'{"choices": []}')
        await out.write_eof()
        return out

    assert (await _content_length_seen(small))[1]  # control: vLLM's answers state their length
    n, noted = await _content_length_seen(huge)
    assert n == MAX_NOTED_BYTES + 3 and not noted
    assert await _content_length_seen(chunked) == (None, False)
