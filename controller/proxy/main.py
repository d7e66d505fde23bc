"""`kvfleet proxy`: an OpenAI-compatible routing proxy in front of the vLLM workers a controller knows.

    kvfleet proxy --controller 127.0.0.1:50051 --listen 0.0.0.0:8000 --token "$KVFLEET_PROXY_TOKEN"
    curl -H "Authorization: Bearer $TENANT_TOKEN" localhost:8000/v1/chat/completions -d '{"model": ...}'

Environment variables are read here and nowhere else (flags win): KVFLEET_CONTROLLER,
KVFLEET_PROXY_LISTEN, KVFLEET_PROXY_METRICS_LISTEN (GET /metrics there alone), KVFLEET_PROXY_TOKEN (the proxy's own token, to list workers: role reader),
KVFLEET_WORKER_API_KEY (the workers' vLLM --api-key), KVFLEET_PROXY_FIRST_BYTE_TIMEOUT (seconds),
KVFLEET_TLS_CA / KVFLEET_TLS_CLIENT_CERT / KVFLEET_TLS_CLIENT_KEY (TLS or mutual TLS to the controller),
KVFLEET_PROXY_ALLOWED_ORIGINS (a JSON list, as --allowed-origins), KVFLEET_PROXY_SHUTDOWN_DELAY and
KVFLEET_PROXY_SHUTDOWN_DRAIN (seconds).

On SIGTERM (or SIGINT) /ready answers 503 at once, the proxy keeps accepting for --shutdown-delay, then stops
listening and lets the requests in flight end for up to --shutdown-drain (docs/proxy.md, "Stopping").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping

from controller.proxy.config import ProxyConfig
from controller.proxy.quarantine import MEDIA_POLICIES
from controller.proxy.server import Proxy
from fleet.core import event_loop
from fleet.core.errors import KvfleetError
from fleet.sdk.tls_flags import add_client_tls


def parse_args(argv: list[str], env: Mapping[str, str]) -> argparse.Namespace:
    e = env.get
    p = argparse.ArgumentParser(prog="kvfleet proxy", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--controller", default=e("KVFLEET_CONTROLLER", "127.0.0.1:50051"), help="controller HOST:PORT")
    p.add_argument("--listen", default=e("KVFLEET_PROXY_LISTEN", "127.0.0.1:8000"), help="HOST:PORT to serve on")
    p.add_argument("--metrics-listen", default=e("KVFLEET_PROXY_METRICS_LISTEN") or None, metavar="HOST:PORT",
                   help="serve GET /metrics on this listener only (--listen then answers it 404): its series name "
                        "every worker and count every tenant's requests, which tenants must not read (env "
                        "KVFLEET_PROXY_METRICS_LISTEN; default: /metrics on --listen, to anyone who reaches it)")
    # NOTE: KVFLEET_TOKEN too, what `kvfleet up` and the other commands read; the proxy read only its own variable
    # and started with no token and 0 workers known (found by review)
    p.add_argument("--token", default=e("KVFLEET_PROXY_TOKEN") or e("KVFLEET_TOKEN"),
                   help="the proxy's own bearer token to list workers (env KVFLEET_PROXY_TOKEN, else KVFLEET_TOKEN): a "
                        "read-only one is enough (`kvfleet controller --mint-token proxy --role reader`); not needed "
                        "with auth off")
    p.add_argument("--token-passthrough", action=argparse.BooleanOptionalAction, default=True,
                   help="forward each client's bearer token to the controller (default on); off: use --token "
                        "for every request (single-tenant, trusted network)")
    p.add_argument("--tokenizer", default=None, metavar="hf:PATH",
                   help="tokenize with a local Hugging Face tokenizer (the workers' own) instead of their /tokenize")
    p.add_argument("--tokenize-cache-mib", type=int, default=e("KVFLEET_PROXY_TOKENIZE_CACHE_MIB", "64"),
                   help="MiB of token ids the tokenize cache holds, shared fairly between tenants (default 64; 0: "
                        "no cache)")
    p.add_argument("--worker-api-key", default=e("KVFLEET_WORKER_API_KEY"),
                   help="the workers' vLLM --api-key, if they have one (sent to them, never to the controller)")
    p.add_argument("--first-byte-timeout", type=float, default=e("KVFLEET_PROXY_FIRST_BYTE_TIMEOUT", "0.25"),
                   help="the longest wait without a first byte before probing the worker's /is_sleeping, which a "
                        "sleeping vLLM needs to be found out (awake: keep waiting; default 0.25); see --first-byte-min")
    p.add_argument("--first-byte-min", type=float, default=e("KVFLEET_PROXY_FIRST_BYTE_MIN", "0.05"),
                   help="the earliest probe: a worker is probed after twice its recent 90th-percentile first-byte "
                        "wait, at least this and at most --first-byte-timeout (default 0.05; set it to the timeout "
                        "for a fixed wait)")
    # NOTE: docs/proxy.md and docs/routing.md named --refresh; it was a config field only (review finding)
    p.add_argument("--refresh", type=float, default=e("KVFLEET_PROXY_REFRESH", "1"),
                   help="seconds between the proxy's listings of the workers (ListWorkers): a verb that puts a worker "
                        "back in routing reaches the proxy within this (env KVFLEET_PROXY_REFRESH; default 1)")
    p.add_argument("--max-first-byte-wait", type=float, default=600.0,
                   help="seconds an attempt may go without a first byte: then a worker a probe found awake (working "
                        "on it) ends the request with a 504, and one no probe found awake fails over (once); set it "
                        "above the longest non-streaming answer (default 600)")
    p.add_argument("--shutdown-delay", type=float, default=e("KVFLEET_PROXY_SHUTDOWN_DELAY", "5"),
                   help="seconds the proxy keeps accepting after SIGTERM, /ready answering 503, so load balancers "
                        "and kube-proxy stop sending it connections before it stops listening (default 5)")
    p.add_argument("--shutdown-drain", type=float, default=e("KVFLEET_PROXY_SHUTDOWN_DRAIN", "300"),
                   help="seconds requests in flight (streams included) then get to end before they are cut "
                        "(default 300); a second SIGTERM or SIGINT stops the proxy at once")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body (default 8 MiB)")
    p.add_argument("--max-inflight-bytes-per-tenant", type=int,
                   default=e("KVFLEET_PROXY_MAX_INFLIGHT_BYTES_PER_TENANT", str(64 << 20)),
                   help="request-body bytes one tenant's requests in flight may hold (each counted from its headers "
                        "until its answer ends; past it: 429; default 64 MiB)")
    p.add_argument("--max-inflight-bytes", type=int, default=e("KVFLEET_PROXY_MAX_INFLIGHT_BYTES", str(128 << 20)),
                   help="request-body bytes all requests in flight may hold; one tenant gets at most half of what "
                        "the others leave (default 128 MiB; the proxy holds about 3x this, more while routing)")
    p.add_argument("--fair-priority", action="store_true",
                   default=e("KVFLEET_PROXY_FAIR_PRIORITY", "") in ("1", "true", "on", "yes"),
                   help="set each request's vLLM `priority` to its place in a fair queue of the worker it is routed "
                        "to (start-time fair queuing per tenant), so another tenant's request goes ahead of one "
                        "tenant's flood in the worker's queue; the client's own priority is replaced. The "
                        "workers must run with --scheduling-policy priority (default off; env "
                        "KVFLEET_PROXY_FAIR_PRIORITY)")
    p.add_argument("--client-header-timeout", type=float, default=30.0,
                   help="seconds a connection has to deliver a request's headers, also the idle keep-alive "
                        "limit; slower clients are disconnected (default 30)")
    p.add_argument("--client-body-timeout", type=float, default=60.0,
                   help="seconds a request body has to arrive in full, else 408 (default 60)")
    p.add_argument("--quarantine-policy", choices=("placeholder", "refuse", "off"), default="placeholder",
                   help="a quarantined tool result is replaced by a placeholder naming its ref (default), or the "
                        "request is refused (400), or tool results are not inspected (off); docs/quarantine.md")
    p.add_argument("--quarantine-tenant-policy", action="append", default=[], metavar="TENANT=POLICY",
                   help="a tenant's own quarantine policy (repeatable)")
    p.add_argument("--tool-media", choices=MEDIA_POLICIES, default=e("KVFLEET_TOOL_MEDIA", "pass"),
                   help="media parts of tool results (images, audio, video, embeddings), which no text detector "
                        "can judge: forwarded (pass, default), each replaced by a text part saying it was withheld "
                        "(withhold), or the request refused with a 400 (refuse); counted either way")
    add_client_tls(p, env)
    cors = p.add_argument_group("CORS (as vLLM's server: JSON lists, the same defaults; [] origins turns it off)")
    cors.add_argument("--allowed-origins", type=_json_list("--allowed-origins"),
                      default=e("KVFLEET_PROXY_ALLOWED_ORIGINS", '["*"]'), help='default ["*"]')
    cors.add_argument("--allow-credentials", action="store_true", help="allow credentials (cookies)")
    cors.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default='["*"]', help='default ["*"]')
    cors.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default='["*"]', help='default ["*"]')
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _json_list(flag: str) -> Callable[[str], tuple[str, ...]]:
    """argparse type of a JSON list of strings, as vLLM's CORS flags take (e.g. '["https://app.example"]')."""
    def parse(text: str) -> tuple[str, ...]:
        try:
            got = json.loads(text)
        except ValueError:
            got = None
        if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, e.g. '[\"*\"]', not {text!r}")
        return tuple(got)
    return parse


