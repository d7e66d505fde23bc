"""What one session actor hosts: a SessionContext (kernel session + piece ledger + op log).

The context writes every op through `sink` before applying it (write-ahead); `SessionContext.replay`
rebuilds it bit-identically from the log. This module adds two things the shell needs and the pure
context does not know about:

  * adoption: a new session may start from shared prefix blocks (Ray object store, copy-on-write);
    its first piece then appends only the tokens the adopted prefix lacks. The op logged is the
    whole piece, so a replay prefills everything and lands on the same bytes (batch invariance);
  * fork sharing: a fork replays its log over the parent's adopted blocks, computing only the
    tokens past them (`SessionContext.replay_over`); its log is still the whole history, so a
    regeneration replays everything and lands on the same bytes;
  * op ids: every op carries the caller's `op_id`, so a retry after a crash is answered, not
    applied twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleet.context import Piece, SessionContext
from fleet.errors import FailedPrecondition, InvalidArgument
from fleet.kernel import Kernel, PrefixKV
from fleet.session_types import check_token_ids


class AdoptingContext(SessionContext):
    """A SessionContext whose session may already hold adopted prefix blocks before its first piece."""

    def _apply_append(self, op: dict[str, Any], tokens: list[int]) -> Piece:
        n = len(self.session)
        if self.pieces or n == 0:
            return super()._apply_append(op, tokens)
        tokens = check_token_ids(tokens, self.kernel.config.vocab_size)
        if n >= len(tokens) or list(self.session.tokens) != tokens[:n]:
            raise InvalidArgument("the adopted prefix must be a strict prefix of the first piece")
        if "tokens" in op:
            op["tokens"] = tokens
        self._log(op)
        self.session.append(tokens[n:])                  # only what the shared blocks lack
        piece = Piece(op["piece"], op["kind"], 0, len(tokens), op["tenant"], tuple(tokens), op.get("ref"),
                      op.get("role"))
        self.pieces.append(piece)
        return piece


class SessionHost:
    """The context of one session plus the op ids already in its log.

    Args:
        sink: writes one op durably (the store's op log) and returns its index.
        store: the BlobStore (tool-result bytes, quarantine verdicts).
    """

    def __init__(self, kernel: Kernel, tokenizer: Any, tenant: str, session_id: str,
                 sink: Callable[[dict[str, Any]], int], store: Any = None) -> None:
        self.kernel, self.tokenizer, self.tenant, self.session_id = kernel, tokenizer, tenant, session_id
        self._sink, self.store = sink, store
        self.ctx: SessionContext | None = None
        self.op_ids: set[str] = set()
        self.op_id = ""                 # the op id stamped on the ops of the call in progress
        self.last_op_index: int | None = None
        self.num_adopted_tokens = 0

    def _write(self, op: dict[str, Any]) -> None:
        if self.op_id:
            op["op_id"] = self.op_id
        self.last_op_index = self._sink(op)
        if self.op_id:
            self.op_ids.add(self.op_id)

    def create(self, tokens: list[int], prefix: PrefixKV | None = None) -> Piece:
        """The first piece: the system prompt's `tokens` (already encoded), over adopted shared
        blocks when `prefix` is given."""
        if self.ctx is not None:
            raise FailedPrecondition(f"session {self.session_id} already has a context")
        ctx = AdoptingContext(self.kernel.session(prefix=prefix), self.tokenizer, self.tenant, self.session_id,
                              self._write, self.store)
        piece = ctx.add_system_tokens(tokens)
        self.ctx, self.num_adopted_tokens = ctx, len(prefix.tokens) if prefix is not None else 0
        return piece

    def replay(self, ops: list[dict[str, Any]], prefix: PrefixKV | None = None) -> None:
        """Rebuild the context from its op log (regeneration, forks); nothing is written.

        With `prefix` (a fork sharing its parent's blocks) the session adopts them copy-on-write
        and computes only the tokens past them (`SessionContext.replay_over`); a log whose KV is
        not a function of its tokens (a reposition eviction), or a prefix that does not match
        it, falls back to a full replay. Either way the cache is bit-identical to the replay's.
        """
        def fetch(ref: str) -> bytes:
            return bytes(self.store.get(ref, self.tenant))

        ctx: SessionContext | None = None
        if prefix is not None:
            try:
                ctx = AdoptingContext.replay_over(ops, self.kernel.session(prefix=prefix), self.tokenizer, fetch,
                                                  self.tenant, self.session_id)
                self.num_adopted_tokens = prefix.num_tokens
            except (FailedPrecondition, InvalidArgument):
                ctx = None
        if ctx is None:
            ctx = AdoptingContext.replay(ops, self.kernel, self.tokenizer, fetch, self.tenant, self.session_id)
            self.num_adopted_tokens = 0
        ctx.sink, ctx.store = self._write, self.store
        self.ctx = ctx
        # op ids are the session's own: a fork's log starts with its parent's ops, whose ids are not its
        forked = max((i for i, op in enumerate(ops) if op.get("op") == "fork"), default=-1)
        self.op_ids = {str(op["op_id"]) for op in ops[forked + 1:] if op.get("op_id")}

    @property
    def context(self) -> SessionContext:
        if self.ctx is None:
            raise FailedPrecondition(f"session {self.session_id} has no state yet")
        return self.ctx
