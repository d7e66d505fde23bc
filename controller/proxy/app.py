"""The proxy's aiohttp app: OpenAI-compatible routes in front of the vLLM workers.

POST /v1/completions, /v1/chat/completions   tokenize as the worker would -> Route (client's token)
                                             -> forward with the tenant's cache_salt -> relay bytes
POST BY_LOAD_PATHS (embeddings, pooling, score, rerank, classify, responses)   the same, routed by load alone
                                             (no ids to match: COLD); a /v1/responses request's tool outputs judged
POST /tokenize, /detokenize, GET /version    sent on to a serving worker, unrouted (controller/proxy/passthrough.py)
GET /v1/responses/{id}, POST /v1/responses/{id}/cancel   to the worker that stored the response; a /v1/responses
                                             follow-up (`previous_response_id`) goes there too (controller/proxy/responses.py)
GET  /v1/models    the union of the registered workers' model cards
GET  /v1/workers   the fleet as the controller lists it (operator tokens only)
GET  /health (liveness), /ready (readiness: 503 while the proxy cannot see the fleet, and from SIGTERM on), /metrics
                   (with --metrics-listen: only on that listener, build_metrics_app; here a 404)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import HttpVersion11, web

from controller.proxy import passthrough, responses, routed
from controller.proxy.errors import ProxyError, error_response, from_fleet
from controller.proxy.middleware import add_cors, error_middleware
from controller.proxy.reading import announced_size
from fleet.core.errors import KvfleetError, Unauthenticated

if TYPE_CHECKING:
    from controller.proxy.server import Proxy

# NOTE: vLLM's routes that the proxy forwards routed by load alone (COLD): their prompts are not a chat or a
# completion prompt it can tokenize as the worker does, and /v1/responses' prompt is mostly the conversation a
# `previous_response_id` names, which only the worker that stored it holds (docs/proxy.md, "Endpoints")
# the longest bearer token sent on to the controller: a kvfleet token is 47 characters (controller/auth.py), and the
# gRPC metadata that carries it is bounded at 8 KiB in all
MAX_TOKEN_CHARS = 4096
BY_LOAD_PATHS = ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                 "/classify", "/v1/responses")


def build_app(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=proxy.cfg.max_body_bytes, middlewares=[error_middleware(proxy)])
    h = Handlers(proxy)
    app.router.add_post("/v1/completions", h.completions, expect_handler=h.expect)
    app.router.add_post("/v1/chat/completions", h.chat, expect_handler=h.expect)
    for path in BY_LOAD_PATHS:
        app.router.add_post(path, h.by_load, expect_handler=h.expect)
    for path in passthrough.SENT_ON:
        app.router.add_post(path, h.tokens, expect_handler=h.expect)
    app.router.add_get("/version", h.version)
    app.router.add_get("/v1/responses/{response_id}", h.stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", h.stored_response, expect_handler=h.expect)
    app.router.add_get("/v1/models", h.models)
    app.router.add_get("/v1/workers", h.workers)
    app.router.add_get("/health", h.health)
    app.router.add_get("/ready", h.ready)
    if proxy.cfg.metrics_listen is None:  # else only on the metrics listener (build_metrics_app): a 404 here
        app.router.add_get("/metrics", h.metrics)
    add_cors(app, proxy.cfg)
    return app


def build_metrics_app(proxy: Proxy) -> web.Application:
    """The --metrics-listen listener's app: GET /metrics and nothing else.
    NOTE: the series name every worker and count every tenant's requests, which the tenant-facing port served to
    anyone who could reach it, with no token, while GET /v1/workers refused tenants (found by review)."""
    app = web.Application(middlewares=[error_middleware(proxy)])
    app.router.add_get("/metrics", Handlers(proxy).metrics)
    return app


class Handlers:
    def __init__(self, proxy: Proxy) -> None:
        self.p = proxy

    def _token(self, req: web.Request) -> str | None:
        """The bearer token the controller should see: the client's (passthrough) or the proxy's own."""
        if not self.p.cfg.token_passthrough:
            return self.p.cfg.token
        value = req.headers.get("Authorization")
        if value is None:
            return None
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ProxyError(401, "malformed Authorization header: expected 'Bearer <token>'")
        token = token.strip()
        if len(token) > MAX_TOKEN_CHARS:
            # NOTE: sent on as gRPC metadata, a token near 8 KiB passed aiohttp's header limit and broke the gRPC
            # channel's (8 KiB of metadata): RESOURCE_EXHAUSTED, a 429 with Retry-After naming gRPC's internals, which
            # a client retries for ever (found by scripts/fuzz_proxy.py)
            raise ProxyError(401, f"malformed Authorization header: the bearer token is {len(token)} characters, "
                                  f"more than any kvfleet token (at most {MAX_TOKEN_CHARS})")
        if not (token.isascii() and token.isprintable()):
            # NOTE: it goes to the controller as gRPC metadata, which is printable ASCII: a byte past it (\xe9) was a
            # UnicodeEncodeError there, the proxy's 500 with a traceback (found by scripts/fuzz_proxy.py)
            raise ProxyError(401, "malformed Authorization header: the bearer token must be printable ASCII (a "
                                  "kvfleet token is)")
        return token

    @contextlib.contextmanager
    def _asked(self, token: str | None) -> Iterator[None]:
        """Around a controller call made with the client's `token`: a client that sent no Authorization header is told
        to send one. NOTE: its 401 carried the controller's gRPC advice, "send metadata 'authorization: Bearer
        <token>' (FleetClient(token=...) does)", to an HTTP client (found by review)."""
        try:
            yield
        except Unauthenticated as e:
            if token is None and self.p.cfg.token_passthrough:
                raise ProxyError(401, "missing Authorization header: send 'Authorization: Bearer <token>' with your "
                                      "kvfleet token") from e
            raise

    async def expect(self, req: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue`: the client is invited to send its body only once its token and its tenant's
        budget of bodies in flight allow it (aiohttp's default answered 100 to anyone). None: continue."""
        try:
            token = self._token(req)
            with self._asked(token):
                caller = await self.p.control.whoami(token, req.remote)
            self.p.bodies.check(caller.tenant, announced_size(req, self.p.cfg.max_body_bytes))
        except ProxyError as e:
            return error_response(e.status, e.message, e.param)
        except KvfleetError as e:
            err = from_fleet(e, self.p.cfg.controller)
            return error_response(err.status, err.message, err.param)
        if req.version != HttpVersion11 or req.headers.get("Expect", "").lower() != "100-continue":
            return error_response(417, f"unknown Expect: {req.headers.get('Expect')!r}")
        await req.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self._complete(req, routed.COMPLETION)

    async def chat(self, req: web.Request) -> web.StreamResponse:
        return await self._complete(req, routed.CHAT)

    async def by_load(self, req: web.Request) -> web.StreamResponse:
        return await self._complete(req, routed.BY_LOAD)

    async def version(self, req: web.Request) -> web.Response:
        await self._caller(req)
        return await passthrough.version(self.p)

    async def stored_response(self, req: web.Request) -> web.StreamResponse:
        """GET /v1/responses/{id} (a stream resumed with ?stream=true too) and POST /v1/responses/{id}/cancel: to the
        worker that stored the response; vLLM's 404 when no worker holds it."""
        _, tenant = await self._caller(req)
        with self.p.bodies.admit(tenant, announced_size(req, self.p.cfg.max_body_bytes)) as shrink:
            data = await req.read()  # NOTE: a cancel's body, if any, within the tenant's body budget
            shrink(len(data))
            return await responses.send_on(self.p, req, tenant, data)

    async def tokens(self, req: web.Request) -> web.Response:
        """POST /tokenize, /detokenize: the tenant's token and body budget, as for a routed request."""
        _, tenant = await self._caller(req)
        with self.p.bodies.admit(tenant, announced_size(req, self.p.cfg.max_body_bytes)) as shrink:
            return await passthrough.tokens(self.p, req, shrink)

    async def _caller(self, req: web.Request) -> tuple[str | None, str]:
        """(the token the controller sees, its tenant); 401 or 403 here, before the body is read."""
        token = self._token(req)
        with self._asked(token):
            caller = await self.p.control.whoami(token, req.remote)
        return token, caller.tenant

    async def _complete(self, req: web.Request, kind: str) -> web.StreamResponse:
        p, t0 = self.p, time.perf_counter()
        token, tenant = await self._caller(req)  # NOTE: 401 before the body is read (controller/proxy/bodies.py)
        with p.bodies.admit(tenant, announced_size(req, p.cfg.max_body_bytes)) as shrink:  # 429 past budget
            return await routed.answer(p, req, kind, t0, token, tenant, shrink)  # controller/proxy/routed.py

    async def models(self, req: web.Request) -> web.Response:
        token = self._token(req)
        with self._asked(token):
            await self.p.control.whoami(token, req.remote)
        return web.json_response({"object": "list", "data": self.p.directory.models()})

    async def workers(self, req: web.Request) -> web.Response:
        token = self._token(req)
        with self._asked(token):
            ws = await self.p.control.workers(token)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "name": w.name,
                        "url": w.url,
                        "model": w.model,
                        "serving": w.serving,
                        "ranks": [
                            {
                                "dp_rank": r.dp_rank,
                                "epoch": r.epoch,
                                "serving": r.serving,
                                "phase": r.phase,
                                "kv": r.kv,
                            }
                            for r in w.ranks
                        ],
                    }
                    for w in ws
                ],
            }
        )

    async def health(self, req: web.Request) -> web.Response:
        """Liveness: 200 while the proxy answers, whatever the controller's state (`directory_error` says what it
        cannot see); whether to send it traffic is /ready's answer."""
        d, t = self.p.directory, self.p.tokenizer
        return web.json_response(
            {
                "status": "ok",
                "workers": len(d.workers),
                "serving": sum(d.serving(n) for n in d.workers),
                "directory_error": d.last_error,
                "tokenizer": {"local": self.p.cfg.tokenizer, "parity": t.parity},
            }
        )

    async def ready(self, req: web.Request) -> web.Response:
        """Readiness: 503 while the proxy cannot see the fleet (WorkerDirectory.unready says why) or is shutting
        down, else 200."""
        why = "shutting down" if self.p.stopping else self.p.directory.unready()
        return web.json_response({"ready": why is None, "reason": why}, status=503 if why else 200)

    async def metrics(self, req: web.Request) -> web.Response:
        return web.Response(body=self.p.metrics.render(), content_type="text/plain", charset="utf-8")
