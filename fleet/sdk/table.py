"""The SDK's one table: every call of FleetClient and AsyncFleetClient, declared once.

A row says which RPC a call sends, how the call's arguments become its request, how the reply
becomes the typed result, whether the call is safe to repeat and whether it streams. The
transports only run rows: FleetClient's `put_blob` is `sync(PUT_BLOB)` (fleet/sdk/client.py),
AsyncFleetClient's is `aio(PUT_BLOB)` (fleet/sdk/aio.py). A row's request builder is named, typed
and documented like its call.

    c.put_blob(data)
      req = request(data)                              once per call: validation, op ids
      attempt: stub.PutBlob(wire(req), timeout=..)     a server stream is read whole: [each(m), ...]
               UNAVAILABLE and retry=True: again, under the client's RetryPolicy (fleet/sdk/retry.py)
      return response(reply, req)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, ParamSpec, TypeVar, get_type_hints

from fleet.api.kvfleet.v1 import blobs_pb2, fleet_pb2, route_pb2, workers_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.quarantine_pb2_grpc import QuarantineServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.sessions_pb2_grpc import SessionServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.core.errors import InvalidArgument, KvfleetError
from fleet.sdk import args, base, types
from fleet.sdk import quarantine as q
from fleet.sdk import sessions as s
from fleet.sdk.sessions import FleetSessions, SessionRow, SessionState

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])
Timeout = Literal["unary", "blob", "session"]  # the client's `timeout`, its `blob_timeout`, SESSION_TIMEOUT_S
Streaming = Literal["unary", "client", "server"]


@dataclass(frozen=True, slots=True)
class Rpc(Generic[P, R]):
    """One call of the SDK, named after its request builder.

    Per call, `request(*args, **kwargs)` builds the request once (validation, op ids drawn; kept
    across retries); each attempt sends `wire(request)` within the per-attempt deadline `timeout`
    names (a client stream: a fresh iterator each attempt), reading a server stream whole as
    `[each(message), ...]`; `response(reply, request)` is the result. `retry`: safe to repeat, so
    UNAVAILABLE is retried under the client's RetryPolicy; otherwise sent once. `keyed`: the request carries an
    op id (`request.op_id`), so DEADLINE_EXCEEDED is retried too, and the call's error carries the op id.
    """

    stub: Callable[[Any], Any]
    method: str
    request: Callable[P, Any]
    response: Callable[[Any, Any], R]
    retry: bool = True
    timeout: Timeout = "unary"
    streaming: Streaming = "unary"
    wire: Callable[[Any], Any] | None = None  # None: the request is sent as built
    each: Callable[[Any], Any] | None = None
    keyed: bool = False

    def __post_init__(self) -> None:
        assert (self.streaming == "server") == (self.each is not None), self.method
        assert self.retry or not self.keyed, f"{self.method}: a call with an op id is safe to retry"
        assert self.streaming != "client" or self.wire is not None, f"{self.method}: a stream is re-opened per attempt"

    @property
    def name(self) -> str:
        return self.request.__name__

    def build(self, *a: P.args, **kw: P.kwargs) -> Any:
        """request(*args, **kwargs). An argument protobuf refuses that no check of fleet/sdk/args.py caught (a
        TypeError or ValueError of the builder, called with the right signature) is InvalidArgument naming the call;
        a call with the wrong signature keeps its TypeError."""
        try:
            return self.request(*a, **kw)
        except (TypeError, ValueError) as e:
            if isinstance(e, KvfleetError) or not _binds(self.request, a, kw):
                raise
            raise InvalidArgument(f"{self.name}: an argument does not fit its request ({type(e).__name__}: {e})") from e

    def method_of(self, fn: F) -> F:
        """`fn` dressed as this call's client method: its name, docstring and signature (self first)."""
        sig = inspect.signature(self.request)
        ret = inspect.signature(self.response).return_annotation
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        fn.__name__ = fn.__qualname__ = self.name
        fn.__doc__ = self.request.__doc__
        fn.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()],  # type: ignore[attr-defined]
                                       return_annotation=ret)
        fn.__annotations__ = {**self.request.__annotations__, "return": ret}
        fn.__wrapped__ = self.request  # type: ignore[attr-defined]  # typing.get_type_hints: the builder's globals
        return fn


