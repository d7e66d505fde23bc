"""A session's op log: typed ops, their JSON form, and the questions every reader asks of a log.

Pure core (no ray, grpc, redis or zmq). Every mutation of a `SessionContext` is one op, written to the
store (`store.oplog_append`) BEFORE it is applied; replaying the log rebuilds the session bit-identically.
The store keeps each op as a JSON object; this module is the only place that knows its fields:

    {"op": "append", "piece": 2, "kind": "tool_result", "ref": "<sha256>", "tenant": "acme", "num_tokens": 57}
    {"op": "append", "piece": 1, "kind": "message", "role": "user", "tenant": "acme", "tokens": [...]}
    {"op": "evict", "piece": 2, "start": 40, "length": 57, "mode": "exact", "reason": "quarantine"}
    {"op": "quarantine", "ref": "<sha256>", "reasons": ["instruction_override"]}
    {"op": "fork", "parent": "s1", "at": 7}
    ... and on each, when the call had them: "op_id": "turn-7", "op_fp": "<32 hex: call_fingerprint>"

A logged op also carries the `op_id` of the call that wrote it (the caller's idempotency key), when it had one,
and that call's fingerprint `op_fp` (`call_fingerprint`: its verb and a hash of its arguments), so a later call
under the same op id is answered as a retry only when it is the same call (`check_op_reuse`). Logs written
before the fingerprint have no `op_fp`: their op ids are answered as before, unchecked.

    log:   | parent's ops (their op ids are the parent's) | fork | this session's own ops |
                                                          ^ own_ops() starts after the last fork marker

    ops = parse_log(store.oplog_read(tenant, session_id))
    own_op_ids(ops), num_tokens(ops), blob_refs(ops), kv_follows_tokens(ops)
"""

from __future__ import annotations

import hashlib
import numbers
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from fleet.core.errors import AlreadyExists, InvalidArgument

KINDS = ("system", "message", "tool_result", "output")
EVICT_MODES = ("exact", "reposition")


@dataclass(frozen=True, slots=True)
class AppendOp:
    """One piece appended. A tool result logs its blob `ref` and `num_tokens` (a replay re-tokenizes the
    bytes and checks the count); every other kind logs its `tokens`."""

    piece: int
    kind: str
    tenant: str
    tokens: tuple[int, ...] | None = None
    ref: str | None = None
    num_tokens: int | None = None
    role: str | None = None
    op_id: str = ""
    op_fp: str = ""

    def __post_init__(self) -> None:
        # NOTE: these were asserts, and parse() relied on them: under `python -O` a stored op of an unknown kind parsed
        if self.kind not in KINDS:
            raise InvalidArgument(f"append kind {self.kind!r} not in {KINDS}")
        if (self.ref is not None) != (self.kind == "tool_result"):
            raise InvalidArgument("a tool result (and only it) has a ref")
        if (self.tokens is None) != (self.kind == "tool_result"):
            raise InvalidArgument("tool results log a count, not tokens")

    @property
    def length(self) -> int:
        """The number of tokens the piece holds."""
        return len(self.tokens) if self.tokens is not None else int(self.num_tokens or 0)


@dataclass(frozen=True, slots=True)
class EvictOp:
    """A piece's span dropped from the KV cache (`reason` "quarantine" marks a verdict's eviction)."""

    piece: int
    start: int
    length: int
    mode: str
    reason: str = "evict"
    op_id: str = ""
    op_fp: str = ""

    def __post_init__(self) -> None:
        if self.mode not in EVICT_MODES:  # NOTE: was an assert (see AppendOp)
            raise InvalidArgument(f"evict mode {self.mode!r} not in {EVICT_MODES}")


@dataclass(frozen=True, slots=True)
class QuarantineOp:
    """A blob held out of this session's context from now on."""

    ref: str
    reasons: tuple[str, ...]
    op_id: str = ""
    op_fp: str = ""


@dataclass(frozen=True, slots=True)
class ForkOp:
    """The marker that ends a fork's copy of its parent's first `at` ops."""

    parent: str
    at: int
    op_id: str = ""
    op_fp: str = ""


Op = AppendOp | EvictOp | QuarantineOp | ForkOp
_VERB = {AppendOp: "append", EvictOp: "evict", QuarantineOp: "quarantine", ForkOp: "fork"}


