"""What the sync and asyncio clients share: options and channel (Transport), request building (the error mapping:
fleet/sdk/failures.py)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import grpc

from fleet.api.kvfleet.v1 import blobs_pb2, workers_pb2
from fleet.core.errors import FailedPrecondition, InvalidArgument, KvfleetError, Unauthenticated
from fleet.sdk import args
from fleet.sdk import retry as retrying
from fleet.sdk.failures import Sent
from fleet.sdk.failures import answered as answered  # re-exported (and the three below): they lived here
from fleet.sdk.failures import error_of as error_of
from fleet.sdk.failures import gave_up as gave_up
from fleet.sdk.failures import to_error as to_error
from fleet.sdk.retry import NO_RETRY as NO_RETRY  # re-exported: it lived here before fleet/sdk/retry.py
from fleet.sdk.retry import RetryPolicy as RetryPolicy
from fleet.sdk.sessions import SESSION_TIMEOUT_S
from fleet.sdk.target import target as checked_target

CHUNK = 1 << 20  # 1 MiB per streamed message, well under gRPC's 4 MiB default limit
# NOTE: gRPC's reconnect backoff grows to 120 s by default: a proxy whose controller was down for 75 s answered 503
# for 28 s after a new one listened (30 s down: 6.1 s), while a fresh client connected at once (found by review).
# Capped at 2 s, a client is back within about 2 s of the controller, at one connection attempt per 2 s while it is down.
# Not grpc.min_reconnect_backoff_ms: it is also the shortest a connection attempt may take (20 s by default), and at
# 500 ms a controller slow to send its first HTTP/2 frame (a loaded one, a TLS handshake) failed the attempt.
RECONNECT = (("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000))


def reconnecting(options: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """`options` with RECONNECT's backoff for every key of it they do not set themselves."""
    mine = {k for k, _ in options}
    return tuple(o for o in RECONNECT if o[0] not in mine) + tuple(options)


Pem = bytes | str | Path


class RpcRow(Protocol):
    """What a transport reads of one of the SDK table's rows (fleet/sdk/table.py's `Rpc`)."""

    @property
    def stub(self) -> Callable[[Any], Any]: ...
    @property
    def method(self) -> str: ...
    @property
    def timeout(self) -> str: ...


def _pem(value: Pem | None, what: str) -> bytes | None:
    """The PEM bytes of `value` (bytes, or a path to read). NOTE: grpc takes non-PEM bytes without a
    word and only fails each handshake later, which callers see as an unreachable controller."""
    if value is None:
        return None
    if isinstance(value, bytes):
        data, shown = value, "(bytes)"
    else:
        try:
            data, shown = Path(value).read_bytes(), str(value)
        except OSError as e:
            raise InvalidArgument(f"{what} {value}: cannot read it ({e.strerror}); give a PEM file") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"{what} {shown} is not PEM (no '-----BEGIN' line)")
    return data


def credentials(tls: bool, root_certificates: Pem | None, client_cert: Pem | None = None,
                client_key: Pem | None = None) -> grpc.ChannelCredentials | None:
    """None for plaintext; TLS credentials (system roots unless a CA PEM, bytes or path, is given).

    With client_cert and client_key (PEM) the client proves itself too: mutual TLS, for a controller
    started with --tls-client-ca. Any of the three implies TLS.
    """
    if (client_cert is None) != (client_key is None):
        raise InvalidArgument("mutual TLS needs both a client certificate and its private key (PEM)")
    if not tls and root_certificates is None and client_cert is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_pem(root_certificates, "TLS CA"),
                                        private_key=_pem(client_key, "TLS client key"),
                                        certificate_chain=_pem(client_cert, "TLS client certificate"))


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def bearer(token: object) -> str | None:
    """`token` as it can be sent in an HTTP/2 header: None, or a str of visible ASCII characters.

    Raises:
        Unauthenticated: a token that is not a str, or holds a space or a control character (a token read from a
            file keeps its trailing newline). NOTE: before, grpc refused it at every call with INTERNAL
            "Invalid metadata", which named neither the token nor the fix (found by review).
    """
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise Unauthenticated(f"the token must be a str, got {type(token).__name__}")
    bad = next((i for i, ch in enumerate(token) if not "!" <= ch <= "~"), None)
    if bad is not None and token[:7].lower() == "bearer ":  # NOTE: was told to strip() it, which kept the prefix
        raise Unauthenticated("the token starts with 'Bearer ': pass the token alone (kvf_...); the client sends "
                              "the 'authorization: Bearer <token>' header itself")
    if bad is not None:
        raise Unauthenticated(f"the token holds {token[bad]!r} at position {bad} of {len(token)}: a bearer token is "
                              "visible ASCII only (one read from a file keeps its newline: strip() it)")
    return token