def _binds(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


# -- request builders (blobs, workers, routing, fleet) ----------------------------------------------

def put_blob(data: bytes, *, expected_ref: str | None = None,
             verify: bool = True) -> Callable[[], Iterator[blobs_pb2.PutBlobRequest]]:
    """Store bytes (chunked); returns their ref. verify=True has the server check our own sha256."""
    data = args.blob(data)
    expected_ref = None if expected_ref is None else args.text("expected_ref", expected_ref)
    return functools.partial(base.put_requests, data, base.expected(data, expected_ref, verify))


@dataclass(frozen=True, slots=True)
class BlobGet:
    message: blobs_pb2.GetBlobRequest
    verify: bool


def get_blob(ref: types.BlobRef | str, *, verify: bool = True) -> BlobGet:
    """The blob's bytes; with verify=True their sha256 is checked on arrival."""
    return BlobGet(blobs_pb2.GetBlobRequest(ref=args.ref(ref)), verify)


def stat_blob(ref: types.BlobRef | str) -> blobs_pb2.StatBlobRequest:
    return blobs_pb2.StatBlobRequest(ref=args.ref(ref))


def pin_blob(ref: types.BlobRef | str, *, tenant: str = "") -> blobs_pb2.PinBlobRequest:
    """Pin a blob: GC never collects it until as many unpins. `tenant`: operators only (another
    tenant's blob); a retry after a lost reply may pin twice (read `pins` in the answer)."""
    return blobs_pb2.PinBlobRequest(ref=args.ref(ref), tenant=args.text("tenant", tenant))


def unpin_blob(ref: types.BlobRef | str, *, tenant: str = "") -> blobs_pb2.PinBlobRequest:
    """Drop one pin (FailedPrecondition when it has none)."""
    return blobs_pb2.PinBlobRequest(ref=args.ref(ref), tenant=args.text("tenant", tenant))


def collect_garbage() -> blobs_pb2.CollectGarbageRequest:
    """Operator: run the store's GC now (every tenant); returns the blobs deleted."""
    return blobs_pb2.CollectGarbageRequest()


def register_worker(name: str, *, url: str, kv_events: str, replay: str = "", model: str = "", dp_ranks: int = 1,
                    block_size: int | None = None, hash_algo: str | None = None,
                    hash_seed: str | int | None = None, dp_rank_start: int = 0) -> workers_pb2.RegisterWorkerRequest:
    """`dp_ranks` DP ranks from global rank `dp_rank_start` (vLLM's --data-parallel-rank or --data-parallel-start-rank
    for a server behind an external or hybrid DP load balancer; 0 for one that runs every rank); `kv_events` and
    `replay` are the endpoints vLLM is configured with (rank r binds their port + r)."""
    spec = base.worker_spec(name, url, kv_events, replay, model, dp_ranks, block_size, hash_algo, hash_seed,
                            dp_rank_start)
    return workers_pb2.RegisterWorkerRequest(spec=spec)


def unregister_worker(name: str) -> workers_pb2.UnregisterWorkerRequest:
    return workers_pb2.UnregisterWorkerRequest(name=args.text("name", name))


def workers() -> workers_pb2.ListWorkersRequest:
    return workers_pb2.ListWorkersRequest()


def lifecycle(name: str, verb: str, *, level: int | None = None, mode: str | None = None,
              tags: Sequence[str] | None = None, clear_cache: bool | None = None,
              dp_rank: int | None = None, reset_running_requests: bool | None = None) -> workers_pb2.LifecycleRequest:
    """Drive a lifecycle verb through the controller; returns its cache-loss witness. `reset_running_requests`
    (reset_prefix_cache only): true preempts the requests running there instead of draining them first."""
    return base.lifecycle_request(name, verb, level, mode, tags, clear_cache, dp_rank, reset_running_requests)


def route(token_ids: Sequence[int], model: str, *, lora: str | None = None,
          probe: bool | None = None) -> route_pb2.RouteRequest:
    """Where to send a request for these tokens (the SDK's Route; the proxy sends the same request)."""
    req = route_pb2.RouteRequest(token_ids=args.token_ids(token_ids), model=args.text("model", model))
    if lora is not None:
        req.lora = args.text("lora", lora)
    if probe is not None:
        req.probe = probe
    return req


def whoami() -> fleet_pb2.WhoAmIRequest:
    return fleet_pb2.WhoAmIRequest()


def fleet() -> fleet_pb2.GetFleetRequest:
    return fleet_pb2.GetFleetRequest()


# -- response converters: (reply, request) -> result ----------------------------------------------

def reply(convert: Callable[[Any], R], field: str = "") -> Callable[[Any, Any], R]:
    """The converter that applies `convert` to the reply (or to its `field`)."""
    def read(r: Any, _: Any) -> R:
        return convert(getattr(r, field) if field else r)
    read.__annotations__ = {"return": get_type_hints(convert)["return"]}  # resolved: it names another module's type
    return read


def _blob_ref(r: Any, _: Any) -> types.BlobRef:
    return types.BlobRef(r.ref, r.size)


def _blob_bytes(chunks: list[bytes], req: BlobGet) -> bytes:
    data = b"".join(chunks)
    return base.check_got(req.message.ref, data) if req.verify else data


def _num_collected(r: Any, _: Any) -> int:
    return int(r.num_collected)


def _nothing(r: Any, _: Any) -> None:
    return None


def _workers(r: Any, _: Any) -> list[types.WorkerInfo]:
    return [types.worker_info(w) for w in r.workers]


def _caller(r: Any, _: Any) -> types.Caller:
    return types.Caller(r.tenant, r.role, r.name)


def _token_ids(r: Any, _: Any) -> list[int]:
    return list(r.token_ids)


def _session_state(r: Any, _: Any) -> SessionState:
    return SessionState(s.session_row(r.session), r.digest, tuple(r.token_ids))


def _fleet_sessions(r: Any, _: Any) -> FleetSessions:
    return FleetSessions(tuple(map(s.session_row, r.sessions)), tuple(map(s.node_row, r.nodes)))


def _session_rows(r: Any, _: Any) -> list[SessionRow]:
    return [s.session_row(x) for x in r.sessions]


def _fresh(open_stream: Callable[[], Iterator[Any]]) -> Iterator[Any]:
    return open_stream()


def _get_message(req: BlobGet) -> blobs_pb2.GetBlobRequest:
    return req.message


def _chunk(m: Any) -> bytes:
    return bytes(m.chunk)


# -- the table ------------------------------------------------------------------------------------
# NOTE: create, evict, fork, admit and close are sent once (retry=False): the caller decides. Appends
# and generate carry an op id (keyed), so a retry is answered from the op log, never applied twice, and a
# DEADLINE_EXCEEDED is retried too (fleet/sdk/retry.py retryable). Pin and unpin
# are counters, so they are sent once too: retried after a lost answer, one unpin dropped two holders' pins
# (the blob then collectable under the other); an unregister retried after it succeeded answered NotFound.

_BLOBS, _WORKERS, _ROUTE, _FLEET, _SESSIONS = (BlobServiceStub, WorkerServiceStub, RouteServiceStub, FleetServiceStub,
                                               SessionServiceStub)
_ROW, _META = reply(s.session_row, "session"), reply(types.blob_info, "meta")

PUT_BLOB = Rpc(_BLOBS, "PutBlob", put_blob, _blob_ref, timeout="blob", streaming="client", wire=_fresh)
GET_BLOB = Rpc(_BLOBS, "GetBlob", get_blob, _blob_bytes, timeout="blob", streaming="server", wire=_get_message,
               each=_chunk)
STAT_BLOB = Rpc(_BLOBS, "StatBlob", stat_blob, _META)
PIN_BLOB = Rpc(_BLOBS, "PinBlob", pin_blob, _META, retry=False)
UNPIN_BLOB = Rpc(_BLOBS, "UnpinBlob", unpin_blob, _META, retry=False)
COLLECT_GARBAGE = Rpc(_BLOBS, "CollectGarbage", collect_garbage, _num_collected)
REGISTER_WORKER = Rpc(_WORKERS, "RegisterWorker", register_worker, reply(types.worker_info, "status"))
UNREGISTER_WORKER = Rpc(_WORKERS, "UnregisterWorker", unregister_worker, _nothing, retry=False)
WORKERS = Rpc(_WORKERS, "ListWorkers", workers, _workers)
LIFECYCLE = Rpc(_WORKERS, "Lifecycle", lifecycle, reply(types.witness))
ROUTE = Rpc(_ROUTE, "Route", route, reply(types.route_decision))
WHOAMI = Rpc(_FLEET, "WhoAmI", whoami, _caller)
FLEET = Rpc(_FLEET, "GetFleet", fleet, reply(types.fleet_info))
CREATE_SESSION = Rpc(_SESSIONS, "CreateSession", s.create_session, _ROW, retry=False, timeout="session")
APPEND = Rpc(_SESSIONS, "Append", s.append, reply(s.append_result), timeout="session", keyed=True)
ADD_TOOL_RESULT = Rpc(_SESSIONS, "Append", s.add_tool_result, reply(s.append_result), timeout="session", keyed=True)
GENERATE = Rpc(_SESSIONS, "Generate", s.generate, _token_ids, timeout="session", keyed=True)
EVICT = Rpc(_SESSIONS, "Evict", s.evict, reply(s.evict_result), retry=False, timeout="session")
FORK = Rpc(_SESSIONS, "Fork", s.fork, _ROW, retry=False, timeout="session")
ADMIT_TOOL_RESULT = Rpc(_SESSIONS, "AdmitToolResult", s.admit_tool_result, reply(s.admission), retry=False,
                        timeout="session")
WORKING_SET = Rpc(_SESSIONS, "WorkingSet", s.working_set, reply(s.working_set_result), timeout="session")
GET_SESSION = Rpc(_SESSIONS, "GetSession", s.get_session, _session_state, timeout="session")
CLOSE_SESSION = Rpc(_SESSIONS, "CloseSession", s.close_session, _nothing, retry=False, timeout="session")
FLEET_SESSIONS = Rpc(_SESSIONS, "ListSessions", s.fleet_sessions, _fleet_sessions, timeout="session")
SESSIONS = Rpc(_SESSIONS, "ListSessions", s.sessions, _session_rows, timeout="session")
JUDGE_TOOL_RESULTS = Rpc(QuarantineServiceStub, "JudgeToolResults", q.judge_tool_results, reply(q.judgements))
SET_VERDICT = Rpc(QuarantineServiceStub, "SetVerdict", q.set_verdict, reply(q.operator_verdict))
LIST_QUARANTINES = Rpc(QuarantineServiceStub, "ListQuarantines", q.list_quarantines, reply(q.records))

TABLE: tuple[Rpc[..., Any], ...] = (
    PUT_BLOB, GET_BLOB, STAT_BLOB, PIN_BLOB, UNPIN_BLOB, COLLECT_GARBAGE,
    REGISTER_WORKER, UNREGISTER_WORKER, WORKERS, LIFECYCLE, ROUTE, WHOAMI, FLEET,
    CREATE_SESSION, APPEND, ADD_TOOL_RESULT, GENERATE, EVICT, FORK, ADMIT_TOOL_RESULT,
    WORKING_SET, GET_SESSION, CLOSE_SESSION, FLEET_SESSIONS, SESSIONS,
    JUDGE_TOOL_RESULTS, SET_VERDICT, LIST_QUARANTINES,
)