def to_dict(op: Op) -> dict[str, Any]:
    """The op's JSON object, as the store keeps it (fields that are unset are left out)."""
    d: dict[str, Any] = {"op": _VERB[type(op)]}
    if isinstance(op, AppendOp):
        d.update(piece=op.piece, kind=op.kind, tenant=op.tenant)
        if op.tokens is not None:
            d["tokens"] = list(op.tokens)
        if op.ref is not None:
            d.update(ref=op.ref, num_tokens=op.num_tokens)
        if op.role is not None:
            d["role"] = op.role
    elif isinstance(op, EvictOp):
        d.update(piece=op.piece, start=op.start, length=op.length, mode=op.mode, reason=op.reason)
    elif isinstance(op, QuarantineOp):
        d.update(ref=op.ref, reasons=list(op.reasons))
    else:
        d.update(parent=op.parent, at=op.at)
    if op.op_id:
        d["op_id"] = op.op_id
    if op.op_fp:
        d["op_fp"] = op.op_fp
    return d


def parse(d: Mapping[str, Any]) -> Op:
    """The typed op of one stored JSON object.

    Raises:
        InvalidArgument: an unknown verb, or a field missing or of the wrong type.
    """
    verb, op_id, op_fp = d.get("op"), str(d.get("op_id") or ""), str(d.get("op_fp") or "")  # op_fp: absent in old logs
    try:
        if verb == "append":
            tokens = d.get("tokens")
            return AppendOp(int(d["piece"]), str(d["kind"]), str(d["tenant"]),
                            None if tokens is None else tuple(int(t) for t in tokens), _opt(d.get("ref")),
                            None if d.get("num_tokens") is None else int(d["num_tokens"]), _opt(d.get("role")), op_id, op_fp)
        if verb == "evict":
            return EvictOp(int(d["piece"]), int(d["start"]), int(d["length"]), str(d["mode"]),
                           str(d.get("reason", "evict")), op_id, op_fp)
        if verb == "quarantine":
            return QuarantineOp(str(d["ref"]), tuple(str(r) for r in d["reasons"]), op_id, op_fp)
        if verb == "fork":
            return ForkOp(str(d["parent"]), int(d["at"]), op_id, op_fp)
    except (KeyError, TypeError, ValueError) as e:  # InvalidArgument is a ValueError
        raise InvalidArgument(f"op log: malformed {verb} op {dict(d)!r}: {e!r}") from e
    raise InvalidArgument(f"op log: unknown op {dict(d)!r}")


def parse_log(ds: Iterable[Mapping[str, Any]]) -> list[Op]:
    """The typed ops of a stored log, in order."""
    return [parse(d) for d in ds]


def own_ops(ops: Sequence[Op]) -> Sequence[Op]:
    """The session's own ops: a fork's log starts with its parent's ops, up to the last fork marker."""
    forked = max((i for i, op in enumerate(ops) if isinstance(op, ForkOp)), default=-1)
    return ops[forked + 1:]


def made_by(ops: Sequence[Op], op_id: str) -> bool:
    """Whether `ops` is the log the create or fork of `op_id` wrote: a fork's is its last fork marker's (the
    markers before it, and its first op, are its ancestors'), a create's its system op's.
    NOTE: any marker or the first op was taken: a close of a session (by its create's op id) deleted the log of
    a session forked anew under its name from its own child."""
    markers = [o for o in ops if isinstance(o, ForkOp)]
    return bool(ops) and (markers[-1] if markers else ops[0]).op_id == op_id


def own_op_ids(ops: Sequence[Op]) -> set[str]:
    """The op ids of the session's own ops (a retry of one of them is answered, never applied again)."""
    return {op.op_id for op in own_ops(ops) if op.op_id}


def own_op_fps(ops: Sequence[Op]) -> dict[str, str]:
    """op id -> the fingerprint logged with it ("" for an op logged before fingerprints), of the session's own ops."""
    return {op.op_id: op.op_fp for op in own_ops(ops) if op.op_id}


