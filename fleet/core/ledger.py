"""The ledger of a session's op log replayed without the kernel (SessionContext.replay_over, fleet/core/context.py):
pieces, quarantines and ops as the op-by-op replay leaves them, and the tokens the log ends with. Pure core."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from fleet.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from fleet.core.kernel.pacing import checkpoint
from fleet.core.oplog import AppendOp, EvictOp, ForkOp, Op, QuarantineOp
from fleet.core.pieces import EVICTED, QUARANTINED, RESIDENT, SHIFTED, Piece, Tokenizer, drop
from fleet.core.session_types import check_token_ids

if TYPE_CHECKING:
    from fleet.core.context import SessionContext

LEDGER_OPS_PER_CHECKPOINT = 128  # ops the ledger replays between two yield points (about 2 ms)


def replay_ledger(ctx: SessionContext, ops: list[Op], fetch: Callable[[str], bytes]) -> list[int]:
    """Apply `ops` to `ctx`'s ledger (pieces, quarantines, ops), never to its kernel session; returns the
    tokens the log leaves (SessionContext.replay_over computes those its session lacks)."""
    toks: list[int] = []
    for i, op in enumerate(ops):
        if i % LEDGER_OPS_PER_CHECKPOINT == 0:
            # NOTE: a yield point, as the kernel's per layer (kernel/pacing.py): a long log's ledger (3 s for
            # 200,000 ops) ran with none, so the host's CPU share could not hold its tenant back for another's
            checkpoint()
        _ledger_one(ctx, op, fetch, toks)
    return toks


def _ledger_one(ctx: SessionContext, op: Op, fetch: Callable[[str], bytes], toks: list[int]) -> None:
    """Apply one op to the ledger and to `toks` (the token list), never to the kernel."""
    if isinstance(op, AppendOp):
        tokens = check_token_ids(logged_tokens(ctx.tokenizer, op, fetch), ctx.kernel.config.vocab_size)
        if op.piece != len(ctx.pieces):
            raise FailedPrecondition(f"replay: op {op!r} is out of sequence")
        if len(toks) + len(tokens) > ctx.kernel.config.max_context:  # as the op-by-op replay's append
            raise ResourceExhausted(f"replay: piece {op.piece} takes the session past its context of "
                                    f"{ctx.kernel.config.max_context} tokens")
        held = tuple(tokens)
        ctx.pieces.append(Piece(op.piece, op.kind, len(toks), len(tokens), op.tenant, held, op.ref, op.role))
        ctx.live.append(op.piece)
        toks.extend(tokens)
        ctx.ops.append(op if op.tokens is None else dataclasses.replace(op, tokens=held))
    elif isinstance(op, EvictOp):
        _ledger_evict(ctx, op, toks)
    elif isinstance(op, QuarantineOp):
        ctx.op_id, ctx.op_fp = op.op_id, op.op_fp
        ctx.quarantine(op.ref, list(op.reasons))
        ctx.op_id = ctx.op_fp = ""
    elif isinstance(op, ForkOp):
        ctx.log_op(op)
    else:
        raise InvalidArgument(f"replay: unknown op {op!r}")


def _ledger_evict(ctx: SessionContext, op: EvictOp, toks: list[int]) -> None:
    p = ctx.piece(op.piece)
    if p.state not in (RESIDENT, SHIFTED) or (p.start, p.length) != (op.start, op.length):
        raise FailedPrecondition(f"replay: evict op {op!r} does not match the ledger")
    if op.mode != "exact" and p.end != len(toks):
        raise FailedPrecondition("replay_over: a reposition eviction with survivors leaves KV that is not a "
                                 "function of the tokens; replay the log instead")
    del toks[p.start:p.end]
    drop(ctx.pieces, ctx.live, op.piece, QUARANTINED if op.reason == "quarantine" else EVICTED, lambda q: RESIDENT)  # as exact
    ctx.ops.append(op)  # as `replay` logs it


def logged_tokens(tokenizer: Tokenizer, op: AppendOp, fetch: Callable[[str], bytes]) -> list[int]:
    """The token ids an append op added (a tool result's are re-tokenized from its bytes)."""
    if op.ref is None:
        return list(op.tokens or ())
    tokens = tokenizer.encode(fetch(op.ref))
    if len(tokens) != op.num_tokens:
        raise FailedPrecondition(f"replay: ref {op.ref} tokenizes to {len(tokens)} tokens, "
                                 f"the log says {op.num_tokens} (different tokenizer?)")
    return tokens