def config_from(a: argparse.Namespace) -> ProxyConfig:
    return ProxyConfig(controller=a.controller, listen=a.listen, metrics_listen=a.metrics_listen, token=a.token, token_passthrough=a.token_passthrough,
                       tokenizer=a.tokenizer, tokenize_cache_bytes=a.tokenize_cache_mib << 20,
                       worker_api_key=a.worker_api_key,
                       first_byte_timeout_s=a.first_byte_timeout, first_byte_min_s=a.first_byte_min,
                       max_first_byte_wait_s=a.max_first_byte_wait, refresh_s=a.refresh,
                       client_header_timeout_s=a.client_header_timeout, client_body_timeout_s=a.client_body_timeout,
                       quarantine_policy=a.quarantine_policy,
                       quarantine_tenant_policies=tuple(_pair(x) for x in a.quarantine_tenant_policy),
                       tool_media=a.tool_media, allowed_origins=a.allowed_origins,
                       allow_credentials=a.allow_credentials, allowed_methods=a.allowed_methods,
                       allowed_headers=a.allowed_headers,
                       max_body_bytes=a.max_body_bytes, max_inflight_bytes_per_tenant=a.max_inflight_bytes_per_tenant,
                       max_inflight_bytes=a.max_inflight_bytes, fair_priority=a.fair_priority,
                       shutdown_delay_s=a.shutdown_delay, shutdown_drain_s=a.shutdown_drain, tls=a.tls, tls_ca=a.tls_ca,
                       tls_client_cert=a.tls_cert, tls_client_key=a.tls_key)


