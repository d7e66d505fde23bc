"""admit_tool_result: one verdict, two media (DESIGN §7).

QUARANTINED acts on both media:
  bytes: the blob is marked in the store (`set_verdict`) and refused by every SessionContext built
         from it (the context consults its `quarantined` set and the store);
  KV:    if its tokens were already prefilled, they are evicted, and the witness is recorded on the
         context. Tail (nothing attended to it yet): write-time eviction. Not the tail (a late verdict:
         later tokens attended to it): "exact" mode, survivors re-derived; the witness says late=True.

An admission logs a quarantine op, then one eviction op per piece (each after its never-saw reference is
prefilled): a host that fails or dies between them leaves a log whose quarantined ref is still resident. The
session's rebuild from that log finishes the admission (`finish_admissions`), and a retry under the same op id
is answered from the log (`logged_admission`), never applied twice and never answered without its verdict.

Witness (probe = a fixed query appended on scratch forks; the real session is never mutated for it):
    max|Δ| evict-vs-never  : logits after the probe, evicted session vs a session that never saw the piece
    control kept-vs-never  : the same with the piece kept; > 0 shows the probe can see the piece
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fleet.core.context import RESIDENT, SHIFTED, Piece, SessionContext
from fleet.core.errors import AlreadyExists
from fleet.core.oplog import EvictOp, QuarantineOp, own_ops
from fleet.core.quarantine.detector import Detector, Verdict
from fleet.core.session_types import EvictionProof, ToolAdmission
from fleet.core.verdict import CLEAN, QUARANTINED

if TYPE_CHECKING:
    import numpy as np

    from fleet.core.kernel import Session

DEFAULT_PROBE = "\nuser: what should I do next?\nassistant:"


def admit_tool_result(ctx: SessionContext, ref: str, store: Any, tenant: str, detector: Detector | None = None,
                      probe: str = DEFAULT_PROBE, verdict: Verdict | None = None) -> ToolAdmission:
    """Inspect the blob `ref` (or take `verdict` on it) and act on the verdict in the store and in `ctx`'s
    KV cache.

    Args:
        ctx: the session context that may hold the blob's tokens.
        ref: the blob's sha256 ref.
        store: a BlobStore (any object with get / set_verdict).
        tenant: the blob's tenant.
        detector: defaults to the shipped layered detector (`make_detector()`: its default layers, those
            installed; see docs/quarantine.md). Not used when `verdict` is given.
        probe: the query whose next-token logits the eviction proof compares.
        verdict: a verdict already reached on the blob's bytes (the controller's Judge: its configured
            layers, its per-tenant verdict cache in the store, an operator's verdict); the session runs no
            detector.

    Returns:
        ToolAdmission(verdict, reasons, evicted, proof); the proof is also appended to `ctx.proofs`.
    """
    v = verdict if verdict is not None else (detector or default_admission_detector()).inspect(store.get(ref, tenant))
    if not v.quarantined:
        store.set_verdict(ref, tenant, CLEAN, list(v.reasons))
        return ToolAdmission(CLEAN, tuple(v.reasons))
    store.set_verdict(ref, tenant, QUARANTINED, list(v.reasons))
    if ctx.logged_quarantines.get(ref) != tuple(v.reasons):  # NOTE: before, every admit of a quarantined ref
        ctx.quarantine(ref, list(v.reasons))                 # logged one more op: the log grew without bound
    proof, evicted = None, False
    # evict from the end backwards so earlier spans keep their positions while we work
    for p in sorted((p for p in ctx.pieces if p.ref == ref and p.state in (RESIDENT, SHIFTED)),
                    key=lambda p: -p.start):
        proof = _evict_with_proof(ctx, p, probe) or proof
        evicted = True
    return ToolAdmission(QUARANTINED, tuple(v.reasons), evicted=evicted, proof=proof)


def finish_admissions(ctx: SessionContext, probe: str = DEFAULT_PROBE) -> list[EvictionProof]:
    """Evict, with a proof each, every piece still resident whose ref the log quarantined: an admission whose
    quarantine op was logged and whose evictions were not (its host failed or died between the two writes).
    A rebuild runs it on the replayed context with its sink set, so the evictions are logged, each under its
    quarantine op's op id when that op is the session's own (a fork's copy of its parent's is not): a retry
    of that admission then finds its whole admission in the log. A log without one changes nothing.

    NOTE: before, such a session was rebuilt with the quarantined tokens resident, and every later token
    attended to them; the admission's retry was answered `replayed` with no verdict, from the half log.

    Returns:
        the proofs, in the order of the evictions (also appended to `ctx.proofs`).
    """
    last = {op.ref: op for op in ctx.ops if isinstance(op, QuarantineOp)}
    own = {op.op_id for op in own_ops(ctx.ops) if op.op_id}
    proofs: list[EvictionProof] = []
    for p in sorted((p for p in ctx.pieces if p.ref in last and p.state in (RESIDENT, SHIFTED)),
                    key=lambda p: -p.start):  # from the end backwards, as admit_tool_result evicts
        q = last[str(p.ref)]
        ctx.op_id, ctx.op_fp = (q.op_id, q.op_fp) if q.op_id in own else ("", "")
        try:
            proof = _evict_with_proof(ctx, p, probe)
        finally:
            ctx.op_id = ctx.op_fp = ""
        if proof is not None:
            proofs.append(proof)
    return proofs


def logged_admission(ctx: SessionContext, ref: str, op_id: str) -> ToolAdmission:
    """The answer to an admission of `ref` retried under `op_id`, read from the log (nothing is applied
    again): its quarantine and whether its ops evicted the ref's tokens, with the proof of that eviction while
    this context holds it. A proof is not logged: after a rebuild that did not evict (the first try logged
    every op, then its host died) the answer is evicted without a proof.

    Raises:
        AlreadyExists: nothing the session logged under `op_id` concerns `ref` (another call's op id, in a
            log written before fingerprints, which the fingerprint check cannot tell).
    """
    ops = [op for op in own_ops(ctx.ops) if op.op_id == op_id]
    evicted = [op.piece for op in ops if isinstance(op, EvictOp) and op.reason == "quarantine"
               and ctx.piece(op.piece).ref == ref]
    if ref not in ctx.logged_quarantines or not (evicted or any(
            isinstance(op, QuarantineOp) and op.ref == ref for op in ops)):
        raise AlreadyExists(f"op_id {op_id!r} was logged for another call than this admission of {ref}; "
                            "use a new op_id")
    proof = next((w for w in reversed(ctx.proofs) if evicted and (w.ref, w.piece_id) == (ref, evicted[-1])), None)
    return ToolAdmission(QUARANTINED, ctx.logged_quarantines[ref], evicted=bool(evicted), proof=proof)


def default_admission_detector() -> Detector:
    """The detector `admit_tool_result` uses when given none: the layered default (built once, stateless)."""
    global _DEFAULT_ADMISSION
    if _DEFAULT_ADMISSION is None:
        from fleet.core.quarantine.layered import make_detector  # noqa: PLC0415 - numpy only when it is used

        _DEFAULT_ADMISSION = make_detector()
    return _DEFAULT_ADMISSION


_DEFAULT_ADMISSION: Detector | None = None


def _evict_with_proof(ctx: SessionContext, p: Piece, probe: str) -> EvictionProof | None:
    """Evict `p` ("exact") and prove it with the probe (the proof is appended to `ctx.proofs`). Where the session
    and the probe do not fit the context together, evict without a proof: None.

    NOTE: the probe of the kept session raised (ResourceExhausted) after the quarantine was logged, so the
    admission tore, and the rebuild that finishes it (`finish_admissions`) raised the same every time: a
    session near its context limit could never be used again. The eviction must not depend on its proof."""
    from fleet.core.kernel import max_abs_delta  # noqa: PLC0415 - keep the detector importable without numpy

    probe_ids = ctx.tokenizer.encode(probe)
    if len(ctx.session) + len(probe_ids) > ctx.kernel.config.max_context:
        ctx.evict_piece(p.piece_id, mode="exact", reason="quarantine")
        return None
    late = p.end < len(ctx.session)
    never = _never_saw(ctx, p)
    kept_logits = _probe(ctx.session, probe_ids)  # control, on a fork: the real session is untouched
    report = ctx.evict_piece(p.piece_id, mode="exact", reason="quarantine")
    evict_logits = _probe(ctx.session, probe_ids)
    never_logits = _probe(never, probe_ids)
    assert p.ref is not None, p
    proof = EvictionProof(
        ref=p.ref, piece_id=p.piece_id, start=p.start, length=p.length, mode=report.mode,
        late=late, write_time=not late, exact=report.exact, num_recomputed=report.num_recomputed,
        max_abs_delta_evict_vs_never=max_abs_delta(evict_logits, never_logits),
        control_kept_vs_never=max_abs_delta(kept_logits, never_logits),
        cache_digest_equal=ctx.session.digest() == never.digest(),
        probe_tokens=len(probe_ids), env=ctx.kernel.env(),
    )
    never.close()
    ctx.proofs.append(proof)
    return proof


def _never_saw(ctx: SessionContext, p: Piece) -> Session:
    """A scratch session holding every resident piece except `p`, in order: the never-saw reference."""
    tokens = [t for q in ctx.pieces if q.state in (RESIDENT, SHIFTED) and q.piece_id != p.piece_id
              for t in q.tokens]
    s = ctx.kernel.session()
    if tokens:
        s.append(tokens)
    return s


def _probe(session: Session, probe_ids: list[int]) -> np.ndarray:
    branch = session.fork()
    try:
        return branch.append(probe_ids)
    finally:
        branch.close()
