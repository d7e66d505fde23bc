"""Radix prefix cache (pure core): tree, eviction policies, events (DESIGN §5)."""

from __future__ import annotations

from fleet.radix.events import AllPagesCleared, PagesRemoved, PagesStored, RadixEvent
from fleet.radix.node import EvictedPages, InsertResult, MatchResult, TreeNode
from fleet.radix.policies import (
    POLICIES,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    NextUsePolicy,
    make_policy,
)
from fleet.radix.tree import RadixTree

__all__ = [
    "AllPagesCleared", "PagesRemoved", "PagesStored", "EvictedPages", "EvictionPolicy", "InsertResult",
    "LFUPolicy", "LRUPolicy", "MRUPolicy", "MatchResult", "NextUsePolicy", "POLICIES", "RadixEvent",
    "RadixTree", "TreeNode", "make_policy",
]
