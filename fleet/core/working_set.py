"""The queryable working set (DESIGN §8): what a session's next context would reuse, prefill or drop.

Pure core (no ray, grpc, redis or zmq). Pieces are walked in context order; the pieces taken so far
form the context being built, and a piece's KV is reusable only if it sits exactly where that
context puts it, after reusable pieces only (a causal model: every token attended to all before it).

    HIT        KV resident and valid at this position: reused, costs nothing
    FAULT      not resident; the bytes/tokens are available (CAS or ledger): costs a prefill
    RECOMPUTE  KV existed but is invalid: cache lost, or positions shifted (a reposition eviction,
               or an earlier piece that is dropped or re-prefilled): costs a prefill
    REFUSE     the policy excludes it: quarantined, another tenant's
    ABSTAIN    cannot decide or does not fit: blob missing from the store, over the token budget

```
    ledger:   | sys HIT | msg HIT | tool (evicted) FAULT | msg (was resident) RECOMPUTE | tool(q) REFUSE |
    context:  |<-- reused ------->|<------------ prefilled ----------------------------->|
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from fleet.core.context import EVICTED, QUARANTINED, RESIDENT, SHIFTED, Piece, SessionContext
from fleet.core.errors import InvalidArgument

HIT, FAULT, RECOMPUTE, REFUSE, ABSTAIN = "HIT", "FAULT", "RECOMPUTE", "REFUSE", "ABSTAIN"


class Item(NamedTuple):
    piece: Piece
    verdict: str
    reason: str


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """One verdict per piece, and the totals: tokens reused (HIT) vs tokens to prefill (FAULT, RECOMPUTE)."""

    items: tuple[Item, ...]
    tokens_reused: int
    tokens_to_prefill: int

    def verdicts(self) -> list[str]:
        return [i.verdict for i in self.items]


class Policy(Protocol):
    """One-method strategy: a reason to exclude a piece from the context, or None."""

    def excludes(self, piece: Piece, ctx: SessionContext) -> str | None: ...


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """The default policy: only `tenant`'s pieces; never quarantined blobs."""

    tenant: str

    def excludes(self, piece: Piece, ctx: SessionContext) -> str | None:
        if piece.tenant != self.tenant:
            return f"belongs to another tenant ({piece.tenant!r}, context is {self.tenant!r})"
        if piece.state == QUARANTINED or (piece.ref is not None and piece.ref in ctx.quarantined):
            return f"quarantined ({', '.join(ctx.quarantined.get(piece.ref or '', [])) or 'verdict on record'})"
        return None


def working_set(ctx: SessionContext, budget_tokens: int, policy: Policy | None = None,
                store: Any = None) -> WorkingSet:
    """Classify each piece of `ctx` for the next context of at most `budget_tokens` tokens.

    Args:
        ctx: the session context.
        budget_tokens: the most tokens the context may hold (pieces beyond it ABSTAIN).
        policy: excludes pieces (REFUSE); defaults to `TenantPolicy(ctx.tenant)`.
        store: a BlobStore, consulted for tool-result bytes (FAULT vs ABSTAIN) and quarantine verdicts.

    Returns:
        WorkingSet(items, tokens_reused, tokens_to_prefill).
    """
    if not isinstance(budget_tokens, int) or budget_tokens < 0:
        raise InvalidArgument(f"budget_tokens must be a non-negative int, got {budget_tokens!r}")
    policy = policy or TenantPolicy(ctx.tenant)
    items: list[Item] = []
    used, reusable = 0, True  # tokens taken so far; whether every taken piece so far is a HIT in place
    for p in ctx.pieces:
        verdict, reason = _classify(ctx, p, policy, store, at=used, prefix_ok=reusable)
        if verdict in (HIT, FAULT, RECOMPUTE) and used + p.length > budget_tokens:
            verdict, reason = ABSTAIN, f"over budget ({used} + {p.length} > {budget_tokens} tokens)"
        if verdict in (HIT, FAULT, RECOMPUTE):
            used += p.length
            reusable = reusable and verdict == HIT
        elif ctx.is_resident(p) or p.state == SHIFTED:
            reusable = False  # a dropped piece still in the KV: everything after it attended to it
        items.append(Item(p, verdict, reason))
    reused = sum(i.piece.length for i in items if i.verdict == HIT)
    prefill = sum(i.piece.length for i in items if i.verdict in (FAULT, RECOMPUTE))
    return WorkingSet(tuple(items), reused, prefill)


def _classify(ctx: SessionContext, p: Piece, policy: Policy, store: Any, at: int, prefix_ok: bool) -> tuple[str, str]:
    if (why := policy.excludes(p, ctx)) is not None:
        return REFUSE, why
    if (why := _store_refuses(p, store, ctx)) is not None:
        return REFUSE, why
    if ctx.is_resident(p) and prefix_ok and p.start == at:
        return HIT, f"KV resident at [{p.start}, {p.end})"
    if (missing := _bytes_missing(p, store, ctx)) is not None:
        return ABSTAIN, missing
    if p.state == RESIDENT and not ctx.is_resident(p):  # the ledger says resident, the session lacks it
        return RECOMPUTE, "KV cache lost"
    if p.state == SHIFTED:
        return RECOMPUTE, "positions shifted by a reposition eviction (layer>=1 KV still carries the evicted span)"
    if p.state == RESIDENT:
        return RECOMPUTE, f"positions shifted: resident at {p.start}, the context puts it at {at} after a prefill"
    assert p.state == EVICTED, p
    return FAULT, "not resident; " + ("bytes in CAS" if p.ref else "tokens in the ledger") + "; costs prefill"


def _store_refuses(p: Piece, store: Any, ctx: SessionContext) -> str | None:
    if store is None or p.ref is None or not store.exists(p.ref, p.tenant):
        return None
    meta = store.stat(p.ref, p.tenant)
    return f"quarantined ({', '.join(meta.reasons)})" if meta.quarantined else None


def _bytes_missing(p: Piece, store: Any, ctx: SessionContext) -> str | None:
    """Tool results are rebuilt from the CAS: without the blob nothing can be prefilled."""
    if p.ref is None or ctx.is_resident(p):
        return None
    if store is None:
        return "cannot decide: no store to fetch the blob from"
    return None if store.exists(p.ref, p.tenant) else f"blob {p.ref[:12]}... missing from the store"
