"""ProxyConfig: everything `kvfleet proxy` configures (flags and env are read in controller/proxy/main.py)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import grpc

from controller.proxy.quarantine import MEDIA_POLICIES, POLICIES
from fleet.core.errors import InvalidArgument
from fleet.sdk.target import target


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Settings of one proxy.

    `token` is the proxy's own bearer token, used only to list the workers (role reader suffices; not needed
    when the controller runs with auth off). With `token_passthrough` each client's own bearer token
    is what the controller sees on Route, so auth and tenancy (cache_salt) stay the controller's.
    """

    controller: str
    listen: str = "127.0.0.1:8000"
    metrics_listen: str | None = None  # HOST:PORT of a listener that serves GET /metrics alone; the listen port then
    # answers /metrics 404 (its series name every worker: operators only, as GET /v1/workers). None: on the listen port
    token: str | None = None
    token_passthrough: bool = True
    tokenizer: str | None = None  # None: each worker's own /tokenize; "hf:PATH": a local HF tokenizer
    worker_api_key: str | None = None  # vLLM's --api-key, sent to the workers (never the client's token)
    first_byte_timeout_s: float = 0.25  # then probe /is_sleeping: a sleeping vLLM accepts and hangs (1.0 until the
    # fleet routing bench showed its wait as the TTFT tail after a sleep behind the router's back: docs/proxy.md)
    first_byte_min_s: float = 0.05  # the first probe comes after 2x the worker's recent p90 first-byte wait, within
    # [first_byte_min_s, first_byte_timeout_s] (controller/proxy/watch.py FirstBytes; docs/proxy.md)
    probe_timeout_s: float = 0.5
    max_first_byte_wait_s: float = 600.0  # an attempt with no first byte by then ends in a 504 if a probe found the
    # worker awake (working on it), else fails over: the bound on a worker that holds the connection but never
    # answers (set it above the longest non-streaming answer, which sends no byte until it is complete)
    connect_timeout_s: float = 2.0
    route_timeout_s: float = 2.0
    tokenize_timeout_s: float = 5.0
    refresh_s: float = 1.0  # worker directory poll (ListWorkers)
    ready_stale_s: float = 10.0  # GET /ready answers 503 once the directory's last load is older than this and
    # the refreshes since failed (or it never loaded): a proxy that cannot see the fleet leaves the Service
    models_refresh_s: float = 15.0  # each worker's /v1/models (LoRA cards)
    suspect_s: float = 5.0  # a worker found asleep behind the controller's back is skipped this long
    suspect_after_failures: int = 3  # .. and so is one with this many failed attempts in a row (503s, lost
    # connections) while its probe says it is awake (one such failure is a blip, not a reason to refuse traffic)
    auth_cache_s: float = 5.0
    auth_refused_s: float = 2.0  # a token the controller refused is answered 401 by the proxy this long (no WhoAmI;
    # controller/proxy/refused.py). 0: every request asks the controller
    max_body_bytes: int = 8 << 20
    # request-body bytes of the requests in flight (from their headers until their answers end), per tenant and
    # in all; a tenant gets at most half of what the others leave (controller/proxy/bodies.py)
    max_inflight_bytes_per_tenant: int = 64 << 20
    max_inflight_bytes: int = 128 << 20
    fair_priority: bool = False  # each request's vLLM priority = its tenant's requests in flight on that worker
    client_header_timeout_s: float = 30.0  # a connection must deliver a request's headers within this (also
    # the idle keep-alive limit): a client that trickles headers (slowloris) is closed
    client_body_timeout_s: float = 60.0  # the whole body must arrive within this, else 408
    quarantine_policy: str = "placeholder"  # what a quarantined tool result gets: placeholder | refuse | off
    quarantine_tenant_policies: tuple[tuple[str, str], ...] = ()  # (tenant, policy) overrides
    tool_media: str = "pass"  # a tool result's media parts (not inspectable as text): pass | withhold | refuse
    # CORS, as vLLM's own server answers it (its --allowed-origins, --allow-credentials, --allowed-methods,
    # --allowed-headers, same defaults): a browser client that calls vLLM directly works through the proxy.
    # No origins: no CORS headers and no preflight answers (controller/proxy/middleware.py)
    allowed_origins: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    tokenize_cache_size: int = 4096  # entries, and at most tokenize_cache_bytes of ids (controller/proxy/token_cache.py)
    tokenize_cache_bytes: int = 64 << 20
    controller_max_rpcs: int = 50  # RPCs open at once on the proxy's one connection to the controller; more wait
    # (at most route_timeout_s). Keep it well under the controller's --grpc-max-concurrent-streams (100): past
    # that the controller refuses streams and the clients get 503s (docs/proxy.md)
    shutdown_delay_s: float = 5.0  # after SIGTERM /ready answers 503 and the proxy still accepts this long, so load
    # balancers and kube-proxy stop sending it new connections before it stops listening (docs/proxy.md)
    shutdown_drain_s: float = 300.0  # then requests in flight (streams included) get this long to end; the rest are cut
    tls: bool = False  # TLS to the controller (implied by any tls_* file below)
    tls_ca: str | None = None  # CA that signed the controller's certificate (None: system roots)
    tls_client_cert: str | None = None  # mutual TLS: the proxy's certificate and key
    tls_client_key: str | None = None
    tls_check_s: float = 10.0  # how often the TLS files are looked at for a renewal (ControlClient.watch_tls)

    def __post_init__(self) -> None:
        for name in ("controller", "listen", "metrics_listen"):
            value = getattr(self, name)
            if value is None:
                continue
            port = value.rsplit(":", 1)[-1] if ":" in value else ""
            # NOTE: only the colon was checked: --listen 127.0.0.1:99999 listened on 34463 (99999 - 65536), and
            # 127.0.0.1:abc failed naming no flag (found by review)
            if not port.isdigit() or int(port) > 65535:
                flag = "--" + name.replace("_", "-")
                raise InvalidArgument(f"{flag} {value!r} must be HOST:PORT, the port 0-65535")
        try:  # NOTE: --controller 127.0.0.1:0 was taken, and the proxy ran knowing no worker, forever (found by review)
            target(self.controller)
        except InvalidArgument as e:
            raise InvalidArgument(f"--controller: {e}") from None
        if self.metrics_listen is not None and self.metrics_listen == self.listen and self.port != 0:
            raise InvalidArgument(f"--metrics-listen {self.metrics_listen!r} must differ from --listen: the metrics "
                                  "get a listener of their own")
        if self.tokenizer is not None and not self.tokenizer.startswith("hf:"):
            raise InvalidArgument(f"--tokenizer {self.tokenizer!r}: use hf:PATH (a local Hugging Face tokenizer)")
        if min(self.first_byte_timeout_s, self.first_byte_min_s, self.probe_timeout_s, self.max_first_byte_wait_s,
               self.connect_timeout_s, self.refresh_s, self.ready_stale_s, self.client_header_timeout_s,
               self.client_body_timeout_s) <= 0:
            raise InvalidArgument("proxy timeouts and intervals must be positive")
        if min(self.shutdown_delay_s, self.shutdown_drain_s) < 0:
            raise InvalidArgument("--shutdown-delay and --shutdown-drain must be >= 0")
        if self.auth_refused_s < 0:
            raise InvalidArgument(f"auth_refused_s {self.auth_refused_s!r} must be >= 0 (0: refusals are not kept)")
        if self.max_body_bytes <= 0 or min(self.tokenize_cache_size, self.tokenize_cache_bytes) < 0 \
                or self.controller_max_rpcs <= 0 or self.suspect_after_failures <= 0:
            raise InvalidArgument("max_body_bytes, controller_max_rpcs and suspect_after_failures must be positive, "
                                  "the tokenize cache's bounds >= 0")
        if not self.max_body_bytes <= min(self.max_inflight_bytes_per_tenant, self.max_inflight_bytes // 2):
            raise InvalidArgument(
                f"--max-body-bytes {self.max_body_bytes} must fit one tenant's share of the bodies in flight: at "
                f"most --max-inflight-bytes-per-tenant ({self.max_inflight_bytes_per_tenant}) and half of "
                f"--max-inflight-bytes ({self.max_inflight_bytes})")
        for who, policy in (("--quarantine-policy", self.quarantine_policy),
                            *((f"--quarantine-tenant-policy {t}=", p) for t, p in self.quarantine_tenant_policies)):
            if policy not in POLICIES:
                raise InvalidArgument(f"{who}{policy!r}: expected placeholder, refuse or off")
        if self.tool_media not in MEDIA_POLICIES:
            raise InvalidArgument(f"--tool-media {self.tool_media!r}: expected pass, withhold or refuse")
        if bool(self.tls_client_cert) != bool(self.tls_client_key):
            raise InvalidArgument("mutual TLS needs both --tls-cert and --tls-key (the proxy's own, PEM)")

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The channel credentials to the controller, read from the files now: None for plaintext. InvalidArgument
        for a file that is not PEM, a CA that does not load, or a key that does not match its certificate (a renewal
        caught half-written)."""
        from fleet.sdk.base import credentials

        if self.tls_ca:
            try:
                ssl.create_default_context(cafile=self.tls_ca)  # a whole CA (a half-written one is not PEM enough)
            except (ssl.SSLError, OSError) as e:
                raise InvalidArgument(f"--tls-ca {self.tls_ca} does not load ({e})") from None
        if self.tls_client_cert and self.tls_client_key:
            try:
                ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(self.tls_client_cert, self.tls_client_key)
            except (ssl.SSLError, OSError) as e:
                raise InvalidArgument(f"--tls-key {self.tls_client_key} does not load with --tls-cert "
                                      f"{self.tls_client_cert} ({e})") from None
        return credentials(self.tls, self.tls_ca, self.tls_client_cert, self.tls_client_key)

    def tls_files(self) -> tuple[str, ...]:
        """The TLS files the proxy reads (its client certificate and key, the CA): watched for renewals."""
        return tuple(f for f in (self.tls_client_cert, self.tls_client_key, self.tls_ca) if f)

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """(host, port) of the metrics listener; None: /metrics is served on the listen port."""
        if self.metrics_listen is None:
            return None
        host, port = self.metrics_listen.rsplit(":", 1)
        return host, int(port)
