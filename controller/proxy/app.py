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
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp_cors
from aiohttp import HttpVersion11, web

from controller.batch_route import within
from controller.proxy import lineage, passthrough, prefill, responses
from controller.proxy.batch_prompts import ROUTE_TOKENS, batch_ids
from controller.proxy.errors import ProxyError, error_response, from_fleet
from controller.proxy.reading import announced_size, client_salt, read_json, too_large, upstream_headers
from controller.proxy.relay import PREPARED, relay
from controller.proxy.tokenize import EncodedBody
from fleet.core.errors import KvfleetError, Unauthenticated

if TYPE_CHECKING:
    from controller.proxy.config import ProxyConfig
    from controller.proxy.forward import Target
    from controller.proxy.quarantine import Hit
    from controller.proxy.server import Proxy

log = logging.getLogger("kvfleet.proxy")
MAX_LISTED_BYTES = 2048  # of a header listing what was withheld; the body's `kvfleet` field lists it all
CHAT, COMPLETION, BY_LOAD = "chat", "completion", "by_load"  # the kinds of routed request (Handlers._complete)
# NOTE: vLLM's routes that the proxy forwards routed by load alone (COLD): their prompts are not a chat or a
# completion prompt it can tokenize as the worker does, and /v1/responses' prompt is mostly the conversation a
# `previous_response_id` names, which only the worker that stored it holds (docs/proxy.md, "Endpoints")
BY_LOAD_PATHS = ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank",
                 "/classify", "/v1/responses")


def _listed(headers: dict[str, str], name: str, items: list[str]) -> None:
    """`name`: the items, comma-separated, as many as fit MAX_LISTED_BYTES; `name`-count: how many there are.
    NOTE: unbounded, 130 withheld results made a header over aiohttp's 8,190-byte limit (the client could not
    read the answer at all) and 1,100 one over http.client's 65,536."""
    shown: list[str] = []
    size = 0
    for item in items:
        size += len(item) + (1 if shown else 0)
        if size > MAX_LISTED_BYTES:
            break
        shown.append(item)
    headers[name] = ",".join(shown)
    headers[f"{name}-count"] = str(len(items))


def build_app(proxy: Proxy) -> web.Application:
    app = web.Application(client_max_size=proxy.cfg.max_body_bytes, middlewares=[_errors(proxy)])
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
    _cors(app, proxy.cfg)
    return app


def build_metrics_app(proxy: Proxy) -> web.Application:
    """The --metrics-listen listener's app: GET /metrics and nothing else.
    NOTE: the series name every worker and count every tenant's requests, which the tenant-facing port served to
    anyone who could reach it, with no token, while GET /v1/workers refused tenants (found by review)."""
    app = web.Application(middlewares=[_errors(proxy)])
    app.router.add_get("/metrics", Handlers(proxy).metrics)
    return app


def _cors(app: web.Application, cfg: ProxyConfig) -> None:
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


