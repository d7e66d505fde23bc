"""Placement helpers: node affinity, actor names, tenant salts, and the node choice rule."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NAMESPACE = "kvfleet"
SALT_BASE = 1 << 40  # salt tokens lie far outside any vocabulary: they never collide with real ids


def fleet_scope(store_url: str) -> str:
    """A short id of the store a fleet writes to. Actor names carry it, so two fleets on different
    stores in one Ray cluster never adopt each other's supervisors or sessions (and op logs)."""
    return hashlib.sha256(store_url.encode()).hexdigest()[:10]


def session_actor_name(tenant: str, session_id: str, scope: str) -> str:
    return f"session:{scope}:{tenant}:{session_id}"


def supervisor_name(node_id: str, scope: str) -> str:
    return f"supervisor:{scope}:{node_id}"


def tenant_salt(tenant: str, page_size: int) -> list[int]:
    """One page of tenant-specific pseudo-tokens put in front of every radix key, so tenants never
    match each other's prefixes (the same idea as vLLM's cache_salt folded into block 0)."""
    digest = hashlib.sha256(tenant.encode()).digest()
    return [SALT_BASE + int.from_bytes(digest[(4 * i) % 32:(4 * i) % 32 + 4], "big") for i in range(page_size)]


def on_node(node_id: str) -> Any:
    """A hard node-affinity scheduling strategy (Ray's own; we do not write a scheduler)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


@dataclass(frozen=True, slots=True)
class NodeOffer:
    """One node's answer to "how much of this prompt do you hold warm, and how busy are you?"."""

    node_id: str
    num_matched: int
    num_sessions: int


def choose_node(offers: Sequence[NodeOffer]) -> str:
    """Prefer the node holding the longest warm prefix, then the least loaded, then the id."""
    best = min(offers, key=lambda o: (-o.num_matched, o.num_sessions, o.node_id))
    return best.node_id


def _blob_refs(ops: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(str(op["ref"]), str(op["tenant"])) for op in ops if op.get("op") == "append" and op.get("ref")]


def add_blob_refs(store: Any, ops: Sequence[dict[str, Any]]) -> None:
    """Each logged tool result references its blob once per session log that holds it."""
    for ref, tenant in _blob_refs(ops):
        store.add_ref(ref, tenant)


def drop_blob_refs(store: Any, ops: Sequence[dict[str, Any]]) -> None:
    """Undo add_blob_refs when a session's log is deleted (a blob already collected is skipped)."""
    from fleet.errors import NotFound

    for ref, tenant in _blob_refs(ops):
        try:
            store.drop_ref(ref, tenant)
        except NotFound:
            pass
