"""The proxy apps' shared wiring: the middleware that turns every failure into an OpenAI-style error body, and the
CORS answers of every route (controller/proxy/app.py builds the apps)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import aiohttp_cors
from aiohttp import web

from controller.proxy.errors import ProxyError, error_response, from_fleet
from controller.proxy.reading import too_large
from controller.proxy.relay import PREPARED
from fleet.core.errors import KvfleetError

if TYPE_CHECKING:
    from controller.proxy.config import ProxyConfig
    from controller.proxy.server import Proxy

log = logging.getLogger("kvfleet.proxy")


def add_cors(app: web.Application, cfg: ProxyConfig) -> None:
    """Every route answers CORS preflights and carries CORS headers for `cfg.allowed_origins`, as vLLM's server
    does (every response header exposed, so a browser reads x-kvfleet-quarantined too)."""
    if not cfg.allowed_origins:
        return
    opts = aiohttp_cors.ResourceOptions(  # type: ignore[no-untyped-call]  # the library ships no annotations here
        allow_credentials=cfg.allow_credentials, expose_headers="*",
        allow_headers="*" if "*" in cfg.allowed_headers else cfg.allowed_headers,
        allow_methods="*" if "*" in cfg.allowed_methods else cfg.allowed_methods)
    cors = aiohttp_cors.setup(app, defaults={origin: opts for origin in cfg.allowed_origins})
    for route in list(app.router.routes()):
        cors.add(route)


def error_middleware(proxy: Proxy) -> Any:
    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(req)  # type: ignore[no-any-return]
        except ProxyError as e:
            err = e
        except ConnectionResetError as e:
            if req.transport is not None and not req.transport.is_closing():
                raise
            # NOTE: the client went away and a write failed before aiohttp cancelled the handler; nothing can be
            # answered, and it is not the proxy's error (relay counted it in kvfleet_proxy_client_disconnects)
            log.info("proxy: %s %s: the client went away (%s)", req.method, req.path, e)
            return web.Response(status=499, reason="Client Closed Request")
        except KvfleetError as e:
            err = from_fleet(e, proxy.cfg.controller)
        except web.HTTPRequestEntityTooLarge:
            err = ProxyError(413, too_large(proxy.cfg.max_body_bytes))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            # NOTE: the text an exception was raised with says why (aiohttp_cors: "CORS preflight request failed: origin
            # 'https://x' is not allowed"); only the reason went out, "Forbidden: OPTIONS /v1/models" (found by
            # scripts/fuzz_proxy.py). aiohttp's own exceptions carry "404: Not Found" there, which says no more.
            why = "" if e.text in (None, f"{e.status}: {e.reason}") else f" ({e.text})"
            err = ProxyError(e.status, f"{e.reason}: {req.method} {req.path}{why}")
        except Exception as e:  # the proxy stays up; the client gets a 500 it can report
            log.exception("proxy: %s %s failed", req.method, req.path)
            if req.get(PREPARED):
                raise  # NOTE: its answer is under way: a response of its own went into that body; aiohttp closes it
            err = ProxyError(500, f"internal proxy error ({type(e).__name__}); the proxy logged it")
        proxy.metrics.errors.labels(str(err.status)).inc()
        resp = error_response(err.status, err.message, err.param, err.err_type)
        if err.status == 408:
            # NOTE: the rest of a stalled body would never come; do not wait for it. The answer's keep-alive off
            # alone was not enough: aiohttp then read the unread body for its lingering time (10 s) before it
            # closed the connection, so a stalled client held its socket that long after the 408 (review finding).
            # Written here, then the connection closed (what is written is still flushed), nothing lingers.
            resp.force_close()
            await resp.prepare(req)
            await resp.write_eof()
            if req.protocol is not None:
                req.protocol.force_close()
        return resp

    return middleware
