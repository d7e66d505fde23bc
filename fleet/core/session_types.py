"""What crosses the session stack's process lines, typed (pure core: no ray, grpc, redis or zmq).

    SessionKernel ──OpResult(result=Piece | EvictReport | ToolAdmission)──▶ KernelFleet ──▶ SessionService
    KernelFleet.list_sessions rows ──SessionRow.from_row──▶ SessionService ──row_to_proto──▶ SessionRow (proto)

The session's kernel host builds these, Ray pickles them, the servicer converts each to its proto in one function
(controller/servicers/session_convert.py); nothing on the way re-lists a dict's keys. What callers name
is checked by one rule each: session ids (`check_session_id`), op ids (`check_op_id`) and token ids
(`check_token_ids`, at the edge and by the pure context before an op is logged). Tenant names have
theirs in the store (`fleet.cas.types.check_tenant`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.core.errors import InvalidArgument
from fleet.core.verdict import CLEAN, QUARANTINED

if TYPE_CHECKING:
    import numpy as np


# The one rule for a session id (documented in docs/api.md), at the API edge and in KernelFleet:
# 1-128 characters, a letter or digit first, then letters, digits and `_ . @ -`. No `:` or `/`: they
# separate the parts of the store's keys and Ray actor names (a session named `x:m:y` once made
# Redis GC fail for every tenant).
SESSION_ID_RULE = "1-128 characters: a letter or digit, then letters, digits, '_', '.', '@' or '-'"
SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")
OP_ID_RULE = "1-64 characters of [A-Za-z0-9_.:-]"
OP_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def check_session_id(what: str, sid: object) -> str:
    """Validate a session id (or a fork's child id) against SESSION_ID_RE; InvalidArgument names the rule."""
    if not isinstance(sid, str) or not SESSION_ID_RE.fullmatch(sid):
        raise InvalidArgument(f"invalid {what} {sid!r}: expected {SESSION_ID_RULE}")
    return sid


def check_op_id(op_id: object) -> str:
    """Validate a client's idempotency key (empty: none given)."""
    if not isinstance(op_id, str) or (op_id and not OP_ID_RE.fullmatch(op_id)):
        raise InvalidArgument(f"invalid op_id {op_id!r}: expected {OP_ID_RULE}, or empty")
    return op_id


def check_token_ids(ids: Sequence[Any], vocab_size: int) -> list[int]:
    """The one rule for token ids: a non-empty sequence of ints (not bools) in [0, vocab_size).

    Returns:
        the ids as Python ints.

    Raises:
        InvalidArgument: empty, not ints, or outside the vocabulary; nothing was appended.
    """
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__") or not 0 <= int(t) < vocab_size:
            raise InvalidArgument(f"a piece needs >= 1 token id in [0, {vocab_size}), got {t!r}; nothing was appended")
        out.append(int(t))
    if not out:
        raise InvalidArgument(f"a piece needs >= 1 token id in [0, {vocab_size}); nothing was appended")
    return out


@dataclass(frozen=True, slots=True)
class OpResult:
    """What a mutating op answered (append, generate, evict, add_tool_result, admit_tool_result).

    Attributes:
        result: the verb's own answer: a Piece (append, generate, add_tool_result), an EvictReport
            (evict) or a ToolAdmission (admit_tool_result); None for a replayed op that added no piece.
        logits: float32 [vocab], the session's next-token logits after the op (None after a
            reposition eviction, until the next append).
        num_tokens: tokens the session holds after the op.
        op_index: the op's index in the session's log (None when the op logged nothing).
        replayed: the op id was already in the log (a retry after a crash): answered, not applied again.
        history_tokens: what the session's log holds after the op, as the history quota charges it
            (`oplog.history_tokens`); -1 when unknown.
    """

    result: Any
    logits: np.ndarray | None
    num_tokens: int
    op_index: int | None
    replayed: bool = False
    history_tokens: int = -1

    def __post_init__(self) -> None:
        assert self.num_tokens >= 0, self


@dataclass(frozen=True, slots=True)
class EvictionProof:
    """The proof of a quarantine eviction (fleet/core/quarantine/admit.py): the piece's span, how it
    was evicted, and the measured max|Δ| of next-token logits (after a probe) evicted vs a session
    that never saw the piece, beside the control (piece kept vs never) that shows the probe sees it.
    Not the lifecycle witness (fleet/core/lifecycle.py) nor the kernel's exactness witnesses."""

    ref: str
    piece_id: int
    start: int
    length: int
    mode: str
    late: bool
    write_time: bool
    exact: bool
    num_recomputed: int
    max_abs_delta_evict_vs_never: float
    control_kept_vs_never: float
    cache_digest_equal: bool
    probe_tokens: int
    env: Mapping[str, Any]

    def __post_init__(self) -> None:
        assert self.write_time != self.late and self.length >= 1, self


@dataclass(frozen=True, slots=True)
class ToolAdmission:
    """The verdict on one tool result in a session: CLEAN or QUARANTINED (with its reasons); when
    its tokens were in the KV cache they were evicted and `proof` says how well. A retry answered from
    the op log after the host that evicted them died is evicted without a proof (proofs are not logged)."""

    verdict: str
    reasons: tuple[str, ...] = ()
    evicted: bool = False
    proof: EvictionProof | None = None

    def __post_init__(self) -> None:
        assert self.verdict in (CLEAN, QUARANTINED) and (self.proof is None or self.evicted), self
        assert self.verdict == QUARANTINED or not self.evicted, self


@dataclass(frozen=True, slots=True)
class SessionRow:
    """One session as ListSessions, CreateSession, Fork and GetSession show it: its registry record
    and, while its actor lives, the actor's own counts."""

    session_id: str
    tenant: str = ""
    node: str = ""
    actor: str = ""
    num_tokens: int = 0
    bytes_alone: int = 0
    bytes_shared: int = 0
    hit_rate: float = 0.0
    quarantined_spans: int = 0
    state: str = ""
    epoch: int = 0
    last_active: float = 0.0
    parent: str = ""
    adopted_tokens: int = 0
    backend: str = ""
    device: str = ""
    history_tokens: int = 0  # what its op log holds, as the history quota charges it (0: unknown)
    model_id: str = ""  # the kernel whose KV it holds ("": unknown)
    rebuilt_from_model_id: str = ""  # a rebuild ran on a kernel of another model_id: the one it had (not bit-identical)

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_row(cls, r: Mapping[str, Any]) -> SessionRow:
        """From a KernelFleet row: its registry record merged with the actor's info (workers/)."""
        return cls(
            str(r.get("session", "")), str(r.get("tenant", "")), str(r.get("node", "")), str(r.get("actor", "")),
            int(r.get("tokens", 0)), int(r.get("bytes_alone", 0)), int(r.get("bytes_shared", 0)),
            float(r.get("hit_rate", 0.0)), int(r.get("quarantined_spans", 0)), str(r.get("state", "")),
            int(r.get("epoch", 0)), float(r.get("last_active", 0.0) or 0.0), str(r.get("parent", "") or ""),
            int(r.get("adopted_tokens", 0)), str(r.get("backend", "") or ""), str(r.get("device", "") or ""),
            max(0, int(r.get("history_tokens", 0) or 0)), str(r.get("model_id", "") or ""),
            str(r.get("rebuilt_from_model_id", "") or ""))
