"""Proxy: one running proxy (in-process for tests, or under `kvfleet proxy`).

    proxy = await Proxy(ProxyConfig(controller="127.0.0.1:50051", listen="127.0.0.1:0")).start()
    ...  # OpenAI clients talk to proxy.url
    await proxy.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
from aiohttp import web

from controller.proxy.app import build_app, build_metrics_app
from controller.proxy.bodies import BodyGate
from controller.proxy.config import ProxyConfig
from controller.proxy.control import ControlClient
from controller.proxy.directory import WorkerDirectory
from controller.proxy.fair import FairPriority
from controller.proxy.forward import Forwarder
from controller.proxy.http_log import HTTP_LOG
from controller.proxy.lineage import Lineage
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.quarantine import Enforcer
from controller.proxy.responses import ResponsePins
from controller.proxy.tokenize import Tokenizer
from controller.tls_reload import file_stamp

WORKER_KEEPALIVE_S = 4.0  # an idle connection to a worker is closed after this: under vLLM's own 5 s (see start)
CUT_GRACE_S = 1.0  # the most aiohttp's cleanup then waits for a request it cancels (twice: before and after its cancel)


class Proxy:
    """Controller link, worker directory, tokenizer, forwarder, metrics and the HTTP server."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.metrics = ProxyMetrics()
        self.bodies = BodyGate(cfg)
        self.metrics.in_flight = lambda: (self.bodies.total_open, self.bodies.total_bytes)
        self.fair = FairPriority() if cfg.fair_priority else None
        self.responses = ResponsePins()  # which worker stored each /v1/responses answer (controller/proxy/responses.py)
        self.lineage = Lineage()  # the tool results each one's conversation carries (controller/proxy/lineage.py)
        stamp = file_stamp(cfg.tls_files())  # NOTE: before the files are read: a renewal in between is seen
        self.control = ControlClient(cfg.controller, timeout_s=cfg.route_timeout_s, auth_cache_s=cfg.auth_cache_s,
                                     auth_refused_s=cfg.auth_refused_s, credentials=cfg.credentials(),
                                     max_rpcs=cfg.controller_max_rpcs, own_token=cfg.token)
        if cfg.tls_files():
            self.control.watch_tls(cfg.tls_files(), cfg.credentials, stamp, cfg.tls_check_s)
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None  # --metrics-listen's listener (None: /metrics on port)
        self.port = 0
        self.metrics_port = 0  # the metrics listener's port, once started (0: none)
        self.stopping = False  # set by shut_down: /ready answers 503 from then on
        self._handling: set[asyncio.Task[Any]] = set()  # the tasks running a request's handler (a stream: until
        # its last byte)
        self._idle = asyncio.Event()
        self._idle.set()

    async def start(self) -> Proxy:
        # NOTE: no pool limit (the default 100 would queue the 101st concurrent stream); no decompression,
        # so the bytes relayed are the worker's bytes.
        key = self.cfg.worker_api_key
        # NOTE: idle connections to workers are closed after WORKER_KEEPALIVE_S, before vLLM's API server closes
        # them (uvicorn's keep-alive, VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default): with aiohttp's 15 s a send
        # could meet the worker's close on a connection idle for 5 s, and failed (the Forwarder now sends such a
        # one again on a fresh connection; this keeps it rare)
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=WORKER_KEEPALIVE_S),
                                          auto_decompress=False,
                                          headers={"Authorization": f"Bearer {key}"} if key else None)
        # a send that the worker's closing of its connection cut off is sent once more on a new connection
        self.fresh_http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                                auto_decompress=False, headers=self.http.headers)
        await self.control.start()
        self.directory = WorkerDirectory(self.cfg, self.control, self.http, on_gone=self._forget_worker,
                                         on_listed=self.metrics.keep_workers)
        self.tokenizer = Tokenizer(self.cfg, self.directory, self.http)
        self.forwarder = Forwarder(self.cfg, self.directory, self.http, self.metrics, self.fresh_http)
        self.enforcer = Enforcer(self.cfg.quarantine_policy, dict(self.cfg.quarantine_tenant_policies), self.control,
                                 self.metrics, self.cfg.tool_media)
        try:
            await self._serve()
        except BaseException:
            await self.stop()  # NOTE: a failed start (no tokenizer, port taken) left the HTTP session open
            raise
        return self

    async def _serve(self) -> None:
        await self.tokenizer.start()
        await self.directory.start()
        # handler_cancellation: a client that goes away cancels its handler, which closes the upstream request
        # NOTE: aiohttp arms keepalive_timeout when a connection opens and after each answer, and closes the
        # connection if a request's headers are not complete by then: our header-read deadline (slowloris)
        # NOTE: auto_decompress off: a compressed body is refused (app.py `announced_size`), never inflated unreserved
        # NOTE: stop() drains the requests in flight itself (shutdown_drain_s) and cancels the rest; aiohttp's
        # shutdown_timeout is only the grace it then gives them (its default, 60 s, was the drain, and waited twice:
        # a stream's handler outlives aiohttp's first cancel, of the request's body only)
        app = build_app(self)
        app.middlewares.insert(0, _counted(self))
        # NOTE: logger: a request aiohttp's parser refuses is one warning, not an error with a traceback (http_log.py)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     keepalive_timeout=self.cfg.client_header_timeout_s, auto_decompress=False,
                                     shutdown_timeout=CUT_GRACE_S, logger=HTTP_LOG)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await self._serve_metrics()

    async def _serve_metrics(self) -> None:
        """--metrics-listen: a second listener on this event loop that serves GET /metrics alone."""
        where = self.cfg.metrics_address
        if where is None:
            return
        self._metrics_runner = web.AppRunner(build_metrics_app(self), access_log=None,
                                             keepalive_timeout=self.cfg.client_header_timeout_s, logger=HTTP_LOG)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, *where)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _forget_worker(self, name: str) -> None:
        """The directory dropped `name` (unregistered): its metric series and first-byte waits go."""
        self.metrics.forget_worker(name)
        self.forwarder.first_bytes.forget(name)
        self.responses.forget_worker(name)

    async def shut_down(self) -> None:
        """A graceful stop (SIGTERM): /ready answers 503 at once while the proxy keeps accepting for
        shutdown_delay_s, so whatever routes to it (kube-proxy, an ingress, a load balancer probing /ready)
        stops sending it new connections first; then it stops listening and gives the requests in flight
        shutdown_drain_s to end (stop)."""
        self.stopping = True
        await asyncio.sleep(self.cfg.shutdown_delay_s)
        await self.stop()

    async def stop(self) -> None:
        """Stop listening, wait up to shutdown_drain_s for the requests in flight (then cancel them), close."""
        if self._runner is not None:
            await self._drain(self._runner)
            await self._runner.cleanup()
        if self._metrics_runner is not None:  # NOTE: after the drain: scrapes go on while the requests end
            await self._metrics_runner.cleanup()
        await self.directory.stop()
        self.tokenizer.close()
        await self.http.close()
        await self.fresh_http.close()
        await self.control.close()

    async def _drain(self, runner: web.AppRunner) -> None:
        """Close the listener and the idle keep-alive connections (a busy one closes after its answer), then wait
        up to shutdown_drain_s for the requests in flight to end."""
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            runner.server.pre_shutdown()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self.cfg.shutdown_drain_s)
        for task in self._handling:
            task.cancel()  # past the drain: cut (handler_cancellation closes each upstream request)

    @property
    def num_inflight(self) -> int:
        return len(self._handling)

    def _enter(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._handling.add(task)
            self._idle.clear()

    def _exit(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._handling.discard(task)
        if not self._handling:
            self._idle.set()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Where GET /metrics is served: the metrics listener's, else the main port's."""
        where = self.cfg.metrics_address
        return self.url if where is None else f"http://{where[0]}:{self.metrics_port}"


def _counted(proxy: Proxy) -> Any:
    """The outermost middleware: counts the requests in flight, for stop()'s drain."""
    @web.middleware
    async def middleware(req: web.Request, handler: Any) -> web.StreamResponse:
        task = asyncio.current_task()
        proxy._enter(task)
        try:
            return await handler(req)  # type: ignore[no-any-return]
        finally:
            proxy._exit(task)

    return middleware
