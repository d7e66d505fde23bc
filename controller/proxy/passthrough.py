"""vLLM's utility routes, sent on to one worker as they are, unrouted: GET /version, POST /tokenize and /detokenize.

They run in vLLM's API server, not in its engine (no KV cache is read or written, no queue slot taken), so the
controller is not asked where to send them and its in-flight ledger does not count them: the proxy sends each to a
serving worker of the request's model (GET /version: of any model), rotated, or to the next one when the first cannot
be reached, and relays the worker's status and JSON answer, read up to MAX_ANSWER_BYTES.
NOTE: not through the Forwarder, whose first-byte watch and /is_sleeping probes are for engine requests: these
answers, in milliseconds, would pull each worker's recent first-byte wait (FirstBytes) down for its completions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import msgspec
from aiohttp import web

from controller.proxy.errors import ProxyError
from controller.proxy.reading import read_json, upstream_headers
from controller.proxy.tokenize import max_answer_bytes
from controller.vllm.http import read_capped
from fleet.sdk.types import WorkerInfo

if TYPE_CHECKING:
    from controller.proxy.server import Proxy

log = logging.getLogger(__name__)
JSON = msgspec.json.Encoder()
MAX_TRIES = 2  # the worker chosen, then one other
SENT_ON = ("/tokenize", "/detokenize")  # POST, with the request's model


async def version(p: Proxy) -> web.Response:
    """GET /version: a serving worker's answer (any worker's when none is serving)."""
    ws = p.directory.serving_workers(None) or sorted(p.directory.workers.values(), key=lambda w: w.name)
    if not ws:
        raise ProxyError(503, "no registered worker to ask for its version")
    return await _relay(p, "GET", "/version", ws, None, {})


async def tokens(p: Proxy, req: web.Request, shrink: Callable[[int], None]) -> web.Response:
    """POST /tokenize or /detokenize: to a serving worker of the request's model, the body as sent (its model named
    as the proxy resolves it)."""
    body = await read_json(req, p.cfg.client_body_timeout_s)
    shrink(len(await req.read()))
    base, _, body["model"] = p.directory.resolve(body.get("model"))
    # NOTE: of the workers that list the model's id: an adapter loaded on some workers only (or an alias) is vLLM's
    # 404 at the others, and every other /tokenize of it was one (the routed requests go to those that list it)
    ws = p.directory.serving_workers(base, listing=body["model"])
    if not ws:
        raise ProxyError(503, f"no serving worker of model {body['model']!r} to answer {req.path}")
    return await _relay(p, "POST", req.path, ws, JSON.encode(body), upstream_headers(req))


async def _relay(p: Proxy, method: str, path: str, ws: list[WorkerInfo], data: bytes | None,
                 headers: dict[str, str]) -> web.Response:
    timeout = aiohttp.ClientTimeout(total=p.cfg.tokenize_timeout_s, sock_connect=p.cfg.connect_timeout_s)
    limit = max_answer_bytes(p.cfg.max_body_bytes)
    failed: list[str] = []
    for w in ws[:MAX_TRIES]:
        try:
            async with p.http.request(method, w.url.rstrip("/") + path, data=data, headers=headers,
                                      timeout=timeout) as r:
                raw = await read_capped(r, limit)
                if raw is None:
                    log.warning("proxy: %s on worker %s: its answer is over %d bytes", path, w.name, limit)
                    raise ProxyError(502, f"{path}: the worker's answer is over {limit} bytes")
                return web.Response(status=r.status, body=bytes(raw), content_type=r.content_type,
                                    headers={"x-kvfleet-worker": w.name})
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            failed.append(f"{w.name}: {type(e).__name__}: {e}")
    # NOTE: the client is told what failed, not the workers' names, addresses or errors (the log has them)
    log.warning("proxy: %s: no worker answered (%s)", path, "; ".join(failed))
    raise ProxyError(503, f"{path}: no worker answered ({len(failed)} tried); retry shortly")
