"""Session calls of the SDK: typed results and the request builders of the session rows of the
table (fleet/sdk/table.py), which FleetClient and AsyncFleetClient run.

    with FleetClient("127.0.0.1:50051", token=tok) as c:
        c.create_session("agent-0", "You are a careful agent.")
        r = c.append("agent-0", "list the files", return_logits=True)   # r.piece, r.logits
        ids = c.generate("agent-0", 4)
        c.sessions(fleet=True)                                          # rows across the fleet

Reads (get, list, working set) are retried on UNAVAILABLE like every other call. Appends (text,
token ids, tool results) and generate carry an op id — the caller's `op_id`, or one the SDK draws
per call — so they are retried on UNAVAILABLE too, and on DEADLINE_EXCEEDED (the controller finishes
a call its caller stopped waiting for): a retry of an op whose response was lost is answered with
the piece it appended (`replayed=True`), never applied twice. Pass your own `op_id` to retry safely
across clients or processes; the error of a call that carried one has it as `e.op_id`. The other mutating calls (create, evict, fork,
admit, close) are sent once: the caller decides.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.core.errors import InvalidArgument, KvfleetError
from fleet.core.session_types import SessionRow as SessionRow  # the SDK returns the core type
from fleet.sdk import args

SESSION_TIMEOUT_S = 120.0  # a fork or a regeneration replays a whole op log


@dataclass(frozen=True, slots=True)
class PieceInfo:
    """One ledger entry of a session's context (fleet.core.context.Piece)."""

    piece_id: int
    kind: str
    start: int
    length: int
    state: str
    ref: str
    role: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeRow:
    """One kernel node (a Ray node with its kernel host and radix prefix cache)."""

    node: str
    num_sessions: int
    cached_tokens: int
    capacity_tokens: int
    queried_tokens: int
    hit_tokens: int
    evicted_blocks: int
    hit_rate: float

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}


@dataclass(frozen=True, slots=True)
class FleetSessions:
    sessions: tuple[SessionRow, ...]
    nodes: tuple[NodeRow, ...]


@dataclass(frozen=True, slots=True)
class AppendResult:
    """`logits` (float32 [vocab]) only when asked for with return_logits=True."""

    piece: PieceInfo | None
    num_tokens: int
    op_index: int
    replayed: bool
    logits: np.ndarray | None


@dataclass(frozen=True, slots=True)
class EvictResult:
    mode: str
    start: int
    length: int
    tail: bool
    num_evicted: int
    num_recomputed: int
    num_rerotated: int
    exact: bool
    # the kernel's measured check of a reposition: max|K - RoPE(Kraw)| over the re-rotated rows (None: none was)
    invariant_delta: float | None = None
    logits_fresh: bool = True  # False after a non-tail reposition (the next append computes the last logits) or none left


@dataclass(frozen=True, slots=True)
class QuarantineWitness:
    """max|Δ| evict-vs-never (0 when exact) with its control kept-vs-never (> 0)."""

    piece_id: int
    start: int
    length: int
    mode: str
    write_time: bool
    exact: bool
    num_recomputed: int
    max_abs_delta: float
    control: float
    cache_digest_equal: bool
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Admission:
    verdict: str
    reasons: tuple[str, ...]
    evicted: bool
    witness: QuarantineWitness | None


@dataclass(frozen=True, slots=True)
class WorkingSetItem:
    piece: PieceInfo
    verdict: str
    reason: str


@dataclass(frozen=True, slots=True)
class WorkingSetResult:
    items: tuple[WorkingSetItem, ...]
    tokens_reused: int
    tokens_to_prefill: int


@dataclass(frozen=True, slots=True)
class SessionState:
    row: SessionRow
    digest: str
    token_ids: tuple[int, ...]


# -- proto -> types ---------------------------------------------------------------------------

def piece(p: Any) -> PieceInfo:
    return PieceInfo(p.piece_id, p.kind, p.start, p.length, p.state, p.ref, p.role, tuple(p.token_ids))


def session_row(r: Any) -> SessionRow:
    return SessionRow(r.session_id, r.tenant, r.node, r.actor, r.num_tokens, r.bytes_alone, r.bytes_shared,
                      r.hit_rate, r.quarantined_spans, r.state, r.epoch, r.last_active, r.parent, r.adopted_tokens,
                      r.backend, r.device, r.history_tokens, r.model_id, r.rebuilt_from_model_id)


def node_row(n: Any) -> NodeRow:
    return NodeRow(n.node, n.num_sessions, n.cached_tokens, n.capacity_tokens, n.queried_tokens, n.hit_tokens,
                   n.evicted_blocks, n.hit_rate)


def append_result(r: pb.AppendResponse) -> AppendResult:
    if len(r.logits_f32) % 4:  # NOTE: before, numpy's "buffer size must be a multiple of element size"
        raise KvfleetError(f"Append's answer carries {len(r.logits_f32)} bytes of logits_f32, not a whole number of "
                           "float32 values: the controller's answer is malformed")
    logits = np.frombuffer(r.logits_f32, dtype="<f4").copy() if r.logits_f32 else None
    return AppendResult(piece(r.piece) if r.HasField("piece") else None, r.num_tokens, r.op_index, r.replayed, logits)


def evict_result(r: pb.EvictResponse) -> EvictResult:
    delta = r.invariant_delta if r.HasField("invariant_delta") else None
    return EvictResult(r.mode, r.start, r.length, r.tail, r.num_evicted, r.num_recomputed, r.num_rerotated, r.exact,
                       delta, r.logits_fresh)


