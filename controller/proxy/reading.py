"""Reading a client's request: its announced size, its JSON body, and the headers a worker gets of it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from aiohttp import web

from controller.proxy.errors import ProxyError
from controller.proxy.forward import FORWARDED
from fleet.core.lax import stream_of

BODY = msgspec.json.Decoder()  # NOTE: msgspec, not json: about 2x faster on a conversation (docs/proxy.md)


def announced_size(req: web.Request, limit: int) -> int:
    """The bytes the request's body may hold: its Content-Length (413 past `limit`), or `limit` when it is sent
    chunked (aiohttp stops reading it there). A compressed body is refused (415): the proxy reads bodies as sent
    (NOTE: aiohttp decompressed them by default, so a gzip body of 7 KiB held 7 MiB against a 7 KiB reservation),
    and vLLM reads no compressed body either."""
    encoding = req.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ProxyError(415, f"request bodies must not be compressed (Content-Encoding: {encoding}); send JSON "
                              "as is")
    if req.content_length is None:
        return limit
    if req.content_length > limit:
        raise ProxyError(413, too_large(limit, req.content_length))
    return req.content_length


def too_large(limit: int, size: int | None = None) -> str:
    """The 413's message. NOTE: it named the limit only; a client could not tell what to change (found by a new
    user's OpenAI-client run)."""
    of = f" of {size} bytes" if size is not None else ""
    return (f"request body{of} is larger than the proxy's limit of {limit} bytes: send a smaller one (a long "
            "conversation: fewer or shorter messages), or ask the proxy's operator to raise --max-body-bytes")


async def read_json(req: web.Request, timeout_s: float) -> dict[str, Any]:
    """The request's JSON object (its size checked by `announced_size`, then by aiohttp as it arrives); 408 if
    it takes longer than `timeout_s` to arrive, 400 if it is not a JSON object with a model."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await req.read()
    except TimeoutError:
        raise ProxyError(408, f"the request body did not arrive within {timeout_s}s (the proxy's "
                              "client body timeout); send it at once") from None
    try:
        body = BODY.decode(json_text(raw))  # RFC 8259: NaN, Infinity and numbers past a double's range are refused
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise ProxyError(400, f"request body is not valid JSON: {_why(raw, e)}") from None
    except RecursionError:
        raise ProxyError(400, "request body is nested too deeply to parse (arrays/objects within each "
                              "other, ~1000 levels)") from None
    if not isinstance(body, dict):
        raise ProxyError(400, "request body must be a JSON object")
    # NOTE: vLLM takes a missing, null or empty model (its one served model: `if not model_name` in its check) and a
    # null stream (false); all were 400 here (an empty model until a review found it)
    model = body.get("model")
    if model == "":
        body["model"] = model = None
    if model is not None and not isinstance(model, str):
        raise ProxyError(400, "'model' must be a model id from GET /v1/models (or left out: the fleet's one model)",
                         "model")
    if "stream" in body:
        try:
            body["stream"] = stream_of(body)   # the worker gets a JSON bool, as vLLM's request model holds it
        except ValueError as e:
            raise ProxyError(400, str(e), "stream") from None
    return body


def _why(raw: bytes, e: Exception) -> str:
    """What is wrong with a body the decoder refused: its own words, but for a lone surrogate escape near the end
    (`"\\ud800"}`), which msgspec calls "Input data was truncated" of a whole body. NOTE: the client was told its body
    was cut short (found by scripts/fuzz_proxy.py). Python's reader takes such an escape, so a body it reads whole
    that msgspec calls truncated holds one (read only here, on the way to the 400)."""
    if str(e) != "Input data was truncated":
        return str(e)
    try:
        json.loads(json_text(raw))
    except (ValueError, RecursionError):
        return str(e)
    return ("a lone UTF-16 surrogate escape (one of \\ud800-\\udfff without its pair) is not Unicode text; escape "
            "each character outside the Basic Multilingual Plane as its surrogate pair")


def json_text(raw: bytes) -> bytes | str:
    """A JSON body as vLLM's server reads it (json.loads on the bytes): UTF-8 as it is; a UTF-8 byte order mark, or
    UTF-16 or UTF-32 (with a mark or without), decoded by the encoding json.detect_encoding finds in its first bytes.
    NOTE: a body starting with a UTF-8 BOM (some Windows tools write one) was the proxy's 400 "invalid character
    (byte 0)", where vLLM answers it (found by review). The worker gets it re-encoded, as UTF-8 without the mark."""
    enc = json.detect_encoding(raw)
    return raw if enc == "utf-8" else raw.decode(enc)


def client_salt(body: dict[str, Any]) -> str | None:
    """The client's own `cache_salt` (a multi-user app's salt per end user), or None; 400 where vLLM refuses it.
    NOTE: the tenant's salt replaced it, so the client's users shared one cache: one user's prompt answered another's
    with its `cached_tokens` counted (found by review). The controller now derives the salt from both."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ProxyError(400, "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def upstream_headers(req: web.Request) -> dict[str, str]:
    """What the worker gets: JSON, the client's tracing and encoding headers (identity unless it asked)."""
    out = {k: req.headers[k] for k in FORWARDED if k in req.headers}
    out.setdefault("Accept-Encoding", "identity")  # relayed bytes must be ones the client accepts
    return {**out, "Content-Type": "application/json"}