def put_requests(data: bytes, expected_ref: str | None) -> Iterator[blobs_pb2.PutBlobRequest]:
    yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(data), expected_ref=expected_ref or ""))
    view = memoryview(data)
    for off in range(0, len(data), CHUNK):
        yield blobs_pb2.PutBlobRequest(chunk=bytes(view[off:off + CHUNK]))


def expected(data: bytes, expected_ref: str | None, verify: bool) -> str | None:
    return expected_ref if expected_ref is not None or not verify else hashlib.sha256(data).hexdigest()


def check_got(ref: str, data: bytes) -> bytes:
    if hashlib.sha256(data).hexdigest() != ref:
        raise KvfleetError(f"blob {ref} arrived corrupted (its sha256 differs); retry the get")
    return data


def worker_spec(name: str, url: str, kv_events: str, replay: str, model: str, dp_ranks: int,
                block_size: int | None, hash_algo: str | None, hash_seed: str | int | None,
                dp_rank_start: int = 0) -> workers_pb2.WorkerSpec:
    dp_ranks = args.count("dp_ranks", dp_ranks, 1)
    dp_rank_start = args.count("dp_rank_start", dp_rank_start)
    block_size = None if block_size is None else args.count("block_size", block_size, 1)
    spec = workers_pb2.WorkerSpec(name=args.text("name", name), url=args.text("url", url),
                                  kv_events=args.text("kv_events", kv_events), replay=args.text("replay", replay),
                                  model=args.text("model", model), dp_ranks=dp_ranks, block_size=block_size or 0,
                                  hash_algo=args.text("hash_algo", hash_algo or ""), dp_rank_start=dp_rank_start)
    if hash_seed is not None:
        spec.hash_seed = args.text("hash_seed", str(hash_seed))
    return spec


def lifecycle_request(name: str, verb: str, level: int | None, mode: str | None, tags: Sequence[str] | None,
                      clear_cache: bool | None, dp_rank: int | None,
                      reset_running_requests: bool | None = None) -> workers_pb2.LifecycleRequest:
    req = workers_pb2.LifecycleRequest(name=args.text("name", name), verb=args.text("verb", verb),
                                       tags=args.strings("tags", tags))
    mode = None if mode is None else args.text("mode", mode)
    level = None if level is None else args.count("level", level, 0, args.INT32_MAX)
    dp_rank = None if dp_rank is None else args.count("dp_rank", dp_rank)
    for key, val in (("level", level), ("mode", mode), ("clear_cache", clear_cache), ("dp_rank", dp_rank),
                     ("reset_running_requests", reset_running_requests)):
        if val is not None:
            setattr(req, key, val)
    return req


