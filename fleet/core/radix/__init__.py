"""Radix prefix cache (pure core): tree, eviction policies, events (DESIGN §5)."""

from __future__ import annotations

from fleet.core.radix.events import AllPagesCleared, PagesRemoved, PagesStored, RadixEvent
from fleet.core.radix.node import EvictedPages, InsertResult, MatchResult, TreeNode
from fleet.core.radix.policies import (
    POLICIES,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    NextUsePolicy,
    make_policy,
)
from fleet.core.radix.tree import RadixTree

__all__ = [
    "AllPagesCleared", "PagesRemoved", "PagesStored", "EvictedPages", "EvictionPolicy", "InsertResult",
    "LFUPolicy", "LRUPolicy", "MRUPolicy", "MatchResult", "NextUsePolicy", "POLICIES", "RadixEvent",
    "RadixTree", "TreeNode", "make_policy",
]
