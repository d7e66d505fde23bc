"""What `kvfleet controller` configures (ControllerConfig), checked when it is built, and the --listen check that
`kvfleet up` runs before anything starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from controller.edge import (
    DEFAULT_MAX_BLOB_BYTES_PER_TENANT,
    DEFAULT_MAX_ROUTE_TOKENS,
    DEFAULT_MAX_VERDICTS_PER_TENANT,
    GrpcLimits,
)
from controller.fleet_metrics import DEFAULT_FLEET_METRICS_INTERVAL_S
from controller.judge_lanes import JudgeLimits
from controller.quotas import SessionLimits
from controller.store_gc import DEFAULT_GC_INTERVAL_S, DEFAULT_VERDICT_TTL_S, GcConfig
from controller.store_probe import DEFAULT_STORE_PING_INTERVAL_S
from controller.uploads import UploadLimits
from fleet.core.errors import InvalidArgument
from fleet.core.quarantine.detector_config import DetectorConfig, default_layers
from workers.placement import NODE_KV_BYTES, NODE_MAX_SESSIONS


def listen_error(listen: str) -> str | None:
    """Why `listen` is not an address the controller can listen on (HOST:PORT, the port 0-65535), or None. Also
    `kvfleet up`'s check of --listen before anything starts."""
    port = listen.rsplit(":", 1)[-1]
    if ":" not in listen or not port.isdigit() or int(port) > 65535 or listen != listen.strip():
        return f"{listen!r} must be HOST:PORT with a port in 0-65535, e.g. 0.0.0.0:50051"
    return None


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Everything `kvfleet controller` configures. tokens_file=None turns auth off (one machine only)."""

    listen: str = "127.0.0.1:50051"
    store_url: str = "sqlite:///./var/kvfleet.db"
    tokens_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: mutual TLS, every client shows a certificate this CA signed
    max_blob_bytes: int = 64 << 20
    max_route_tokens: int = DEFAULT_MAX_ROUTE_TOKENS
    max_blob_bytes_per_tenant: int = DEFAULT_MAX_BLOB_BYTES_PER_TENANT  # stored blob bytes per tenant, 0: no quota
    # cached verdicts and quarantine records per tenant, 0: no bound (--max-verdicts-per-tenant)
    max_verdicts_per_tenant: int = DEFAULT_MAX_VERDICTS_PER_TENANT
    uploads: UploadLimits = field(default_factory=UploadLimits)
    grpc_limits: GrpcLimits = field(default_factory=GrpcLimits)
    sessions: SessionLimits = field(default_factory=SessionLimits)  # per-tenant session quotas, idle TTL
    node_kv_bytes: int = NODE_KV_BYTES  # KV budget of one Ray node of the session fleet (--node-kv-bytes)
    node_max_sessions: int = NODE_MAX_SESSIONS  # sessions one node's kernel host holds (--node-max-sessions)
    salt_secret: bytes | None = None  # None: generated once and kept in the store
    ray_address: str | None = None  # accepted and kept for the kernel hosts
    leader_election: bool = False
    leader_ttl_s: float = 10.0
    start_router: bool = True
    store_threads: int = 4
    gc_interval_s: float = DEFAULT_GC_INTERVAL_S  # the leader's store GC schedule (0: off)
    verdict_ttl_s: float = DEFAULT_VERDICT_TTL_S  # a cached verdict idle this long is pruned (--verdict-ttl)
    store_ping_interval_s: float = DEFAULT_STORE_PING_INTERVAL_S  # the store probe's schedule (0: off)
    fleet_metrics_interval_s: float = DEFAULT_FLEET_METRICS_INTERVAL_S  # kernel-fleet metrics poll (0: off)
    kernel: dict[str, Any] = field(default_factory=dict)  # --kernel-* backend/device/groups (kernel_placement.py)
    # the Judge's detector layers (--detector-layers; default: the default layers installed here)
    detector_layers: tuple[str, ...] = field(default_factory=default_layers)
    detector_encoder_gate: float | None = None  # the encoder's gate on the learned score (--detector-encoder-gate)
    # the encoder's gate on each window's word pieces (--detector-encoder-max-fragmentation)
    detector_encoder_max_fragmentation: float | None = None
    detector_tenants: tuple[tuple[str, DetectorConfig], ...] = ()  # per-tenant detectors (--detector-tenant)
    judge: JudgeLimits = field(default_factory=JudgeLimits)  # judge pool and per-tenant lanes (--judge-*)

    def __post_init__(self) -> None:
        if (why := listen_error(self.listen)) is not None:
            raise InvalidArgument(f"--listen {why}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidArgument("TLS needs both --tls-cert and --tls-key (PEM files)")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidArgument("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")
        if self.max_route_tokens <= 0:
            raise InvalidArgument(f"--max-route-tokens must be positive, got {self.max_route_tokens}")
        if self.max_blob_bytes <= 0:
            raise InvalidArgument(f"max_blob_bytes must be positive, got {self.max_blob_bytes}")
        if self.max_blob_bytes_per_tenant < 0:
            raise InvalidArgument(f"--max-blob-bytes-per-tenant must be >= 0 (0: no quota), "
                                  f"got {self.max_blob_bytes_per_tenant}")
        if isinstance(self.max_verdicts_per_tenant, bool) or not isinstance(self.max_verdicts_per_tenant, int) \
                or self.max_verdicts_per_tenant < 0:
            raise InvalidArgument(f"--max-verdicts-per-tenant must be an int >= 0 (0: no bound), "
                                  f"got {self.max_verdicts_per_tenant!r}")
        GcConfig(self.gc_interval_s, self.verdict_ttl_s)  # raises InvalidArgument on a bad interval or TTL
        if not 0 <= self.store_ping_interval_s < float("inf"):
            raise InvalidArgument(f"--store-probe-interval (store_ping_interval_s) must be finite and >= 0 (0: off), "
                                  f"got {self.store_ping_interval_s}")
