"""`kvfleet controller`: run the gRPC controller, or mint a bearer token.

    kvfleet controller --listen 0.0.0.0:50051 --store redis://redis:6379/0 --tokens-file tokens.json
    kvfleet controller --mint-token acme --role tenant --tokens-file tokens.json   # prints the token once

Environment variables are read here and nowhere else (flags win): KVFLEET_LISTEN, KVFLEET_STORE,
KVFLEET_TOKENS_FILE, KVFLEET_METRICS_PORT, KVFLEET_TLS_CERT, KVFLEET_TLS_KEY, KVFLEET_RAY_ADDRESS, KVFLEET_GC_INTERVAL,
KVFLEET_SALT_SECRET (hex; default: generated once and kept in the store), KVFLEET_TLS_CLIENT_CA,
KVFLEET_METRICS_HOST, and KVFLEET_ + each --route-* and --kv-* flag in capitals.

The edge limits (--max-route-tokens, --max-upload*, --upload-idle-timeout, --grpc-*) are in
controller/edge.py and controller/uploads.py; each refusal names the flag that sets it.

The --route-* flags set the placement cost's weights (controller/cost.py, docs/routing.md) and the --kv-*
flags bound each worker's KV-event stream; both are in controller/route_flags.py, and unset ones keep their
dataclass's defaults. The --detector-* flags are in controller/detector_flags.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from controller import ray_local
from controller.auth import mint_token
from controller.config import ControllerConfig
from controller.detector_flags import (
    add_detector_flags,
    detector_layers_from,
    detector_tenants_from,
    encoder_gate_from,
    max_fragmentation_from,
)
from controller.edge import add_edge_flags, edge_config_from
from controller.fleet_metrics import DEFAULT_FLEET_METRICS_INTERVAL_S
from controller.judge_lanes import add_judge_flags, judge_limits_from
from controller.kernel_placement import add_kernel_flags, kernel_overrides_from
from controller.metrics import Metrics
from controller.node_flags import add_node_flags
from controller.quotas import add_session_flags, session_limits_from
from controller.route_flags import (
    STREAM_FLAGS as STREAM_FLAGS,  # re-exported: it lived here before route_flags.py
)
from controller.route_flags import (
    add_cost_flags,
    add_stream_flags,
    cost_config_from,
    env_typed,
    stream_limits_from,
)
from controller.router import RouterConfig
from controller.server import build_server
from controller.servicers.fleet import redact
from controller.store_gc import add_gc_flag
from controller.store_probe import DEFAULT_STORE_PING_INTERVAL_S
from controller.uploads import add_get_flags, with_get_limits
from fleet.core import event_loop
from fleet.core.errors import InvalidArgument, KvfleetError
from fleet.core.quarantine.detector_config import layers_report


def parse_args(argv: list[str], env: Mapping[str, str]) -> argparse.Namespace:
    e = env.get
    p = argparse.ArgumentParser(prog="kvfleet controller", description=__doc__.splitlines()[0])
    p.add_argument(
        "--listen", default=e("KVFLEET_LISTEN", "127.0.0.1:50051"), help="HOST:PORT of the gRPC server"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=e("KVFLEET_METRICS_PORT", "9400"),  # NOTE: a string default is parsed by type=
        help="Prometheus /metrics port (0: any free port; -1: off)",
    )
    p.add_argument(
        "--store",
        default=e("KVFLEET_STORE", "sqlite:///./var/kvfleet.db"),
        help="store URL: sqlite:///PATH (embedded) or redis://HOST:PORT/DB",
    )
    p.add_argument(
        "--tokens-file",
        default=e("KVFLEET_TOKENS_FILE"),
        help="JSON file of hashed bearer tokens; without it auth is OFF (one machine only)",
    )
    p.add_argument(
        "--tls-cert", default=e("KVFLEET_TLS_CERT"), help="PEM certificate (TLS needs --tls-key too)"
    )
    p.add_argument("--tls-key", default=e("KVFLEET_TLS_KEY"), help="PEM private key")
    p.add_argument(
        "--tls-client-ca",
        default=e("KVFLEET_TLS_CLIENT_CA"),
        help="PEM CA: require every client to show a certificate it signed (mutual TLS; needs --tls-cert)",
    )
    p.add_argument(
        "--metrics-host",
        default=e("KVFLEET_METRICS_HOST"),
        help="address /metrics binds (default: the --listen host, so a loopback controller serves metrics on loopback)",
    )
    p.add_argument(
        "--ray-address", default=e("KVFLEET_RAY_ADDRESS"), help="Ray cluster to join (default: local)"
    )
    p.add_argument(
        "--leader-election",
        action="store_true",
        help="serve only while holding the store's leader lock (Redis); a no-op on sqlite",
    )
    p.add_argument(
        "--max-blob-bytes", type=int, default=64 << 20, help="largest blob accepted (default 64 MiB)"
    )
    add_gc_flag(p, env)
    p.add_argument(
        "--store-probe-interval",
        type=env_typed(float, "KVFLEET_STORE_PROBE_INTERVAL"),
        metavar="SECONDS",
        default=e("KVFLEET_STORE_PROBE_INTERVAL", str(DEFAULT_STORE_PING_INTERVAL_S)),
        help="seconds between two pings of the store, which set kvfleet_store_up and the gRPC health of "
        f"kvfleet.Store; 0: off (default {DEFAULT_STORE_PING_INTERVAL_S:g}; env KVFLEET_STORE_PROBE_INTERVAL; "
        "docs/metrics.md)",
    )
    p.add_argument(
        "--fleet-metrics-interval",
        type=float,
        default=DEFAULT_FLEET_METRICS_INTERVAL_S,
        help="seconds between two polls of the kernel fleet for its Prometheus metrics; 0: off "
        f"(default {DEFAULT_FLEET_METRICS_INTERVAL_S:.0f})",
    )
    add_detector_flags(p, env)
    add_cost_flags(p, env)
    p.add_argument(
        "--reset-drain-timeout",
        type=float,
        metavar="SECONDS",
        default=e("KVFLEET_RESET_DRAIN_TIMEOUT", "5"),  # NOTE: argparse parses a string default with type=float
        help="a reset_prefix_cache verb that vLLM refuses while requests hold blocks is asked again, the worker "
        "taking no new requests meanwhile, for up to this long, and a pause with mode=wait waits this much longer than "
        "the HTTP timeout for vLLM to finish its requests (default 5, under the SDK's 10 s call deadline; 0 asks once; env "
        "KVFLEET_RESET_DRAIN_TIMEOUT; docs/lifecycle.md)",
    )
    add_stream_flags(p, env)
    add_kernel_flags(p)
    add_edge_flags(p, env)
    add_get_flags(p, env)
    add_session_flags(p)
    add_node_flags(p, env)
    add_judge_flags(p, env)
    p.add_argument(
        "--mint-token", metavar="TENANT", help="mint a token for TENANT, append its hash, print it, exit"
    )
    p.add_argument(
        "--role", default="tenant", choices=("tenant", "reader", "operator"), help="role of the minted token"
    )
    p.add_argument("--name", default="", help="label of the minted token (default: the tenant)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace, env: Mapping[str, str]) -> ControllerConfig:
    secret = env.get("KVFLEET_SALT_SECRET")
    try:
        salt = bytes.fromhex(secret) if secret else None
    except ValueError as e:  # NOTE: the message named no variable (review finding)
        raise InvalidArgument(f"KVFLEET_SALT_SECRET must be hex digits (e.g. `openssl rand -hex 32`): {e}") from None
    return ControllerConfig(
        listen=args.listen,
        store_url=args.store,
        tokens_file=args.tokens_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        max_blob_bytes=args.max_blob_bytes,
        salt_secret=salt,
        ray_address=args.ray_address,
        leader_election=args.leader_election,
        **with_get_limits(edge_config_from(args), args),
        gc_interval_s=args.gc_interval,
        verdict_ttl_s=args.verdict_ttl,
        fleet_metrics_interval_s=args.fleet_metrics_interval,
        store_ping_interval_s=args.store_probe_interval,
        kernel=kernel_overrides_from(args),
        sessions=session_limits_from(args),
        node_kv_bytes=args.node_kv_bytes,
        node_max_sessions=args.node_max_sessions,
        detector_layers=(layers := detector_layers_from(args.detector_layers)),
        detector_encoder_gate=encoder_gate_from(args.detector_encoder_gate, layers),
        detector_encoder_max_fragmentation=max_fragmentation_from(args.detector_encoder_max_fragmentation, layers),
        detector_tenants=detector_tenants_from(args.detector_tenant),
        judge=judge_limits_from(args),
    )



def metrics_host(listen: str, host: str | None) -> str:
    """Where /metrics binds: --metrics-host, else the gRPC --listen host (never wider than it)."""
    if host:
        return host
    listen_host = listen.rsplit(":", 1)[0].strip("[]")
    return listen_host or "0.0.0.0"


def _start_metrics(metrics: Metrics, port: int, host: str) -> int | None:
    if port < 0:
        return None
    if port > 65535:  # NOTE: was OverflowError's traceback (found by review)
        raise InvalidArgument(f"--metrics-port {port}: a port is 0-65535 (0: any free port; -1: no metrics)")
    from prometheus_client import start_http_server

    try:
        server, _ = start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as e:  # NOTE: before, "[Errno 98] Address already in use" naming neither flag nor port
        raise InvalidArgument(f"cannot serve metrics on {host}:{port}: {e.strerror or e}; pick another "
                              "--metrics-port (-1: none)") from None
    return int(server.server_port)


async def serve(
    cfg: ControllerConfig,
    metrics_port: int,
    router_config: RouterConfig | None = None,
    metrics_addr: str | None = None,
) -> int:
    metrics = Metrics()
    mhost = metrics_host(cfg.listen, metrics_addr)
    mport = _start_metrics(metrics, metrics_port, mhost)  # NOTE: first: a port in use then stops nothing started
    ctl = await build_server(cfg, metrics=metrics, router_config=router_config)
    auth = (
        f"tokens {cfg.tokens_file}"
        if cfg.tokens_file
        else "auth OFF (no --tokens-file): every caller is operator"
    )
    print(
        f"kvfleet controller listening on {ctl.address} ({'TLS' if cfg.tls_cert else 'plaintext'}, {auth}); "
        + (f"metrics on {mhost}:{mport}" if mport is not None else "metrics off (--metrics-port -1)")
        + f"; store {redact(cfg.store_url)}"
        + ("; leader election on" if cfg.leader_election else ""),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        print("kvfleet controller: stopping (draining in-flight calls)", flush=True)
        await ctl.stop(grace=5.0)
    finally:
        await asyncio.to_thread(ray_local.stop)  # the local Ray we started, and everything it started
    return 0


def quiet_ray_signals() -> None:
    """NOTE: Ray's driver installs abseil's failure handler for SIGTERM, which arms a 3 s abort alarm;
    a graceful stop (drain RPCs, stop the fleet, Ray) takes longer, so the controller died with
    SIGABRT on every Kubernetes stop. Without that handler, SIGTERM reaches our own graceful stop."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")