def admission(r: pb.AdmitToolResultResponse) -> Admission:
    w = None
    if r.HasField("witness"):
        x = r.witness
        w = QuarantineWitness(x.piece_id, x.start, x.length, x.mode, x.write_time, x.exact, x.num_recomputed,
                              x.max_abs_delta_evict_vs_never, x.control_kept_vs_never, x.cache_digest_equal,
                              _detail(x.detail_json))
    return Admission(r.verdict, tuple(r.reasons), r.evicted, w)


def _detail(raw: str) -> Any:
    try:
        return json.loads(raw or "{}")
    except ValueError as e:  # NOTE: before, a JSONDecodeError out of the SDK
        raise KvfleetError(f"AdmitToolResult's answer carries a witness detail_json that is not JSON ({e}): the "
                           "controller's answer is malformed") from None


def working_set_result(r: pb.WorkingSetResponse) -> WorkingSetResult:
    items = tuple(WorkingSetItem(piece(i.piece), i.verdict, i.reason) for i in r.items)
    return WorkingSetResult(items, r.tokens_reused, r.tokens_to_prefill)


def new_op_id(op_id: str | None) -> str:
    """The caller's idempotency key, or a fresh one (one per logical call, kept across its retries)."""
    return uuid.uuid4().hex if op_id is None else args.text("op_id", op_id) or uuid.uuid4().hex


def append_request(session_id: str, content: str | Sequence[int], role: str, return_logits: bool,
                   op_id: str | None = None) -> pb.AppendRequest:
    req = pb.AppendRequest(session_id=args.text("session_id", session_id), role=args.text("role", role),
                           return_logits=return_logits, op_id=new_op_id(op_id))
    if isinstance(content, str):
        req.text = args.text("append's text", content)
    elif isinstance(content, list | tuple):
        req.token_ids.ids.extend(args.token_ids(content, "append's token ids"))
    else:
        raise InvalidArgument("append takes text (str) or token ids (a list of ints in [0, 2**32))")
    return req


# -- request builders: the session calls' signatures (fleet/sdk/table.py) --------------------------

def create_session(session_id: str, system_prompt: str) -> pb.CreateSessionRequest:
    """Place and start a session whose first piece is `system_prompt`."""
    return pb.CreateSessionRequest(session_id=args.text("session_id", session_id),
                                   system_prompt=args.text("system_prompt", system_prompt))


def append(session_id: str, content: str | Sequence[int], *, role: str = "user", return_logits: bool = False,
           op_id: str | None = None) -> pb.AppendRequest:
    """Append a message (text, with its role) or model output (token ids).

    Idempotent on `op_id` (drawn if not given): retried on UNAVAILABLE; an op already applied
    is answered with its piece and `replayed=True`."""
    return append_request(session_id, content, role, return_logits, op_id)


def add_tool_result(session_id: str, ref: Any, *, return_logits: bool = False,
                    op_id: str | None = None) -> pb.AppendRequest:
    """Append a tool result stored in the CAS (put_blob first); quarantined refs are refused.
    Idempotent on `op_id`, as `append`."""
    return pb.AppendRequest(session_id=args.text("session_id", session_id), tool_result_ref=args.ref(ref),
                            return_logits=return_logits,
                            op_id=new_op_id(op_id))


def generate(session_id: str, num_tokens: int, *, op_id: str | None = None) -> pb.GenerateRequest:
    """Greedy-decode `num_tokens` tokens, appended to the session as one output piece.
    Idempotent on `op_id`, as `append` (a retry returns the tokens generated the first time)."""
    return pb.GenerateRequest(session_id=args.text("session_id", session_id), num_tokens=args.count("num_tokens", num_tokens, 1),
                              op_id=new_op_id(op_id))


def evict(session_id: str, piece_id: int, mode: str = "exact") -> pb.EvictRequest:
    return pb.EvictRequest(session_id=args.text("session_id", session_id), piece_id=args.count("piece_id", piece_id),
                           mode=args.text("mode", mode))


def fork(session_id: str, child_id: str) -> pb.ForkRequest:
    return pb.ForkRequest(session_id=args.text("session_id", session_id), child_id=args.text("child_id", child_id))


def admit_tool_result(session_id: str, ref: Any) -> pb.AdmitToolResultRequest:
    """Detector verdict on a stored tool result; QUARANTINED evicts it with a witness."""
    return pb.AdmitToolResultRequest(session_id=args.text("session_id", session_id), ref=args.ref(ref))


def working_set(session_id: str, budget_tokens: int) -> pb.WorkingSetRequest:
    return pb.WorkingSetRequest(session_id=args.text("session_id", session_id),
                                budget_tokens=args.count("budget_tokens", budget_tokens, 0, args.UINT64_MAX))


def get_session(session_id: str, *, include_tokens: bool = False) -> pb.GetSessionRequest:
    return pb.GetSessionRequest(session_id=args.text("session_id", session_id), include_tokens=include_tokens)


def close_session(session_id: str) -> pb.CloseSessionRequest:
    return pb.CloseSessionRequest(session_id=args.text("session_id", session_id))


def fleet_sessions(fleet: bool = True, tenant: str | None = None) -> pb.ListSessionsRequest:
    """Sessions (and, for the operator, kernel nodes) across the fleet."""
    return pb.ListSessionsRequest(fleet=fleet, tenant=args.text("tenant", tenant or ""))


def sessions(fleet: bool = True, tenant: str | None = None) -> pb.ListSessionsRequest:
    return fleet_sessions(fleet, tenant)
