"""The gRPC edge of the controller: transport limits, TLS/mTLS credentials, and undecodable requests.

Transport limits are gRPC core channel arguments (see gRPC's doc/keepalive.md):

    max_receive_bytes        grpc.max_receive_message_length   one message larger is RESOURCE_EXHAUSTED
    max_concurrent_streams   grpc.max_concurrent_streams        open RPCs per client connection
    keepalive_s/_timeout_s   grpc.keepalive_time_ms/_timeout_ms the server pings idle peers, drops dead ones
    min_ping_interval_s      grpc.http2.min_ping_interval_without_data_ms  faster client pings are strikes;
                             after grpc.http2.max_ping_strikes the connection gets GOAWAY

A request whose bytes do not parse (e.g. a string field that is not UTF-8) would leave as UNKNOWN
from inside grpc; DecodeGuard answers INVALID_ARGUMENT with the parser's reason instead. It swaps each
method's deserializer for one that returns an `Undecodable` instead of raising; kvfleet's own methods
refuse it in their one wrapper (controller.servicers.common), other services (health, reflection) get a
wrapper here. Both are built once per method, not per call.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from controller import tls_reload
from fleet.core.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    """Transport limits of the gRPC server (flags of `kvfleet controller` in parentheses)."""

    max_receive_bytes: int = 4 << 20  # --grpc-max-receive-bytes
    max_concurrent_streams: int = 100  # --grpc-max-concurrent-streams (per connection)
    max_concurrent_rpcs: int = 1000  # --grpc-max-concurrent-rpcs (whole server; more: RESOURCE_EXHAUSTED)
    keepalive_s: float = 60.0  # --grpc-keepalive
    keepalive_timeout_s: float = 20.0
    min_ping_interval_s: float = 10.0  # --grpc-min-ping-interval
    max_ping_strikes: int = 2

    def __post_init__(self) -> None:
        for name in ("max_receive_bytes", "max_concurrent_streams", "max_concurrent_rpcs", "keepalive_s",
                     "keepalive_timeout_s", "min_ping_interval_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"gRPC limit {name} must be positive, got {getattr(self, name)}")

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", ms(self.keepalive_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            # NOTE: gRPC shares a port by default (SO_REUSEPORT): a second controller on an address in use then
            # started and silently took a share of its clients (a blob stored through one was found on 9 of 20 new
            # connections); off, the bind fails and the controller says the address is in use
            ("grpc.so_reuseport", 0),
        ]


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def server_credentials(cert: str, key: str, client_ca: str | None,
                       check_interval_s: float | None = None) -> grpc.ServerCredentials:
    """TLS credentials; with `client_ca` every client must present a certificate that CA signed (mTLS).

    The files are read now (a bad one is InvalidArgument) and again when they change, checked at most once per
    `check_interval_s` (None: tls_reload.CHECK_INTERVAL_S) before a new connection's handshake: a renewed
    certificate is served without a restart (controller/tls_reload.py).
    """
    interval = tls_reload.CHECK_INTERVAL_S if check_interval_s is None else check_interval_s
    fetch = tls_reload.CertReloader(cert, key, client_ca, interval)
    return grpc.dynamic_ssl_server_credentials(fetch.config, fetch, require_client_authentication=bool(client_ca))


@dataclass(frozen=True, slots=True)
class Undecodable:
    type_name: str
    reason: str


def _guard_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    owner = getattr(deserialize, "__self__", None)
    type_name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "the request message")

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            return Undecodable(type_name, str(e))

    return parse


async def refuse(bad: Undecodable, method: str, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{method}: the request is not a valid {bad.type_name} ({bad.reason[-200:]}); "
                        "strings must be UTF-8 and the message must match the kvfleet.v1 protos")


async def checked_stream(requests: AsyncIterator[Any], method: str,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for msg in requests:
        if isinstance(msg, Undecodable):
            await refuse(msg, method, context)
        yield msg


def _wrap(behavior: Callable[..., Any], method: str, stream_in: bool, stream_out: bool) -> Callable[..., Any]:
    async def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if stream_in:
            return checked_stream(request, method, context)
        if isinstance(request, Undecodable):
            await refuse(request, method, context)
        return request

    if not stream_out:
        async def unary_out(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await prepare(request, context), context)
        return unary_out

    async def stream_out_(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        result = behavior(await prepare(request, context), context)
        if inspect.isasyncgen(result):
            async for msg in result:
                yield msg
        elif inspect.isawaitable(result):
            await result  # a handler that writes with context.write()
        else:
            for msg in result:
                yield msg
    return stream_out_


OWN_SERVICES = "/kvfleet.v1."  # methods whose servicer wrapper (servicers.common) refuses an Undecodable


class DecodeGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Turn an unparseable request into INVALID_ARGUMENT (grpc would answer UNKNOWN)."""

    def __init__(self) -> None:
        self._guarded: dict[str, tuple[Any, Any]] = {}  # method path -> (grpc's handler, the guarded one)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        path = str(handler_call_details.method)
        seen = self._guarded.get(path)
        if seen is None or seen[0] is not handler:
            seen = (handler, _guard(handler, path))
            self._guarded[path] = seen
        return seen[1]