def _mint(args: argparse.Namespace) -> int:
    if not args.mint_token:
        print("kvfleet controller: --mint-token needs a tenant name, got ''", file=sys.stderr)
        return 2
    if not args.tokens_file:
        print("kvfleet controller: --mint-token needs --tokens-file", file=sys.stderr)
        return 2
    print(mint_token(Path(args.tokens_file), args.mint_token, args.role, args.name))
    return 0


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    quiet_ray_signals()
    args = parse_args(list(sys.argv[1:] if argv is None else argv), env)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.mint_token is not None:  # NOTE: an empty name (an unset $TENANT) started a server (review finding)
            return _mint(args)
        cfg = config_from(args, env)
        report = layers_report(cfg.detector_layers, named=args.detector_layers is not None)
        if cfg.detector_encoder_gate is not None:
            report += f"; the encoder judges only learned scores >= {cfg.detector_encoder_gate:g}"
        if cfg.detector_encoder_max_fragmentation is not None:
            report += f"; the encoder reads only windows of word pieces <= {cfg.detector_encoder_max_fragmentation:g}"
        print(report, flush=True)
        if not 0 <= args.reset_drain_timeout < math.inf:
            raise InvalidArgument(f"--reset-drain-timeout must be a number of seconds >= 0, got {args.reset_drain_timeout}")
        router_config = RouterConfig(cost=cost_config_from(args), stream=stream_limits_from(args),
                                     reset_drain_s=args.reset_drain_timeout)
        if not args.ray_address:
            # NOTE: only once nothing can refuse the arguments: a caller that runs main() in its own process
            # (the tests) and gets a usage error must not be left owning the local Ray's process group.
            ray_local.own()  # a local Ray, if one is started, is ours: it goes when we go
        return event_loop.run(serve(cfg, args.metrics_port, router_config, args.metrics_host))
    except (KvfleetError, OSError, ValueError) as e:
        print(f"kvfleet controller: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