def _pair(spec: str) -> tuple[str, str]:
    tenant, sep, policy = spec.partition("=")
    if not sep or not tenant:
        raise ValueError(f"--quarantine-tenant-policy {spec!r}: expected TENANT=POLICY, e.g. acme=refuse")
    return tenant, policy


GC_GEN0_THRESHOLD = 10_000  # young objects allocated (less freed) between two collections of the youngest generation


def settle_gc() -> None:
    """Once the proxy has started: what its start made is frozen out of every later collection, and the youngest
    generation is collected every GC_GEN0_THRESHOLD allocations, not every 700.

    NOTE: a request's objects (aiohttp's request and response, futures, tasks, protobuf messages) live as long as
    its answer, while hundreds of other requests run: at 700 most of them outlived two young collections, moved to
    the oldest generation, and were found there by full collections, each walking every object the process holds.
    At 200 streaming clients (bench/proxy_load.py's processes; the collector timed by gc.callbacks, in thread CPU
    time) collections took 426 ms of the proxy's CPU per 3,000 requests, about 7% of it, and a full one up to 68 ms,
    every request in flight stalled meanwhile; frozen alone, 356 ms; frozen and at 10,000, 75 ms, the longest full
    one 19 ms. Only cyclic garbage waits longer: everything else is freed by reference counting as before. vLLM
    (freeze_gc_heap) and SGLang (freeze_gc) freeze their start-up heap too.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def serve(cfg: ProxyConfig) -> int:
    proxy = await Proxy(cfg).start()
    settle_gc()
    d = proxy.directory
    print(f"kvfleet proxy listening on {proxy.url} -> controller {cfg.controller}; "
          f"{len(d.workers)} worker(s) known" + (f" (cannot list workers: {d.last_error})" if d.last_error else "")
          + ("; client tokens passed through" if cfg.token_passthrough else "; the proxy's token for every request")
          + f"; /metrics on {proxy.metrics_url}", flush=True)
    name = await _first_signal()
    print(f"kvfleet proxy: {name}: /ready answers 503; accepting for {cfg.shutdown_delay_s:g}s more, then draining "
          f"the requests in flight for at most {cfg.shutdown_drain_s:g}s (a second signal stops at once)", flush=True)
    await proxy.shut_down()
    print("kvfleet proxy: stopped", flush=True)
    return 0


async def _first_signal() -> str:
    """Wait for SIGINT or SIGTERM and name it; a second one then gets the default action (stops the process)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()

    def on(sig: signal.Signals) -> None:
        if not got.done():
            got.set_result(sig)

    sigs = (signal.SIGINT, signal.SIGTERM)
    for sig in sigs:
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, on, sig)
    first = await got
    for sig in sigs:
        with contextlib.suppress(NotImplementedError):
            loop.remove_signal_handler(sig)
    return first.name


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv), os.environ if env is None else env)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return event_loop.run(serve(config_from(args)))
    except (KvfleetError, OSError, ValueError) as e:
        print(f"kvfleet proxy: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