def _errors(proxy: Proxy) -> Any:
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
            err = ProxyError(e.status, f"{e.reason}: {req.method} {req.path}")
        except Exception as e:  # the proxy stays up; the client gets a 500 it can report
            log.exception("proxy: %s %s failed", req.method, req.path)
            if req.get(PREPARED):
                raise  # NOTE: its answer is under way: a response of its own went into that body; aiohttp closes it
            err = ProxyError(500, f"internal proxy error ({type(e).__name__}); the proxy logged it")
        proxy.metrics.errors.labels(str(err.status)).inc()
        resp = error_response(err.status, err.message, err.param)
        if err.status == 408:
            resp.force_close()  # NOTE: the rest of a stalled body would never come; do not wait for it
        return resp

    return middleware


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
        return token.strip()

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
        return await self._complete(req, COMPLETION)

    async def chat(self, req: web.Request) -> web.StreamResponse:
        return await self._complete(req, CHAT)

    async def by_load(self, req: web.Request) -> web.StreamResponse:
        return await self._complete(req, BY_LOAD)

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
            return await self._answer(req, kind, t0, token, tenant, shrink)

    async def _tokens(self, body: dict[str, Any], kind: str, base: str, tenant: str, token: str | None,
                      path: str = "") -> tuple[dict[str, Any], list[Hit], EncodedBody, Sequence[int], list[Sequence[int]]]:
        """(the body to forward, what was withheld of it, its encoder, the ids to route it by, a batched completions
        request's later prompts' ids). A request routed by load alone has no ids; of those, a /v1/responses request's
        tool outputs are judged (responses.judged)."""
        if kind == BY_LOAD:
            hits: list[Hit] = []
            if path == "/v1/responses":
                body, hits = await responses.judged(self.p, body, tenant, token)
            return body, hits, EncodedBody(body), [], []
        chat = kind == CHAT
        # NOTE: before tokenizing: what is tokenized, routed and forwarded is the body without quarantined bytes
        body, hits = await self.p.enforcer.enforce(body, chat, tenant, token)
        # NOTE: the ids the worker keeps under truncate_prompt_tokens, which /tokenize does not apply
        k = prefill.kept(body, chat, lambda: self.p.directory.max_model_len(body["model"]))
        enc = EncodedBody(body)  # NOTE: the messages (or prompt) are encoded once, for /tokenize and the worker
        ids = await self.p.tokenizer.token_ids(body, chat, base, tenant, enc)
        tok = self.p.tokenizer
        later = await batch_ids(tok.ids_of, tok.batch_lanes, body, chat, base, tenant)  # each truncated as the first
        ids, later = prefill.prefilled(ids, body, k), [prefill.prefilled(b, body, k) for b in later]
        return body, hits, enc, ids, later[:within(len(ids), later, ROUTE_TOKENS)]  # batch_prompts.ROUTE_TOKENS

    async def _answer(self, req: web.Request, kind: str, t0: float, token: str | None, tenant: str,
                      shrink: Callable[[int], None]) -> web.StreamResponse:
        p = self.p
        body = await read_json(req, p.cfg.client_body_timeout_s)
        shrink(len(await req.read()))  # NOTE: a chunked body reserved --max-body-bytes until its size was known
        base, lora, body["model"] = p.directory.resolve(body.get("model"))  # a missing model is named, as vLLM does
        salt = client_salt(body)  # the client's own (400 where vLLM refuses it), before any worker is asked
        body, hits, enc, ids, later = await self._tokens(body, kind, base, tenant, token, req.path)
        responses_api = req.path == "/v1/responses"
        # NOTE: before any route: a follow-up whose stored conversation holds a result quarantined since is a 409
        chain = await lineage.follow_up(p, body, tenant, token) if responses_api else None
        d = await p.control.route(ids, base, lora=lora, token=token, client_salt=salt, batch=later)
        p.directory.watch.routed(body["model"], {c.worker for c in d.candidates})  # (watch.py: waiters it left out)
        to = d  # where it is sent first (a stored response's holder)
        num_prompt = len(ids) + sum(map(len, later))
        del ids, later  # NOTE: about 9x the body's bytes (Python ints); an answer may stream for minutes
        try:
            if responses_api and (prev := responses.valid_id(body.get("previous_response_id"))):
                # NOTE: inside the try: a client gone during the lookup still releases the route
                to = await responses.to_holder(p, d, tenant, prev, base, upstream_headers(req))
            fwd = (
                {**body, "cache_salt": d.cache_salt} if d.cache_salt else body
            )  # NOTE: the controller's salt always wins: the tenant's, or its derivation with the client's own
            fair = p.fair.claim(tenant, to.worker) if p.fair is not None else contextlib.nullcontext(None)
            with fair as priority:  # the tenant's place in the worker's queue, not the client's (controller/proxy/fair.py)
                if p.fair is not None:
                    fwd = p.fair.body(fwd, priority)
                on = [d.worker]  # where the controller's ledger has the route now

                async def moved(t: Target) -> bool:  # skipped or failed over: the controller's ledger and shadow follow
                    if not d.route_id or t.worker == on[0]:  # NOTE: told before the send, not at the first byte:
                        return True  # the block-pool shadow must know what the worker runs before the next turn's route
                    rank = next((c.dp_rank for c in d.candidates if c.worker == t.worker), p.directory.first_rank(t.worker))
                    if not await p.control.move(d.route_id, t.worker, rank, token):
                        return False  # not serving now
                    on[0] = t.worker
                    return True

                opened = await p.forwarder.open(req.path, enc.encode(fwd), to, base, upstream_headers(req), moved,
                                                 body["model"])
                if p.fair is not None and priority and await p.fair.refused(opened):
                    opened.resp.close()   # a worker without the priority policy: the same request without one
                    fwd = p.fair.body(fwd, None)
                    opened = await p.forwarder.open(req.path, enc.encode(fwd), to, base, upstream_headers(req), moved,
                                                 body["model"])
                t = opened.target
                if responses_api and opened.resp.status == 200 and (rid := responses.response_id(opened.first)):
                    p.responses.pin(tenant, rid, t.worker)
                    if chain is not None:
                        p.lineage.add(tenant, rid, chain)
                extra = {
                    "x-kvfleet-worker": t.worker,
                    "x-kvfleet-verdict": t.verdict,
                    "x-kvfleet-matched-tokens": str(t.matched_tokens),
                    "x-kvfleet-epoch": str(t.epoch),
                    "x-kvfleet-attempts": str(opened.num_sends),
                }
                if refs := list(dict.fromkeys(h.ref for h in hits if h.ref)):
                    _listed(extra, "x-kvfleet-quarantined", refs)
                if media := [h.where for h in hits if h.source == "media"]:
                    _listed(extra, "x-kvfleet-withheld-media", media)
                note = {"quarantined": [h.as_json() for h in hits]} if hits else None
                out, t_first = await relay(req, opened, extra, p.metrics, note)
                self._record(t, opened.resp.status, num_prompt, (t_first - t0) - (opened.t_first - opened.t_sent))
                return out
        finally:  # answered, failed, or the client went away (cancelled): the worker's in-flight load ends
            if d.route_id:
                p.control.release_soon(
                    d.route_id, token, lambda outcome: p.metrics.releases.labels(outcome).inc()
                )

    def _record(self, t: Any, status: int, num_prompt: int, added_s: float) -> None:
        m = self.p.metrics
        m.requests.labels(t.worker, t.verdict, str(status)).inc()
        m.matched_tokens.labels(t.worker, t.verdict).inc(t.matched_tokens)
        m.prompt_tokens.labels(t.worker, t.verdict).inc(num_prompt)
        m.added_latency.labels(t.worker, t.verdict).observe(max(added_s, 0.0))

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
