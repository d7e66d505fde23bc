"""Tree nodes and result types of the radix prefix cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the radix tree: a run of whole pages shared by every sequence below it.

    Attributes:
        node_id: allocated in creation order (splits allocate a new id for the upper half).
        key: the run's token ids (len is a multiple of the page size; empty only for the root).
        block_ids: one id per page of `key`.
        values: one opaque value per page (None in a simulated tree).
        lock_ref: in-flight users of this node or a descendant; locked nodes are never evicted.
        last_access: the tree clock at the last match or insert through this node.
        interval: clock ticks between the last two matches (None until matched twice; new nodes
            inherit their parent's) -- what `NextUsePolicy` predicts with.
        hit_count: how many matches went through this node.
    """

    node_id: int
    key: tuple[int, ...]
    block_ids: list[int]
    values: list[Any]
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    interval: int | None = None
    hit_count: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path_tokens(self) -> list[int]:
        """The full token prefix from the root to the end of this node."""
        parts: list[tuple[int, ...]] = []
        node: TreeNode | None = self
        while node is not None:
            parts.append(node.key)
            node = node.parent
        return [t for part in reversed(parts) for t in part]

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, tokens={len(self.key)}, blocks={self.block_ids}, lock={self.lock_ref})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    """The longest cached page-aligned prefix of a query.

    Attributes:
        num_matched: tokens matched (a multiple of the page size).
        node: the deepest matched node (the root when nothing matched); lock it while in use.
        block_ids: the matched pages' ids, root-to-leaf.
        values: the matched pages' values, root-to-leaf.
    """

    num_matched: int
    node: TreeNode
    block_ids: tuple[int, ...]
    values: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class InsertResult:
    """What an insert added.

    Attributes:
        num_existing: tokens that were already cached (their old values were kept).
        num_inserted: tokens newly cached (whole pages only; a trailing partial page is dropped).
        node: the node that ends the inserted sequence.
        block_ids: every page id of the sequence, root-to-leaf.
        evicted: what the capacity check evicted afterwards (never the inserted path).
    """

    num_existing: int
    num_inserted: int
    node: TreeNode
    block_ids: tuple[int, ...]
    evicted: EvictedPages


@dataclass(frozen=True, slots=True)
class EvictedPages:
    """Nodes and pages removed by `evict` or `evict_node`, in removal order."""

    num_evicted: int
    node_ids: tuple[int, ...]
    block_ids: tuple[int, ...]


NO_EVICTION = EvictedPages(0, (), ())