class Transport:
    """What FleetClient and AsyncFleetClient share: options, the channel, the bearer token, the stubs
    (arguments: FleetClient). A client serves the process that made its channel (see `_check_open`)."""

    _grpc: ClassVar[Any] = grpc  # where channels come from: grpc, or grpc.aio
    _lazy: ClassVar[bool] = False  # True: the channel is made at the first call (grpc.aio: in its event loop)
    _SETTING: ClassVar[dict[str, str]] = {"unary": "timeout", "blob": "blob_timeout", "session": "session_timeout"}

    def __init__(self, target: str, token: str | None = None, *, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, client_cert: bytes | str | Path | None = None,
                 client_key: bytes | str | Path | None = None, timeout: float = 10.0,
                 blob_timeout: float = 120.0, retry: RetryPolicy | None = None,
                 options: Sequence[tuple[str, Any]] = (), session_timeout: float = SESSION_TIMEOUT_S) -> None:
        self.target = checked_target(target)
        self.timeout, self.blob_timeout = args.seconds("timeout", timeout), args.seconds("blob_timeout", blob_timeout)
        # NOTE: before, a session call always waited 120 s, whatever was set
        self.session_timeout = args.seconds("session_timeout", session_timeout)
        if retry is not None and not isinstance(retry, retrying.RetryPolicy):  # NOTE: was an AttributeError at first call
            raise InvalidArgument(f"retry must be a RetryPolicy (or None), got {type(retry).__name__} {retry!r:.40}")
        self.retry = retry or RetryPolicy()
        self._md = metadata(bearer(token))
        self._creds, self._options = credentials(tls, root_certificates, client_cert, client_key), reconnecting(options)
        self._channel: Any = None
        self._pid: int | None = None  # the process that made the channel
        self._stubs: dict[Any, Any] = {}
        self._methods: dict[int, tuple[Callable[..., Any], float]] = {}  # id(rpc) -> _stub_method(rpc)
        self._closed = False
        self._guard = threading.Lock()  # a stub is built, and the client marked closed, under it
        if not self._lazy:
            self._channel = self._new_channel()

    def _new_channel(self) -> Any:
        self._pid = os.getpid()
        return (self._grpc.secure_channel(self.target, self._creds, self._options) if self._creds
                else self._grpc.insecure_channel(self.target, self._options))

    def _stub_method(self, rpc: RpcRow) -> tuple[Callable[..., Any], float]:
        """The stub's callable for `rpc`, and its per-attempt deadline (seconds). NOTE: never built on a closed
        channel: grpc then crashed the process (SIGSEGV; the asyncio client corrupted its heap)."""
        with self._guard:
            self._check_open()
            stub = self._stubs.get(rpc.stub)
            if stub is None:
                if self._channel is None:
                    self._channel = self._new_channel()
                stub = self._stubs[rpc.stub] = rpc.stub(self._channel)
        per = {"unary": self.timeout, "blob": self.blob_timeout, "session": self.session_timeout}[rpc.timeout]
        self._methods[id(rpc)] = (getattr(stub, rpc.method), per)  # the rows live as long as the module
        return self._methods[id(rpc)]

    def _sent(self, method: str, per_attempt: float | None = None, kind: str = "unary", op_id: str = "") -> Sent:
        """The call as its error names it (fleet/sdk/failures.py): `kind` is its row's timeout (table.Timeout),
        `op_id` the op id its request carries."""
        return Sent(method, self.target, per_attempt or self.timeout, self._SETTING[kind], self.retry.deadline_s,
                    op_id)

    def _check_open(self) -> None:
        """Raises FailedPrecondition once the client is closed (before, after close() a call crashed the process),
        and in a process forked after its channel was made.

        NOTE: gRPC Python does not support fork by default: a call from the child hung forever, past its deadline
        (found by review). The channel is not rebuilt in the child: without GRPC_ENABLE_FORK_SUPPORT=1 (set before
        the parent imports grpc) a channel made in such a child hangs the same way (measured), and with it the
        child can make its own client.
        """
        if self._closed:
            raise self._closed_error()
        if self._forked():
            raise FailedPrecondition(
                f"{type(self).__name__} of {self.target} was made in process {self._pid} and is called in process "
                f"{os.getpid()}, forked from it: a grpc channel does not survive a fork. Create one client per "
                "process, in the process that uses it: start worker processes with multiprocessing's 'spawn' or "
                "'forkserver' method (a forked child needs GRPC_ENABLE_FORK_SUPPORT=1 set before the parent "
                "imports grpc)")

    def _forked(self) -> bool:
        return self._pid is not None and self._pid != os.getpid()

    def _closed_error(self) -> FailedPrecondition:
        return FailedPrecondition(f"the client is closed ({type(self).__name__} of {self.target}: close() was called "
                                  "or its with block ended); make a new client")

    def _closed_in_flight(self, op_id: str = "") -> FailedPrecondition:
        """The error of a call that was in flight when close() ended it: the controller may have applied it."""
        again = (f"; call again with op_id={op_id!r} on a new client and it is answered from the session's op log, "
                 "never applied twice" if op_id else "")
        err = FailedPrecondition(f"{self._closed_error()}. This call was in flight when the client was closed and its "
                                 f"answer is lost: the controller may have applied it{again}")
        err.op_id = op_id
        return err

    def _mark_closed(self) -> bool:
        """Mark the client closed; False when it already was (close() is idempotent)."""
        with self._guard:
            was, self._closed = self._closed, True
        return not was

    def _raced_close(self, e: Exception) -> None:
        """Raise FailedPrecondition for grpc's own error of a call that a close() raced (a closed channel's
        ValueError or UsageError), or ended in flight (its CANCELLED); return for any other error.

        NOTE: a call in flight when another thread closed the client raised KvfleetError "CANCELLED: Channel
        closed!" (found by review); an op id it carried stays on the error."""
        if not self._closed:
            return
        if isinstance(e, ValueError | grpc.aio.UsageError) and not isinstance(e, KvfleetError):
            raise self._closed_error() from e
        cause = e.__cause__
        if isinstance(cause, grpc.RpcError) and hasattr(cause, "code") and cause.code() == grpc.StatusCode.CANCELLED:
            raise self._closed_in_flight(getattr(e, "op_id", "")) from e