def call_fingerprint(verb: str, *args: object) -> str:
    """The fingerprint of one mutating call: its verb (the SessionKernel / KernelFleet method) and a hash of
    the arguments that say what it does (token ids and role, a blob ref, a count, a piece and a mode), never
    its op id. The host stamps it on every op the call logs; the controller computes the same for the same
    call (`controller/session_calls.py` `_logged`), so both refuse an op id reused for another call.

    NOTE: token ids are hashed as little-endian int64s, not as JSON: 1 ms for 32k ids (JSON: 3.6 ms), on the
    host's event loop.
    """
    h = hashlib.sha256(b"kvfleet-op-fp-v1\0" + verb.encode())
    for a in args:
        if a is None:
            h.update(b"\0n")
        elif isinstance(a, str):
            b = a.encode()
            h.update(b"\0s%d:" % len(b) + b)
        elif isinstance(a, numbers.Integral):  # numpy's ints too: the same count, the same fingerprint
            h.update(b"\0i%d" % int(a))
        else:
            try:
                ids = array("q", cast("Iterable[int]", a))  # token ids (anything else: the except)
            except (TypeError, ValueError, OverflowError):  # not token ids: the call itself refuses them
                h.update(b"\0r" + repr(a).encode())
                continue
            if sys.byteorder == "big":
                ids.byteswap()
            h.update(b"\0l%d:" % len(ids) + ids.tobytes())
    return h.hexdigest()[:32]


def check_op_reuse(op_id: str, logged_fp: str, op_fp: str) -> None:
    """Refuse a call under an op id the log holds for a different call (its fingerprint differs): answering it
    as a retry would acknowledge what was never applied. An op logged without a fingerprint (an older log),
    or a call without one, is not checked.

    Raises:
        AlreadyExists: the op id was logged by a different call; nothing is applied.
    """
    if logged_fp and op_fp and logged_fp != op_fp:
        raise AlreadyExists(f"op_id {op_id!r} was already used for a different call in this session; "
                            "use a new op_id (a retry must repeat the same call)")


def last_index_of(ops: Sequence[Op], op_id: str) -> int | None:
    """The index of the last op written under `op_id` (a fork may reuse its parent's ids for its own)."""
    return next((i for i in range(len(ops) - 1, -1, -1) if ops[i].op_id == op_id), None)


def num_tokens(ops: Iterable[Op]) -> int:
    """The tokens the log leaves in the session's KV cache: appended minus evicted."""
    n = 0
    for op in ops:
        if isinstance(op, AppendOp):
            n += op.length
        elif isinstance(op, EvictOp):
            n -= op.length
    return max(0, n)


HISTORY_OP_CHARGE = 16  # tokens charged per logged append on top of its own: one op's JSON is ~80 bytes


def history_charge(num_tokens: int) -> int:
    """What one logged append of `num_tokens` tokens costs against the controller's history quota."""
    return num_tokens + HISTORY_OP_CHARGE


def history_tokens(ops: Iterable[Op]) -> int:
    """What the log holds, as the controller's history quota charges it: every append, evicted ones
    included (evictions, quarantines and fork markers are bounded by the appends and the blobs, and
    charged nothing)."""
    return sum(history_charge(op.length) for op in ops if isinstance(op, AppendOp))


def blob_refs(ops: Iterable[Op]) -> list[tuple[str, str]]:
    """(ref, tenant) of every logged tool result: each holds a reference on its blob while the log lives."""
    return [(op.ref, op.tenant) for op in ops if isinstance(op, AppendOp) and op.ref is not None]


def exact_tokens(ops: Iterable[Op]) -> int:
    """How many leading tokens of the log's KV are what a prefill of their ids stores (the kernel's
    `Session.num_exact_tokens`, read from the log): a reposition eviction with survivors stops it at its span's
    start (as on a deep model); an append, or an eviction that recomputes from its start (exact mode) or
    re-derives the last token left (a tail), moves it to the end again when it starts at or before it."""
    n = exact = 0
    for op in ops:
        if isinstance(op, AppendOp):
            exact, n = (n + op.length if exact >= n else exact), n + op.length
        elif isinstance(op, EvictOp):
            end, left = op.start + op.length, n - op.length
            if end < n and op.mode != "exact":
                exact = min(exact, op.start)
            else:  # recomputed from op.start (a tail: from op.start - 1, the last token it keeps)
                exact = left if exact >= min(op.start, left - 1) else min(exact, left)
            n = left
    return exact


def kv_follows_tokens(ops: Sequence[Op]) -> bool:
    """Whether the log's KV is a function of its final tokens alone (so a fork may adopt its parent's
    blocks): every token exact (`exact_tokens`). NOTE: it was "no reposition eviction in the log", a second rule
    beside exact_tokens that stayed false after a later eviction recomputed the re-rotated survivors (or a tail
    reposition, which keeps none), where the kernel's cache is a prefill's again."""
    return exact_tokens(ops) == num_tokens(ops)


def _opt(v: object) -> str | None:
    return None if v is None else str(v)
