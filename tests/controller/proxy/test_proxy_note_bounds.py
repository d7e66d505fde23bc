"""The quarantine note costs the proxy bounded memory whatever a worker sends.

The proxy adds a "kvfleet" note to a stream's usage event (holding back the incomplete event after the last
blank line) and to a JSON answer it reads whole. A worker's stream with no blank line, or a JSON answer of no
stated length or a huge one, used to be held or read whole: now at most MAX_NOTED_BYTES is, and the rest is
relayed as it comes. A stream without a note is relayed in whole events (an incomplete last one held back, so a
worker that breaks off inside one leaves no part of it for the error event to continue), at most MAX_HELD_BYTES held.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from support.http_stub import serving

from controller.proxy.relay import MAX_HELD_BYTES, MAX_NOTED_BYTES, _annotatable, _SseNoter, _WholeEvents

NOTE = {"quarantined": [{"ref": "ab" * 32}]}


def test_a_usage_event_gets_the_note_and_an_endless_event_is_relayed_not_held() -> None:
    sse = _SseNoter(NOTE)
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
    out = sse.feed(b'data: {"choices": [{"text": "a"}]}\n\n' + usage[:20]) + sse.feed(usage[20:])
    assert json.loads(out.split(b"\n\n")[1][len(b"data: ") :])["kvfleet"] == NOTE  # control: noted
    blob, sent = b"x" * (1 << 20), b""
    for _ in range(MAX_NOTED_BYTES // len(blob) + 1):
        sent += sse.feed(blob)
    assert sent == blob * (MAX_NOTED_BYTES // len(blob) + 1) and sse.size == 0  # relayed whole, nothing held
    out = sse.feed(b"\n\n" + usage) + sse.flush()
    assert out.startswith(b"\n\n") and b'"kvfleet"' in out  # the stream goes on, and its usage is still noted


def test_a_stream_split_anywhere_is_noted_as_if_it_came_whole() -> None:
    # the noter appends chunks without an event's end and joins them once the event completes (before: joined
    # and searched again on every chunk, quadratic in a long event); the end may straddle two chunks
    stream = (b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": {"prompt_tokens": 3}}\n\n'
              b"data: [DONE]\n\n")
    whole = _SseNoter(NOTE)
    expected = whole.feed(stream) + whole.flush()
    assert expected.count(b'"kvfleet"') == 1
    for i in range(len(stream)):
        for j in range(i, min(len(stream), i + 3)):
            sse = _SseNoter(NOTE)
            assert sse.feed(stream[:i]) + sse.feed(stream[i:j]) + sse.feed(stream[j:]) + sse.flush() == expected


def test_a_stream_is_relayed_in_whole_events_however_it_is_split() -> None:
    for end in (b"\n\n", b"\r\n\r\n"):
        stream = end.join([b'data: {"choices": [{"text": "a"}]}', b'data: {"choices": []}', b"data: [DONE]"]) + end
        for i in range(len(stream)):
            for j in range(i, min(len(stream), i + 5)):
                sse = _WholeEvents()
                parts = [sse.feed(stream[:i]), sse.feed(stream[i:j]), sse.feed(stream[j:])]
                assert b"".join(parts) == stream and sse.size == 0  # everything out once the stream is whole
                assert all(not p or p.endswith(end) for p in parts)  # and only whole events on the way
        sse = _WholeEvents()
        assert sse.feed(stream + b"data: {") == stream and sse.flush() == b"data: {"  # the rest only at the end
    sse, blob, sent = _WholeEvents(), b"x\n" * (1 << 16), b""  # an event with no end: relayed, not held for good
    for _ in range(MAX_HELD_BYTES // len(blob) + 1):
        sent += sse.feed(blob)
    assert sent == blob * (MAX_HELD_BYTES // len(blob) + 1) and sse.size == 0


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
