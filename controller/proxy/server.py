"""Proxy: one running proxy (in-process for tests, or under `kvfleet proxy`).

    proxy = await Proxy(ProxyConfig(controller="127.0.0.1:50051", listen="127.0.0.1:0")).start()
    ...  # OpenAI clients talk to proxy.url
    await proxy.stop()
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from controller.proxy.app import build_app
from controller.proxy.bodies import BodyGate
from controller.proxy.config import ProxyConfig
from controller.proxy.control import ControlClient
from controller.proxy.directory import WorkerDirectory
from controller.proxy.fair import FairPriority
from controller.proxy.forward import Forwarder
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.quarantine import Enforcer
from controller.proxy.tokenize import Tokenizer

WORKER_KEEPALIVE_S = 4.0  # an idle connection to a worker is closed after this: under vLLM's own 5 s (see start)


class Proxy:
    """Controller link, worker directory, tokenizer, forwarder, metrics and the HTTP server."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.metrics = ProxyMetrics()
        self.bodies = BodyGate(cfg)
        self.fair = FairPriority() if cfg.fair_priority else None
        self.control = ControlClient(cfg.controller, timeout_s=cfg.route_timeout_s, auth_cache_s=cfg.auth_cache_s,
                                     credentials=cfg.credentials(), max_rpcs=cfg.controller_max_rpcs)
        self._runner: web.AppRunner | None = None
        self.port = 0

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
        self.directory = WorkerDirectory(self.cfg, self.control, self.http, on_gone=self._forget_worker)
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
        self._runner = web.AppRunner(build_app(self), access_log=None, handler_cancellation=True,
                                     keepalive_timeout=self.cfg.client_header_timeout_s, auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def _forget_worker(self, name: str) -> None:
        """The directory dropped `name` (unregistered): its metric series and first-byte waits go."""
        self.metrics.forget_worker(name)
        self.forwarder.first_bytes.forget(name)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.directory.stop()
        await self.http.close()
        await self.fresh_http.close()
        await self.control.close()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"
