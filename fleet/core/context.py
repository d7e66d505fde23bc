"""SessionContext: a kernel Session plus the ledger of the pieces its context is made of, and its op log.

Pure core (no ray, grpc, redis or zmq). The ledger says which token span of the KV cache holds which
piece (system prompt, message, tool result by CAS ref, model output):

```
    KV positions:  0 ........ 12 ............... 40 ............. 97 ...... 110
    pieces:        | system #0 | message #1 (user) | tool_result #2 | output #3 |
                                                    ref=ab12..., tenant=acme
```

Every mutation is one typed op (fleet/core/oplog.py: `AppendOp`, `EvictOp`, `QuarantineOp`, `ForkOp`), stamped
with the call's `op_id` and handed to `sink` (the shell writes it to `store.oplog_append`) BEFORE it is
applied, then recorded in `ops`. `SessionContext.replay(ops, ...)` rebuilds a context whose cache is
bit-identical (equal `digest()`). A child's log is the parent's first `at` ops + a `ForkOp(parent, at)`.

The ledger's entries (`Piece`, its states) are in fleet/core/pieces.py; `replay_over`'s replay of the ledger
without the kernel is in fleet/core/ledger.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fleet.core import verdict
from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.ledger import logged_tokens, replay_ledger
from fleet.core.oplog import AppendOp, EvictOp, ForkOp, Op, QuarantineOp
from fleet.core.pieces import EVICTED, QUARANTINED, RESIDENT, SHIFTED, Piece, Tokenizer, drop
from fleet.core.session_types import EvictionProof, check_token_ids

if TYPE_CHECKING:
    from fleet.core.kernel import EvictReport, Kernel, Session

# the ledger's entries live in pieces.py; importers of context.py still find them here
__all__ = ["EVICTED", "QUARANTINED", "RESIDENT", "SHIFTED", "Piece", "SessionContext", "Tokenizer"]


class SessionContext:
    """A kernel session with its piece ledger and op log (see module docstring)."""

    def __init__(self, session: Session, tokenizer: Tokenizer, tenant: str = "default", session_id: str = "s0",
                 sink: Callable[[Op], object] | None = None, store: Any = None) -> None:
        self.session, self.tokenizer, self.tenant, self.session_id = session, tokenizer, tenant, session_id
        self.sink, self.store = sink, store  # store: optional BlobStore, consulted for quarantine verdicts
        self.op_id = ""  # stamped on the ops the call in progress writes (the shell sets it per call)
        self.op_fp = ""  # and its fingerprint (oplog.call_fingerprint), likewise
        self.pieces: list[Piece] = []
        self.live: list[int] = []  # indices in `pieces` of those in the KV cache (resident or shifted), in order
        self.ops: list[Op] = []
        self.quarantined: dict[str, list[str]] = {}  # refs held out: logged, or learned from the store on a refusal
        self.logged_quarantines: dict[str, tuple[str, ...]] = {}  # what the log's quarantine ops say, per ref
        self.proofs: list[EvictionProof] = []  # quarantine evictions (fleet/core/quarantine/admit.py)

    @classmethod
    def new(cls, kernel: Kernel, tokenizer: Tokenizer, tenant: str = "default", session_id: str = "s0",
            sink: Callable[[Op], object] | None = None, store: Any = None) -> SessionContext:
        return cls(kernel.session(), tokenizer, tenant, session_id, sink, store)

    @property
    def kernel(self) -> Kernel:
        return self.session.kernel

    # ---- appends ------------------------------------------------------------------------------------
    def add_system(self, text: str) -> Piece:
        """Append a system prompt piece."""
        return self.add_system_tokens(encode_message(self.tokenizer, "system", _text(text)))

    def add_system_tokens(self, tokens: list[int]) -> Piece:
        """Append a system prompt piece already encoded (`encode_message(tokenizer, "system", text)`),
        e.g. by the caller that placed the session on the prompt's tokens: it is not encoded again."""
        return self._append_tokens("system", list(tokens), role="system")

    def add_message(self, role: str, text: str) -> Piece:
        """Append a chat message piece (`role` e.g. user / assistant)."""
        return self.add_message_tokens(role, encode_message(self.tokenizer, _role(role), _text(text)))

    def add_message_tokens(self, role: str, tokens: list[int]) -> Piece:
        """Append a chat message piece already encoded (`encode_message(tokenizer, role, text)`), e.g. by
        the edge that counted its tokens against a quota: it is not encoded again."""
        return self._append_tokens("message", list(tokens), role=_role(role))

    def add_output(self, token_ids: list[int]) -> Piece:
        """Append model output (token ids the session generated)."""
        return self._append_tokens("output", list(token_ids))

    def generate(self, n: int) -> Piece:
        """Greedy-decode `n` tokens on a scratch fork, then append them as one output piece."""
        branch = self.session.fork()
        try:
            ids = branch.generate(n)
        finally:
            branch.close()
        return self.add_output(ids)

    def add_tool_result(self, ref: str, data: bytes, tenant: str | None = None) -> Piece:
        """Append a tool result (its bytes, which must hash to `ref`); quarantined refs are refused.

        Raises:
            InvalidArgument: the bytes do not hash to `ref`.
            FailedPrecondition: `ref` is quarantined (held out of every context).
        """
        if not isinstance(data, bytes | bytearray) or hashlib.sha256(data).hexdigest() != ref:
            raise InvalidArgument(f"tool result bytes do not hash to ref {ref!r}")
        self._refuse_quarantined(ref)
        tokens = self.tokenizer.encode(bytes(data))
        op = AppendOp(len(self.pieces), "tool_result", tenant or self.tenant, ref=ref, num_tokens=len(tokens),
                      op_id=self.op_id, op_fp=self.op_fp)
        return self._apply_append(op, tokens)

    def _append_tokens(self, kind: str, tokens: list[int], role: str | None = None) -> Piece:
        op = AppendOp(len(self.pieces), kind, self.tenant, (), role=role, op_id=self.op_id,
                      op_fp=self.op_fp)  # tokens: checked below
        return self._apply_append(op, tokens)

    def _apply_append(self, op: AppendOp, tokens: list[int]) -> Piece:
        """Check, log, then apply one append op whose piece holds `tokens`.

        A session that adopted shared prefix blocks (`Kernel.session(prefix=...)`) before its
        first piece holds that piece's first tokens already: only the rest is computed. The op
        logged is the whole piece, so a replay prefills everything and lands on the same bytes
        (batch invariance).
        """
        tokens = check_token_ids(tokens, self.kernel.config.vocab_size)
        held = tuple(tokens)  # one tuple for the op and the piece: the ledger holds each id once
        if op.tokens is not None:
            op = dataclasses.replace(op, tokens=held)
        n = 0 if self.pieces else len(self.session)  # tokens adopted before the first piece
        if n and (n >= len(tokens) or self.session.tokens != tokens[:n]):
            raise InvalidArgument("the adopted prefix must be a strict prefix of the first piece")
        self.session.check_append(tokens[n:])  # NOTE: before the log: a refused append must leave no op behind
        self.log_op(op)
        self.session.append(tokens[n:])
        piece = Piece(op.piece, op.kind, len(self.session) - len(tokens), len(tokens), op.tenant,
                      held, op.ref, op.role)
        self.pieces.append(piece)
        self.live.append(len(self.pieces) - 1)
        return piece

    # ---- eviction, quarantine, fork ---------------------------------------------------------------------
    def evict_piece(self, piece_id: int, mode: str = "exact", reason: str = "evict") -> EvictReport:
        """Drop a resident piece's tokens from the KV cache; later pieces move down.

        Args:
            piece_id: the piece.
            mode: "exact" (survivors re-derived: bit-identical to never-saw) or "reposition"
                (survivors re-rotated; marked `shifted` unless the kernel reports exactness).
            reason: recorded in the op ("evict", "quarantine", ...).
        """
        p = self.piece(piece_id)
        if not isinstance(mode, str) or mode not in ("exact", "reposition"):  # an array passed `in` (the kernel's too)
            raise InvalidArgument(f"evict mode must be 'exact' or 'reposition', got {mode!r}")
        if p.state not in (RESIDENT, SHIFTED):
            raise FailedPrecondition(f"piece {piece_id} is {p.state}, not in the KV cache")
        self.log_op(EvictOp(piece_id, p.start, p.length, mode, reason, self.op_id, self.op_fp))
        report = self.session.evict(p.start, p.length, mode)
        # the survivors are what a prefill stores only when the kernel says the whole cache is (report.exact)
        drop(self.pieces, self.live, piece_id, QUARANTINED if reason == "quarantine" else EVICTED,
             lambda q: RESIDENT if report.exact else SHIFTED)
        if report.exact:
            self._unshift()
        return report

    def _unshift(self) -> None:
        """Every piece in the KV cache is resident: the kernel says all of it is what a prefill stores.

        NOTE: a tail eviction re-derives the last token it keeps; when that token was the only one a reposition
        had shifted (a 1-token piece), the cache is a prefill's again (exact=True, the digest a fresh prefill's) but
        the piece stayed `shifted`, and the working set answered RECOMPUTE for KV it could reuse."""
        for i in self.live:
            if self.pieces[i].state == SHIFTED:
                self.pieces[i] = dataclasses.replace(self.pieces[i], state=RESIDENT)

    def quarantine(self, ref: str, reasons: list[str]) -> None:
        """Hold `ref` out of this context from now on (recorded in the op log)."""
        self.log_op(QuarantineOp(ref, tuple(reasons), self.op_id, self.op_fp))
        self.quarantined[ref] = list(reasons)
        self.logged_quarantines[ref] = tuple(reasons)

    def fork(self, session_id: str, sink: Callable[[Op], object] | None = None) -> SessionContext:
        """A copy-on-write branch with its own ledger; its op log starts with the parent's ops."""
        child = SessionContext(self.session.fork(), self.tokenizer, self.tenant, session_id, sink, self.store)
        child.pieces, child.live, child.quarantined = list(self.pieces), list(self.live), dict(self.quarantined)
        child.logged_quarantines = dict(self.logged_quarantines)
        for op in self.ops:
            child.log_op(op)
        child.log_op(ForkOp(self.session_id, len(self.ops)))
        return child

    # ---- queries ----------------------------------------------------------------------------------------
    def piece(self, piece_id: int) -> Piece:
        # NOTE: a bool is an int to isinstance: evict(piece_id=True) evicted piece 1
        if isinstance(piece_id, bool) or not isinstance(piece_id, int) or not 0 <= piece_id < len(self.pieces):
            raise NotFound(f"no piece {piece_id!r} in session {self.session_id!r}")
        return self.pieces[piece_id]

    def is_resident(self, p: Piece) -> bool:
        """The piece's tokens sit at its span in the live session (and it is marked resident)."""
        toks = self.session.tokens
        return p.state == RESIDENT and p.end <= len(toks) and tuple(toks[p.start:p.end]) == p.tokens

    def digest(self) -> str:
        return self.session.digest()

    # ---- op log -----------------------------------------------------------------------------------------
    def log_op(self, op: Op) -> None:
        """Hand `op` to the sink, then record it in `ops` (fleet/core/ledger.py logs a replayed fork with it)."""
        if self.sink is not None:
            self.sink(op)  # durable before the op is applied (write-ahead)
        self.ops.append(op)

    def _refuse_quarantined(self, ref: str) -> None:
        """Refuse `ref` if this session quarantined it, the tenant's blob of it is, or an operator quarantined its
        bytes (SetVerdict, for every tenant). NOTE: the operator's verdict was not asked: bytes it had quarantined
        entered the cache until the tenant's own AdmitToolResult evicted them, while the proxy withheld them (review
        finding). It is read at each add, not kept: an operator may drop it. An operator's CLEAN does not lift the
        session's or the blob's own quarantine here (this refuses; it does not admit)."""
        if ref not in self.quarantined and self.store is not None and self.store.exists(ref, self.tenant):
            meta = self.store.stat(ref, self.tenant)
            if meta.quarantined:
                self.quarantined[ref] = list(meta.reasons)
        if ref in self.quarantined:
            raise FailedPrecondition(f"blob {ref} is quarantined ({', '.join(self.quarantined[ref])}); "
                                     "it is held out of every context")
        raw = self.store.kv_get(verdict.OPERATOR_NS, ref) if self.store is not None else None
        if raw is not None and (op := json.loads(raw)).get("verdict") == verdict.QUARANTINED:
            raise FailedPrecondition(f"blob {ref} is quarantined by an operator ({', '.join(op.get('reasons') or [])}); "
                                     "it is held out of every context")

    @classmethod
    def replay(cls, ops: list[Op], kernel: Kernel, tokenizer: Tokenizer,
               fetch: Callable[[str], bytes], tenant: str = "default", session_id: str = "s0") -> SessionContext:
        """Rebuild a context from its op log; the cache is bit-identical to the original's.

        Args:
            ops: the op log (`oplog.parse_log` of what the store holds).
            kernel, tokenizer: the same model and tokenizer as the original.
            fetch: ref -> bytes (e.g. `lambda r: store.get(r, tenant)`), for tool-result appends.
        """
        ctx = cls.new(kernel, tokenizer, tenant, session_id)
        for op in ops:
            ctx._replay_one(op, fetch)
        return ctx

    def _replay_one(self, op: Op, fetch: Callable[[str], bytes]) -> None:
        self.op_id, self.op_fp = op.op_id, op.op_fp  # a replayed op keeps the id (and fingerprint) it was logged under
        if isinstance(op, AppendOp):
            self._apply_append(op, logged_tokens(self.tokenizer, op, fetch))
        elif isinstance(op, EvictOp):
            self.evict_piece(op.piece, op.mode, op.reason)
        elif isinstance(op, QuarantineOp):
            self.quarantine(op.ref, list(op.reasons))
        elif isinstance(op, ForkOp):
            self.log_op(op)
        else:
            raise InvalidArgument(f"replay: unknown op {op!r}")
        self.op_id = self.op_fp = ""


    # ---- replay over an adopted prefix (a fork sharing its parent's blocks) ---------------------------
    @classmethod
    def replay_over(cls, ops: list[Op], session: Session, tokenizer: Tokenizer,
                    fetch: Callable[[str], bytes], tenant: str = "default",
                    session_id: str = "s0") -> SessionContext:
        """Rebuild a context from its op log over a session that already holds adopted blocks.

        The ledger (pieces, quarantines, ops) is replayed without the kernel; the session, which
        adopted a block-aligned prefix of the log's final tokens (`Kernel.session(prefix=...)`),
        then computes only the tokens past that prefix. Bit-identical to `replay` whenever the
        log's KV is a function of its tokens alone (appends, exact evictions, tail evictions):
        the kernel is batch-invariant, so the adopted blocks equal what a replay would compute.

        ```
            log:       append append evict(exact) append ... fork    -> final tokens T (n of them)
            session:   | adopted blocks: T[0:m] (no compute) | T[m:n] appended here (m < n) |
        ```

        Args:
            ops: the op log.
            session: a session holding exactly T[0:m] for some m < n (m = 0 allowed).
            tokenizer, fetch, tenant, session_id: as for `replay`.

        A log that leaves no tokens (every piece evicted) gives the empty session it had.

        Raises:
            FailedPrecondition: the log holds a reposition eviction with survivors (their KV is
                not a function of the tokens: use `replay`), or the session's tokens are not a
                strict prefix of the log's final tokens. Nothing is computed in either case.
            InvalidArgument, ResourceExhausted: a logged piece the op-by-op replay would refuse
                (no ids, ids outside the vocabulary, past the context), as it would.
        """
        ctx = cls(session, tokenizer, tenant, session_id)
        toks = replay_ledger(ctx, ops, fetch)  # the ledger alone (fleet/core/ledger.py)
        m = len(session)
        if m == len(toks) == 0:  # NOTE: before, an emptied session fell back to the op-by-op replay of its history
            return ctx
        if m >= len(toks) or list(session.tokens) != toks[:m]:
            raise FailedPrecondition(f"replay_over: the session's {m} tokens are not a strict prefix of the "
                                     f"log's {len(toks)} tokens")
        session.append(toks[m:])  # only what the adopted blocks lack (>= 1 token: own last logits)
        return ctx


def _role(role: object) -> str:
    if not isinstance(role, str) or not role:
        raise InvalidArgument(f"role must be a non-empty str, got {role!r}")
    return role


def _text(text: object) -> str:
    if not isinstance(text, str):
        raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
    return text
