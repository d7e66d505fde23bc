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
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from fleet.core.kernel.pacing import checkpoint
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import KINDS, AppendOp, EvictOp, ForkOp, Op, QuarantineOp
from fleet.core.session_types import EvictionProof, check_token_ids

if TYPE_CHECKING:
    from fleet.core.kernel import EvictReport, Kernel, Session

RESIDENT, EVICTED, QUARANTINED, SHIFTED = "resident", "evicted", "quarantined", "shifted"
LEDGER_OPS_PER_CHECKPOINT = 128  # ops the ledger replays between two yield points (about 2 ms)


class Tokenizer(Protocol):
    def encode(self, text: str | bytes) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """One ledger entry. `start`/`length` locate its tokens in the KV cache while it is resident.

    state: resident (KV valid) | evicted (dropped, bytes elsewhere) | quarantined (held out) |
           shifted (a reposition eviction moved it; its layer>=1 KV still carries the evicted span).
           A resident piece whose tokens the live session no longer holds at its span reads as
           "KV cache lost" in the working set (`is_resident`); no state marks it (docs/kernel.md).
    """

    piece_id: int
    kind: str
    start: int
    length: int
    tenant: str
    tokens: tuple[int, ...]
    ref: str | None = None
    role: str | None = None
    state: str = RESIDENT

    def __post_init__(self) -> None:
        assert self.kind in KINDS and self.length == len(self.tokens), self

    @property
    def end(self) -> int:
        return self.start + self.length


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
        self._log(op)
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
        if mode not in ("exact", "reposition"):
            raise InvalidArgument(f"evict mode must be 'exact' or 'reposition', got {mode!r}")
        if p.state not in (RESIDENT, SHIFTED):
            raise FailedPrecondition(f"piece {piece_id} is {p.state}, not in the KV cache")
        self._log(EvictOp(piece_id, p.start, p.length, mode, reason, self.op_id, self.op_fp))
        report = self.session.evict(p.start, p.length, mode)
        # exact mode re-derived the survivors; reposition keeps them exact only if the kernel says so
        self._drop(piece_id, QUARANTINED if reason == "quarantine" else EVICTED,
                   lambda q: RESIDENT if report.exact and mode == "exact" else q.state if report.exact else SHIFTED)
        return report

    def _drop(self, index: int, gone: str, survivor: Callable[[Piece], str]) -> None:
        """Mark `pieces[index]` (in the KV cache) `gone`, and move the pieces after it in the cache down by its
        length, each in the state `survivor(piece)`. NOTE: only the pieces in the cache are visited (`live`): every
        piece ever appended was, evicted ones included, so a log of n appends and evictions cost O(n^2) to replay
        (100,000 pairs: 408 s for a rebuild on a host; tests/fleet/test_context_evict_cost.py)."""
        p = self.pieces[index]
        self.pieces[index] = dataclasses.replace(p, state=gone)
        at = bisect.bisect_left(self.live, index)
        assert self.live[at] == index, (index, self.live[at:at + 1])
        for i in self.live[at + 1:]:
            q = self.pieces[i]
            self.pieces[i] = dataclasses.replace(q, start=q.start - p.length, state=survivor(q))
        del self.live[at]

    def quarantine(self, ref: str, reasons: list[str]) -> None:
        """Hold `ref` out of this context from now on (recorded in the op log)."""
        self._log(QuarantineOp(ref, tuple(reasons), self.op_id, self.op_fp))
        self.quarantined[ref] = list(reasons)
        self.logged_quarantines[ref] = tuple(reasons)

    def fork(self, session_id: str, sink: Callable[[Op], object] | None = None) -> SessionContext:
        """A copy-on-write branch with its own ledger; its op log starts with the parent's ops."""
        child = SessionContext(self.session.fork(), self.tokenizer, self.tenant, session_id, sink, self.store)
        child.pieces, child.live, child.quarantined = list(self.pieces), list(self.live), dict(self.quarantined)
        child.logged_quarantines = dict(self.logged_quarantines)
        for op in self.ops:
            child._log(op)
        child._log(ForkOp(self.session_id, len(self.ops)))
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
    def _log(self, op: Op) -> None:
        if self.sink is not None:
            self.sink(op)  # durable before the op is applied (write-ahead)
        self.ops.append(op)

    def _refuse_quarantined(self, ref: str) -> None:
        if ref not in self.quarantined and self.store is not None and self.store.exists(ref, self.tenant):
            meta = self.store.stat(ref, self.tenant)
            if meta.quarantined:
                self.quarantined[ref] = list(meta.reasons)
        if ref in self.quarantined:
            raise FailedPrecondition(f"blob {ref} is quarantined ({', '.join(self.quarantined[ref])}); "
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
            self._apply_append(op, self._logged_tokens(op, fetch))
        elif isinstance(op, EvictOp):
            self.evict_piece(op.piece, op.mode, op.reason)
        elif isinstance(op, QuarantineOp):
            self.quarantine(op.ref, list(op.reasons))
        elif isinstance(op, ForkOp):
            self._log(op)
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
        toks: list[int] = []
        for i, op in enumerate(ops):
            if i % LEDGER_OPS_PER_CHECKPOINT == 0:
                # NOTE: a yield point, as the kernel's per layer (kernel/pacing.py): a long log's ledger (3 s for
                # 200,000 ops) ran with none, so the host's CPU share could not hold its tenant back for another's
                checkpoint()
            ctx._ledger_one(op, fetch, toks)
        m = len(session)
        if m == len(toks) == 0:  # NOTE: before, an emptied session fell back to the op-by-op replay of its history
            return ctx
        if m >= len(toks) or list(session.tokens) != toks[:m]:
            raise FailedPrecondition(f"replay_over: the session's {m} tokens are not a strict prefix of the "
                                     f"log's {len(toks)} tokens")
        session.append(toks[m:])  # only what the adopted blocks lack (>= 1 token: own last logits)
        return ctx

    def _ledger_one(self, op: Op, fetch: Callable[[str], bytes], toks: list[int]) -> None:
        """Apply one op to the ledger and to `toks` (the token list), never to the kernel."""
        if isinstance(op, AppendOp):
            tokens = check_token_ids(self._logged_tokens(op, fetch), self.kernel.config.vocab_size)
            if op.piece != len(self.pieces):
                raise FailedPrecondition(f"replay: op {op!r} is out of sequence")
            if len(toks) + len(tokens) > self.kernel.config.max_context:  # as the op-by-op replay's append
                raise ResourceExhausted(f"replay: piece {op.piece} takes the session past its context of "
                                        f"{self.kernel.config.max_context} tokens")
            held = tuple(tokens)
            self.pieces.append(Piece(op.piece, op.kind, len(toks), len(tokens), op.tenant, held, op.ref, op.role))
            self.live.append(op.piece)
            toks.extend(tokens)
            self.ops.append(op if op.tokens is None else dataclasses.replace(op, tokens=held))
        elif isinstance(op, EvictOp):
            self._ledger_evict(op, toks)
        elif isinstance(op, QuarantineOp):
            self.op_id, self.op_fp = op.op_id, op.op_fp
            self.quarantine(op.ref, list(op.reasons))
            self.op_id = self.op_fp = ""
        elif isinstance(op, ForkOp):
            self._log(op)
        else:
            raise InvalidArgument(f"replay: unknown op {op!r}")

    def _ledger_evict(self, op: EvictOp, toks: list[int]) -> None:
        p = self.piece(op.piece)
        if p.state not in (RESIDENT, SHIFTED) or (p.start, p.length) != (op.start, op.length):
            raise FailedPrecondition(f"replay: evict op {op!r} does not match the ledger")
        if op.mode != "exact" and p.end != len(toks):
            raise FailedPrecondition("replay_over: a reposition eviction with survivors leaves KV that is not a "
                                     "function of the tokens; replay the log instead")
        del toks[p.start:p.end]
        self._drop(op.piece, QUARANTINED if op.reason == "quarantine" else EVICTED, lambda q: RESIDENT)  # as exact
        self.ops.append(op)  # as `replay` logs it

    def _logged_tokens(self, op: AppendOp, fetch: Callable[[str], bytes]) -> list[int]:
        """The token ids an append op added (a tool result's are re-tokenized from its bytes)."""
        if op.ref is None:
            return list(op.tokens or ())
        tokens = self.tokenizer.encode(fetch(op.ref))
        if len(tokens) != op.num_tokens:
            raise FailedPrecondition(f"replay: ref {op.ref} tokenizes to {len(tokens)} tokens, "
                                     f"the log says {op.num_tokens} (different tokenizer?)")
        return tokens


def _role(role: object) -> str:
    if not isinstance(role, str) or not role:
        raise InvalidArgument(f"role must be a non-empty str, got {role!r}")
    return role


def _text(text: object) -> str:
    if not isinstance(text, str):
        raise InvalidArgument(f"text must be a str, got {type(text).__name__}")
    return text
