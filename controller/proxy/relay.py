"""Relaying a worker's answer to the client (controller/proxy/forward.py opens it): status, headers and body bytes
as they come; the quarantine note added to a JSON answer or a stream's usage chunk; a broken-off answer ended as
vLLM ends one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from controller.proxy.forward import Opened
from controller.proxy.metrics import ProxyMetrics

log = logging.getLogger("kvfleet.proxy")

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "server", "date", "proxy-authenticate", "upgrade"}
MAX_NOTED_BYTES = 8 << 20  # the most of a worker's answer read whole (or held back) to add the quarantine note
MAX_HELD_BYTES = 1 << 20  # the most of a stream's incomplete last event held back (_WholeEvents)
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # an SSE event ends with a blank line
_EVENT_END = re.compile(rb"(\r\n\r\n|\n\n)")
# request key: the answer's status and headers are out (relay); a web.RequestKey where aiohttp has them (3.12+)
PREPARED: Any = web.RequestKey("kvfleet.prepared", bool) if hasattr(web, "RequestKey") else "kvfleet.prepared"


class _Relayed(web.StreamResponse):
    """A relayed answer whose status line and headers leave with its first body bytes, in one send.

    NOTE: aiohttp's StreamResponse sends them at prepare(), a send of their own (web.Response already waits for
    the body: this is its setting). The relay writes the worker's first bytes right after prepare(), so the client
    gets nothing later, and one send (and one wake-up of the client) fewer per answer: at 200 streaming clients
    (bench/proxy_load.py's setup, py-spy on the proxy) the relay's share of the proxy's CPU went from 7.9% (6.5% of
    it the headers' own send) to 5.3%, and its write syscalls from 11.0 to 9.4 per request (strace -c). Where the
    first write has no bytes to carry them (a stream's first event held back whole by _SseNoter), relay sends them
    alone at once, as before.
    """

    _send_headers_immediately = False


async def relay(request: web.Request, o: Opened, extra: dict[str, str], metrics: ProxyMetrics,
                note: dict[str, Any] | None = None) -> tuple[web.StreamResponse, float]:
    """Relay status, headers and body bytes unchanged as they come (a stream's events whole: _WholeEvents); returns
    (response, t_first_client).

    With `note`, a complete (non-streamed, uncompressed) JSON object answer gets it as its top-level
    "kvfleet" field, and so does a stream's usage chunk (the SSE event whose JSON has a "usage");
    every other byte is relayed unchanged (the headers carry the note too).
    Cancellation (the client went away) closes the upstream connection, which is how vLLM learns
    to abort the request.
    """
    resp = o.resp
    if note is not None and _annotatable(resp):
        return await _relay_noted(request, o, extra, note)
    headers = CIMultiDict((k, v) for k, v in resp.headers.items() if k.lower() not in HOP_HEADERS)
    headers.update(extra)
    out = _Relayed(status=resp.status, reason=resp.reason, headers=headers)
    sse: _SseNoter | _WholeEvents | None = None
    if resp.content_type == "text/event-stream":
        sse = _SseNoter(note) if note is not None else _WholeEvents()
    try:
        await out.prepare(request)
        request[PREPARED] = True  # from here on, an error cannot be a response of its own (app._errors)
        chunk, t_first = o.first, 0.0
        while True:
            data = sse.feed(chunk) if sse else chunk
            # NOTE: a chunk that ends the answer (the worker's end already read) goes out with the end of the
            # response in one write: one send fewer per answer, and a short answer leaves in a single one
            if resp.content.at_eof():
                await out.write_eof(data + sse.flush() if sse else data)
                break
            if data or not t_first:
                await out.write(data)  # NOTE: b"" before the first bytes sends the headers alone (_Relayed)
            t_first = t_first or time.perf_counter()
            chunk = await resp.content.readany()
        t_first = t_first or time.perf_counter()
    except (asyncio.CancelledError, ConnectionResetError):  # the client went away (before a worker's break:
        metrics.cancelled.labels(o.target.worker).inc()  # aiohttp's reset on a write is both)
        resp.close()
        raise
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as e:
        resp.close()
        await _broken(request, out, o, e, metrics)
        return out, t_first or time.perf_counter()
    except BaseException:
        resp.close()
        raise
    resp.release()  # fully read: the keep-alive connection goes back to the pool
    return out, t_first


async def _broken(request: web.Request, out: web.StreamResponse, o: Opened, e: BaseException,
                  metrics: ProxyMetrics) -> None:
    """The worker broke off an answer the client has begun to get. A stream ends with an OpenAI-shaped error
    event and `data: [DONE]`, as vLLM ends a stream that fails (after the last whole event: an incomplete one was
    held back); any other answer's connection is cut at once, so the client sees it short of its announced length.
    NOTE: the error went up to the error middleware, whose fresh 500 response aiohttp wrote into the body
    already under way: the client got a status line inside its stream (curl: illegal chunked encoding) and
    then waited for the keep-alive timeout (30 s)."""
    msg = "the worker broke off its answer; retry the request"  # its name and the error go to the log only
    log.warning("proxy: %s %s: worker %s broke off its answer (%s: %s)", request.method, request.path,
                o.target.worker, type(e).__name__, e)
    metrics.broken.labels(o.target.worker).inc()
    if o.resp.content_type == "text/event-stream":
        event = {"error": {"message": msg, "type": "BadGatewayError", "param": None, "code": 502}}
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
        return
    out.force_close()
    if request.transport is not None:
        request.transport.abort()


async def _relay_noted(request: web.Request, o: Opened, extra: dict[str, str],
                       note: dict[str, Any]) -> tuple[web.StreamResponse, float]:
    raw = _with_note(await _read_rest(o), note)
    o.resp.release()
    headers = CIMultiDict((k, v) for k, v in o.resp.headers.items()
                          if k.lower() not in HOP_HEADERS and k.lower() != "content-length")
    headers.update(extra)
    out = web.Response(status=o.resp.status, reason=o.resp.reason, body=raw, headers=headers)
    return out, time.perf_counter()


class _WholeEvents:
    """A stream's bytes up to the end of its last complete event (a blank line: "\n\n" or "\r\n\r\n"); the incomplete
    event after it is held until it completes (at most `limit` bytes of it: past that, relayed as it comes).

    NOTE: a worker that broke off inside an event had that event's first part relayed, and the error event _broken
    adds was read as its continuation: an OpenAI SDK raised json.JSONDecodeError (not an APIError) where, straight
    from the worker, it raised APIConnectionError. A worker writes whole events, so the first test passes nearly
    always and nothing is held. Linear in the stream: a chunk is searched once, with the held bytes' last 3 (an
    event's end may straddle chunks), and the held bytes are joined only once an event completes.
    """

    def __init__(self, limit: int = MAX_HELD_BYTES) -> None:
        self.limit = limit
        self.held: list[bytes] = []
        self.size = 0
        self._tail = b""  # the held bytes' last 3

    def feed(self, chunk: bytes) -> bytes:
        if not self.held and chunk.endswith(_EVENT_ENDS):
            return chunk
        window = self._tail + chunk
        lf, crlf = window.rfind(b"\n\n"), window.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0) - len(self._tail)  # in `chunk`
        if end <= 0:  # no event ends in this chunk
            if chunk:
                self.held.append(chunk)
                self.size += len(chunk)
                self._tail = window[-3:]
            return self.flush() if self.size > self.limit else b""
        data = b"".join((*self.held, chunk[:end]))
        rest = chunk[end:]
        self.held, self.size, self._tail = ([rest] if rest else []), len(rest), rest[-3:]
        return data + (self.flush() if self.size > self.limit else b"")

    def flush(self) -> bytes:
        rest = b"".join(self.held)
        self.held, self.size, self._tail = [], 0, b""
        return rest


class _SseNoter:
    """Adds `note` as "kvfleet" to a stream's usage chunk (an event with a usage and no choices); passes every other
    event through unchanged.

    NOTE: holds back at most one incomplete event (bytes after the last event's end) until it completes, and
    at most MAX_NOTED_BYTES of it: past that, a worker's stream is relayed as it comes.
    NOTE: it knew only "\n\n" as an event's end: a stream framed with "\r\n\r\n" (SSE allows either; _WholeEvents,
    relaying a stream with nothing withheld, took both) was held whole, up to 8 MiB, whenever a tool result had been
    withheld, so the client got no token until the answer ended, and its usage chunk went without the note.
    """

    def __init__(self, note: dict[str, Any]) -> None:
        self.note = note
        self.events = _WholeEvents(MAX_NOTED_BYTES)

    @property
    def size(self) -> int:
        return self.events.size

    def feed(self, chunk: bytes) -> bytes:
        data = self.events.feed(chunk)
        if b'"usage"' not in data:
            return data
        parts = _EVENT_END.split(data)  # events at even places, their ends between them
        return b"".join(self._event(e) if i % 2 == 0 else e for i, e in enumerate(parts))

    def flush(self) -> bytes:
        return self.events.flush()

    def _event(self, e: bytes) -> bytes:
        if not e.startswith(b"data: {") or b'"usage"' not in e:
            return e
        try:
            doc = json.loads(e[len(b"data: "):])
        except ValueError:
            return e
        # NOTE: the usage chunk is the one with no choices (vLLM's last): with stream_options' continuous_usage_stats
        # every chunk has a usage, and each was re-encoded with the note, the note sent once per token
        if not isinstance(doc, dict) or not doc.get("usage") or doc.get("choices"):
            return e
        return b"data: " + json.dumps({**doc, "kvfleet": self.note}).encode()


def _annotatable(resp: aiohttp.ClientResponse) -> bool:
    """A JSON answer the proxy may read whole to add the note: uncompressed and of a stated length up to
    MAX_NOTED_BYTES (vLLM states it); any other is relayed as it comes, the note in the headers only."""
    n = resp.content_length
    return (resp.content_type == "application/json" and "Content-Encoding" not in resp.headers
            and n is not None and n <= MAX_NOTED_BYTES)


async def _read_rest(o: Opened) -> bytes:
    try:
        return o.first + await o.resp.content.read()
    except BaseException:
        o.resp.close()
        raise


def _with_note(raw: bytes, note: dict[str, Any]) -> bytes:
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    return json.dumps({**doc, "kvfleet": note}).encode() if isinstance(doc, dict) else raw