def _guard(handler: Any, path: str) -> Any:
    guarded = handler._replace(request_deserializer=_guard_deserializer(handler.request_deserializer))
    if path.startswith(OWN_SERVICES):
        return guarded
    stream_in, stream_out = handler.request_streaming, handler.response_streaming
    slot = ("stream" if stream_in else "unary") + "_" + ("stream" if stream_out else "unary")
    method = path.rsplit("/", 1)[-1]
    return guarded._replace(**{slot: _wrap(getattr(handler, slot), method, stream_in, stream_out)})


# flag -> (where, field, type, help); defaults come from UploadLimits / GrpcLimits / servicers.common
# ("config": a plain ControllerConfig field)
EDGE_FLAGS: dict[str, tuple[str, str, type, str]] = {
    "--max-route-tokens": ("config", "max_route_tokens", int, "most tokens one Route may carry"),
    "--max-blob-bytes-per-tenant": ("config", "max_blob_bytes_per_tenant", int,
                                    "blob bytes one tenant may have stored until GC collects them, 0 = no quota"),
    "--max-verdicts-per-tenant": ("config", "max_verdicts_per_tenant", int,
                                  "cached quarantine verdicts, and quarantine records, one tenant keeps in the store; "
                                  "past it they are answered and not stored, 0 = no bound"),
    "--max-uploads-per-tenant": ("uploads", "tenant_uploads", int, "unfinished blob uploads per tenant"),
    "--max-uploads": ("uploads", "total_uploads", int, "unfinished blob uploads in total"),
    "--max-upload-bytes-per-tenant": ("uploads", "tenant_bytes", int, "bytes of unfinished uploads per tenant"),
    "--max-upload-bytes": ("uploads", "total_bytes", int, "bytes of unfinished uploads in total"),
    "--upload-idle-timeout": ("uploads", "idle_s", float, "seconds an upload may send no bytes before it is dropped"),
    "--upload-min-rate": ("uploads", "min_rate", int, "bytes a second an upload must average after its first "
                          "--upload-idle-timeout, on the client's clock"),
    "--upload-tenant-share": ("uploads", "tenant_share", float, "share, 0..1, of the upload bytes and count "
                              "other tenants leave free that one tenant may reserve"),
    "--grpc-max-receive-bytes": ("grpc", "max_receive_bytes", int, "largest gRPC message received"),
    "--grpc-max-concurrent-streams": ("grpc", "max_concurrent_streams", int, "open RPCs per client connection"),
    "--grpc-max-concurrent-rpcs": ("grpc", "max_concurrent_rpcs", int, "open RPCs on the whole server"),
    "--grpc-keepalive": ("grpc", "keepalive_s", float, "seconds between the server's keepalive pings"),
    "--grpc-min-ping-interval": ("grpc", "min_ping_interval_s", float,
                                 "fastest client ping accepted without calls, seconds (faster: GOAWAY)"),
}

DEFAULT_MAX_ROUTE_TOKENS = 1 << 20
DEFAULT_MAX_BLOB_BYTES_PER_TENANT = 1 << 30  # --max-blob-bytes-per-tenant (0: no quota)
# --max-verdicts-per-tenant (0: no bound): a tenant's cached verdicts, about 70 MB of Redis at ~290 B each, and as
# many quarantine records at most (docs/quarantine_path.md#a-tenants-verdicts-are-bounded)
DEFAULT_MAX_VERDICTS_PER_TENANT = 250_000
_ZERO_IS_OFF = frozenset({"--max-blob-bytes-per-tenant", "--max-verdicts-per-tenant"})


def add_edge_flags(p: Any, env: Any = None) -> None:
    """The edge limits as flags (shared by `kvfleet controller` and `kvfleet up`); defaults in --help.
    With `env`, each is also read from KVFLEET_ + the flag in capitals (--upload-min-rate: KVFLEET_UPLOAD_MIN_RATE)."""
    from controller.uploads import UploadLimits

    defaults = {"config": {"max_route_tokens": DEFAULT_MAX_ROUTE_TOKENS,
                          "max_blob_bytes_per_tenant": DEFAULT_MAX_BLOB_BYTES_PER_TENANT,
                          "max_verdicts_per_tenant": DEFAULT_MAX_VERDICTS_PER_TENANT},
                "uploads": UploadLimits(),
                "grpc": GrpcLimits()}
    for flag, (where, name, kind, text) in EDGE_FLAGS.items():
        d = defaults[where]
        shown = d[name] if isinstance(d, dict) else getattr(d, name)
        var = "KVFLEET_" + flag[2:].upper().replace("-", "_")
        p.add_argument(flag, type=kind, default=(env or {}).get(var), dest=f"edge_{name}",
                       help=f"{text} (default {shown}{f'; env {var}' if env is not None else ''})")


def edge_config_from(args: Any) -> dict[str, Any]:
    """ControllerConfig keyword arguments from the flags given; InvalidArgument names the bad flag."""
    from controller.uploads import UploadLimits

    given: dict[str, dict[str, Any]] = {"config": {}, "uploads": {}, "grpc": {}}
    for flag, (where, name, _, _) in EDGE_FLAGS.items():
        value = getattr(args, f"edge_{name}", None)
        if value is not None:
            if flag in _ZERO_IS_OFF and value == 0:
                pass
            elif not value > 0:
                raise InvalidArgument(f"{flag} must be positive{' (or 0: off)' if flag in _ZERO_IS_OFF else ''}, "
                                      f"got {value}")
            given[where][name] = value
    out: dict[str, Any] = {"uploads": UploadLimits(**given["uploads"]), "grpc_limits": GrpcLimits(**given["grpc"])}
    out.update(given["config"])
    return out
