"""RadixAttention-style prefix cache keyed by token ids at page granularity (DESIGN §5).

    root ── [s y s t e m ...]  (node 1, pages 0..3) ─┬─ [agent A step 1] (node 2) ── [step 2] (node 4)
                                                     └─ [agent B step 1] (node 3)

Every sequence ever inserted is a root-to-node path; shared prefixes are stored once. The tree
is pure: it holds opaque per-page values (a shell puts ObjectRefs or arrays there), emits events
instead of calling back, and counts hits. Invariants:
  * every non-root node's key is a non-empty multiple of `page_size`;
  * children of a node differ in their first page;
  * `lock_ref(node) >= lock_ref(child)`: a lock pins the whole path to the root;
  * `num_cached_tokens == sum(len(n.key))` and `num_locked_tokens == sum over lock_ref > 0`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import Any

from fleet.core.errors import FailedPrecondition, InvalidArgument
from fleet.core.radix.events import AllPagesCleared, PagesRemoved, PagesStored, RadixEvent
from fleet.core.radix.lookup import common_pages, page_key, resolve
from fleet.core.radix.node import NO_EVICTION, EvictedPages, InsertResult, MatchResult, TreeNode
from fleet.core.radix.policies import EvictionPolicy, make_policy


class RadixTree:
    """Prefix cache over token ids. Sizes are counted in tokens (pages x page_size).

    Args:
        page_size: tokens per page (the kernel's block size; 1 = token granularity).
        capacity_tokens: memory budget; `insert` evicts down to it (None = unbounded).
        policy: an `EvictionPolicy` or its name ("lru", "lfu", "mru", "next-use").
    """

    def __init__(self, page_size: int = 1, capacity_tokens: int | None = None,
                 policy: EvictionPolicy | str = "lru") -> None:
        if page_size < 1:
            raise InvalidArgument(f"page_size must be >= 1, got {page_size}")
        if capacity_tokens is not None and capacity_tokens < page_size:
            raise InvalidArgument(f"capacity_tokens must be >= page_size, got {capacity_tokens}")
        self.page_size = page_size
        self.capacity_tokens = capacity_tokens
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self._next_block_id = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._events: list[RadixEvent] = []
        self._init_root()

    @classmethod
    def simulated(cls, page_size: int = 1, capacity_tokens: int | None = None,
                  policy: EvictionPolicy | str = "lru") -> RadixTree:
        """A device-free tree for tests and trace simulation: values stay None (CONTRIBUTING §11)."""
        return cls(page_size=page_size, capacity_tokens=capacity_tokens, policy=policy)

    def _init_root(self) -> None:
        self._next_node_id = 0
        self.root = self._new_node((), [], [], None)
        self._clock = 0
        self.num_cached_tokens = 0
        self.num_locked_tokens = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    @property
    def num_evictable_tokens(self) -> int:
        return self.num_cached_tokens - self.num_locked_tokens

    def match_prefix(self, tokens: Sequence[int], count: bool = True) -> MatchResult:
        """Find the longest cached page-aligned prefix of `tokens` and mark it used.

        Splits a node when the match ends inside it, so `node` ends exactly at `num_matched`.

        Args:
            tokens: the query.
            count: add the query to the hit-rate counters (len(tokens) queried, num_matched hit).
        Returns:
            MatchResult; `node` is the root when nothing matched.
        """
        key = page_key(tokens, self.page_size)
        self._clock += 1
        path = self._walk(key)
        for node in path:
            node.interval = self._clock - node.last_access  # ticks since the last insert or match
            node.last_access = self._clock
            node.hit_count += 1
        num_matched = sum(n.num_tokens for n in path)
        if count:
            self.num_queried_tokens += len(tokens)
            self.num_hit_tokens += num_matched
        return self._match_result(path, num_matched)

    def insert(self, tokens: Sequence[int], value: Sequence[Any] | None = None) -> InsertResult:
        """Cache every whole page of `tokens`, then evict down to the capacity (if any).

        Args:
            tokens: the sequence; a trailing partial page is not cached.
            value: one value per whole page, or None. Pages already cached keep their old value.
        Returns:
            InsertResult. The inserted path is locked while the capacity check evicts.
        Raises:
            InvalidArgument: `value` has the wrong length (nothing is changed).
        """
        key = page_key(tokens, self.page_size)
        num_pages = len(key) // self.page_size
        values = [None] * num_pages if value is None else list(value)
        if len(values) != num_pages:
            raise InvalidArgument(f"insert: {len(values)} values for {num_pages} whole pages")
        self._clock += 1
        path = self._walk(key)
        for node in path:
            node.last_access = self._clock
        pos = sum(n.num_tokens for n in path)
        parent = path[-1] if path else self.root
        leaf = parent
        if pos < len(key):
            leaf = self._add_leaf(parent, key[pos:], values[pos // self.page_size:])
            path.append(leaf)
        evicted = self._fit(leaf)
        block_ids = tuple(b for n in path for b in n.block_ids)
        return InsertResult(pos, len(key) - pos, leaf, block_ids, evicted)

    # -- locks --------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors against eviction (one in-flight user)."""
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self.num_locked_tokens += node.num_tokens
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one `inc_lock_ref`. Raises FailedPrecondition when the node is not locked."""
        if node is not self.root and node.lock_ref <= 0:
            raise FailedPrecondition(f"dec_lock_ref on unlocked node {node.node_id}")
        while node is not self.root and node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.num_locked_tokens -= node.num_tokens
            node = node.parent  # type: ignore[assignment]

    # -- eviction -----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> EvictedPages:
        """Evict unlocked leaves, policy order, until at least `num_tokens` are freed.

        Whole nodes go (a node may free more than asked). A parent left childless and unlocked
        joins the heap. Stops early when nothing evictable is left.
        """
        if num_tokens <= 0:
            return NO_EVICTION
        heap = [(self.policy.priority(n), n.node_id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        node_ids: list[int] = []
        block_ids: list[int] = []
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += self._remove(node, "evict", node_ids, block_ids)
            if parent is not self.root and parent is not None and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (self.policy.priority(parent), parent.node_id, parent))
        return EvictedPages(freed, tuple(node_ids), tuple(block_ids))

    def evict_node(self, target: TreeNode | Sequence[int], start: int | None = None) -> EvictedPages:
        """Policy eviction by name: prune a subtree regardless of recency or frequency.

        Args:
            target: a node of this tree, or a token path that must be cached in full.
            start: (token path only) first position to drop, a page multiple inside the path;
                default: the start of the node holding the path's last page. Pages before
                `start` stay; everything cached at or after it below the path goes.
        Returns:
            EvictedPages in removal order (parents before children).
        Raises:
            NotFound: the node or path is not cached. FailedPrecondition: it is locked.
            InvalidArgument: bad `start`. Nothing is changed on error.
        """
        node = resolve(self.root, target, start, self.page_size)
        if node.lock_ref > 0:
            raise FailedPrecondition(f"node {node.node_id} is locked by {node.lock_ref} in-flight user(s)")
        if start is not None and not isinstance(target, TreeNode):
            node = self._split_to_start(node, start)
        node_ids: list[int] = []
        block_ids: list[int] = []
        freed = self._remove(node, "policy", node_ids, block_ids)
        return EvictedPages(freed, tuple(node_ids), tuple(block_ids))

    def reset(self) -> None:
        """Drop every page and emit AllPagesCleared. Hit counters and block ids carry on."""
        self._init_root()
        self._events.append(AllPagesCleared())

    def take_events(self) -> list[RadixEvent]:
        """Drain the event queue (oldest first)."""
        events, self._events = self._events, []
        return events

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, depth-first, children in insertion order."""
        stack = list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    # -- internals ----------------------------------------------------------------------------

    def _new_node(self, key: tuple[int, ...], block_ids: list[int], values: list[Any],
                  parent: TreeNode | None) -> TreeNode:
        node = TreeNode(self._next_node_id, key, block_ids, values, parent)
        self._next_node_id += 1
        return node

    def _walk(self, key: tuple[int, ...]) -> list[TreeNode]:
        """Nodes matched by `key` from the root, splitting the last one where the match ends."""
        path: list[TreeNode] = []
        node, pos, p = self.root, 0, self.page_size
        while pos < len(key):
            child = node.children.get(key[pos:pos + p])
            if child is None:
                break
            n = common_pages(child.key, key, pos, p)
            if n < child.num_tokens:
                child = self._split(child, n)
            path.append(child)
            pos += n
            node = child
        return path

    def _match_result(self, path: list[TreeNode], num_matched: int) -> MatchResult:
        node = path[-1] if path else self.root
        block_ids = tuple(b for n in path for b in n.block_ids)
        return MatchResult(num_matched, node, block_ids, tuple(v for n in path for v in n.values))

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; the new upper node keeps the child's stats and locks."""
        k = n // self.page_size
        parent = child.parent
        assert parent is not None
        upper = self._new_node(child.key[:n], child.block_ids[:k], child.values[:k], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        upper.interval, upper.hit_count = child.interval, child.hit_count
        child.key, child.block_ids, child.values = child.key[n:], child.block_ids[k:], child.values[k:]
        child.parent = upper
        upper.children[child.key[:self.page_size]] = child
        parent.children[upper.key[:self.page_size]] = upper
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], values: list[Any]) -> TreeNode:
        num_pages = len(key) // self.page_size
        block_ids = list(range(self._next_block_id, self._next_block_id + num_pages))
        self._next_block_id += num_pages
        leaf = self._new_node(key, block_ids, values, parent)
        leaf.last_access, leaf.interval = self._clock, parent.interval
        parent.children[key[:self.page_size]] = leaf
        self.num_cached_tokens += len(key)
        parent_block = parent.block_ids[-1] if parent.block_ids else None
        self._events.append(PagesStored(tuple(block_ids), parent_block, key, self.page_size))
        return leaf

    def _fit(self, leaf: TreeNode) -> EvictedPages:
        if self.capacity_tokens is None or self.num_cached_tokens <= self.capacity_tokens:
            return NO_EVICTION
        self.inc_lock_ref(leaf)
        try:
            return self.evict(self.num_cached_tokens - self.capacity_tokens)
        finally:
            self.dec_lock_ref(leaf)

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self.nodes() if n.is_leaf and n.lock_ref == 0]

    def _remove(self, node: TreeNode, reason: str, node_ids: list[int], block_ids: list[int]) -> int:
        """Detach `node` with its subtree; emit one PagesRemoved per node, parents first."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.key[:self.page_size]]
        freed, stack = 0, [node]
        while stack:
            n = stack.pop()
            node_ids.append(n.node_id)
            block_ids.extend(n.block_ids)
            freed += n.num_tokens
            self._events.append(PagesRemoved(tuple(n.block_ids), reason))
            stack.extend(reversed(n.children.values()))
        self.num_cached_tokens -= freed
        return freed

    def _split_to_start(self, node: TreeNode, start: int) -> TreeNode:
        node_start = len(node.path_tokens()) - node.num_tokens
        if start == node_start:
            return node
        upper = self._split(node, start - node_start)
        return next(iter(upper.children.values()))
