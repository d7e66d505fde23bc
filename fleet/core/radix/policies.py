"""Eviction policies: one-method strategy objects (CONTRIBUTING §5).

The tree owns a heap of evictable leaves; a policy supplies only the sort key. The leaf with the
smallest `priority(node)` is evicted first. Clocks are the tree's logical clock (one tick per
match or insert), so eviction order is deterministic and testable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fleet.core.radix.node import TreeNode

INF = float("inf")


class EvictionPolicy(Protocol):
    name: str

    def priority(self, node: TreeNode) -> Any: ...


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def priority(self, node: TreeNode) -> tuple[int, int]:
        return (node.last_access, node.node_id)


class LFUPolicy:
    """Least frequently used first; ties broken by recency."""

    name = "lfu"

    def priority(self, node: TreeNode) -> tuple[int, int, int]:
        return (node.hit_count, node.last_access, node.node_id)


class MRUPolicy:
    """Most recently used first (the textbook answer to a cyclic scan larger than the cache)."""

    name = "mru"

    def priority(self, node: TreeNode) -> tuple[int, int]:
        return (-node.last_access, -node.node_id)


class NextUsePolicy:
    """Online Belady: evict the leaf whose *predicted* next use lies furthest in the future.

    Each node remembers its last reuse interval (clock ticks between its last two accesses); a
    new node inherits its parent's interval, because a continuation of a context tends to be
    re-read at the rhythm of that context. Predicted next use = last_access + interval. A node
    with no interval at all (never re-read, parent never re-read) predicts "never" and goes
    first: that is what makes it scan-resistant.

    NOTE: on a cyclic, turn-major agent trace every agent branch has the same interval, so the
    branch used most recently is the one needed last: the policy degrades to MRU between agents
    while it protects the shared prefix (interval 1 request), where plain MRU would not.
    """

    name = "next-use"

    def priority(self, node: TreeNode) -> tuple[float, int, int]:
        if node.interval is None:
            return (-INF, node.last_access, node.node_id)
        return (-float(node.last_access + node.interval), -node.last_access, node.node_id)


POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, LFUPolicy, MRUPolicy, NextUsePolicy)
}


def make_policy(name: str) -> EvictionPolicy:
    """Return a policy by name ("lru", "lfu", "mru", "next-use")."""
    from fleet.core.errors import InvalidArgument

    if name not in POLICIES:
        raise InvalidArgument(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
