"""SessionService's domain objects (fleet/core/session_types.py, the kernel's reports) -> kvfleet.v1 messages."""

from __future__ import annotations

import json
from typing import Any

from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.core.session_types import EvictionProof, SessionRow, ToolAdmission


def piece_to_proto(p: Any) -> pb.Piece:
    return pb.Piece(piece_id=p.piece_id, kind=p.kind, start=p.start, length=p.length, state=p.state,
                    ref=p.ref or "", role=p.role or "", token_ids=list(p.tokens))


def row_to_proto(r: SessionRow) -> pb.SessionRow:
    return pb.SessionRow(
        session_id=r.session_id, tenant=r.tenant, node=r.node, actor=r.actor, num_tokens=r.num_tokens,
        bytes_alone=r.bytes_alone, bytes_shared=r.bytes_shared, hit_rate=r.hit_rate,
        quarantined_spans=r.quarantined_spans, state=r.state, epoch=r.epoch, last_active=r.last_active,
        parent=r.parent, adopted_tokens=r.adopted_tokens, backend=r.backend, device=r.device,
        history_tokens=r.history_tokens, model_id=r.model_id, rebuilt_from_model_id=r.rebuilt_from_model_id)


def node_to_proto(s: dict[str, Any]) -> pb.NodeRow:
    return pb.NodeRow(node=s["node"], num_sessions=s["sessions"], cached_tokens=s["cached_tokens"],
                      capacity_tokens=s["capacity_tokens"], queried_tokens=s["queried_tokens"],
                      hit_tokens=s["hit_tokens"], evicted_blocks=s["evicted_blocks"], hit_rate=s["hit_rate"])


def proof_to_proto(w: EvictionProof) -> pb.QuarantineWitness:
    detail = {"env": dict(w.env), "late": w.late, "probe_tokens": w.probe_tokens, "ref": w.ref}
    return pb.QuarantineWitness(
        piece_id=w.piece_id, start=w.start, length=w.length, mode=w.mode, write_time=w.write_time, exact=w.exact,
        num_recomputed=w.num_recomputed, max_abs_delta_evict_vs_never=w.max_abs_delta_evict_vs_never,
        control_kept_vs_never=w.control_kept_vs_never, cache_digest_equal=w.cache_digest_equal,
        detail_json=json.dumps(detail, default=str, sort_keys=True))


def admission_to_proto(a: ToolAdmission) -> pb.AdmitToolResultResponse:
    out = pb.AdmitToolResultResponse(verdict=a.verdict, reasons=list(a.reasons), evicted=a.evicted)
    if a.proof is not None:
        out.witness.CopyFrom(proof_to_proto(a.proof))
    return out


def evict_to_proto(r: Any) -> pb.EvictResponse:
    """From the kernel's EvictReport."""
    return pb.EvictResponse(mode=r.mode, start=r.start, length=r.length, tail=r.tail, num_evicted=r.num_evicted,
                            num_recomputed=r.num_recomputed, num_rerotated=r.num_rerotated, exact=r.exact,
                            invariant_delta=r.invariant_delta, logits_fresh=r.logits_fresh)
