"""Read-only lookups over a radix tree's nodes (fleet/core/radix/tree.py): a query's page-aligned key, the pages
a node's key shares with it, and where a node or a cached token path sits (`RadixTree.evict_node`). Nothing here
changes the tree.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleet.core.errors import InvalidArgument, NotFound
from fleet.core.radix.node import TreeNode


def page_key(tokens: Sequence[int], page_size: int) -> tuple[int, ...]:
    """The whole pages of `tokens` (a trailing partial page dropped).

    Raises:
        InvalidArgument: `tokens` is not a sequence of non-negative ints.
    """
    if isinstance(tokens, (str, bytes)) or not all(isinstance(t, int) and t >= 0 for t in tokens):
        raise InvalidArgument("tokens must be a sequence of non-negative ints")
    n = len(tokens) - len(tokens) % page_size
    return tuple(tokens[:n])


def common_pages(node_key: tuple[int, ...], key: tuple[int, ...], pos: int, page_size: int) -> int:
    """How many tokens, whole pages, `node_key` shares with `key` from position `pos`."""
    n, p = 0, page_size
    limit = min(len(node_key), len(key) - pos)
    while n < limit and node_key[n:n + p] == key[pos + n:pos + n + p]:
        n += p
    return n


def resolve(root: TreeNode, target: TreeNode | Sequence[int], start: int | None, page_size: int) -> TreeNode:
    """The node `evict_node` prunes: `target` itself, checked to be in the tree under `root`, or (a token path)
    the node of `resolve_path`.

    Raises:
        NotFound: the node is not in this tree.
    """
    if isinstance(target, TreeNode):
        node: TreeNode | None = target
        while node is not None and node is not root:
            parent = node.parent
            if parent is None or parent.children.get(node.key[:page_size]) is not node:
                break
            node = parent
        if node is not root or target is root:
            raise NotFound(f"node {target.node_id} is not in this tree")
        return target
    return resolve_path(root, target, start, page_size)


def resolve_path(root: TreeNode, tokens: Sequence[int], start: int | None, page_size: int) -> TreeNode:
    """The node holding `tokens`' last page, or (with `start`) the one holding position `start`.

    Raises:
        InvalidArgument: the path is not a non-empty page multiple, or `start` is not a page multiple inside it.
        NotFound: the path is not cached in full.
    """
    key = page_key(tokens, page_size)
    if not key or len(key) != len(tokens):
        raise InvalidArgument(f"evict_node: the path must be a non-empty multiple of {page_size} tokens")
    if start is not None and (start < 0 or start >= len(key) or start % page_size):
        raise InvalidArgument(f"evict_node: start={start} must be a page multiple in [0, {len(key)})")
    node, pos, found = root, 0, None
    while pos < len(key):  # read-only walk: nothing splits before we know the path is cached
        child = node.children.get(key[pos:pos + page_size])
        if child is None or common_pages(child.key, key, pos, page_size) < min(child.num_tokens, len(key) - pos):
            raise NotFound("evict_node: that token path is not cached")
        if start is not None and pos <= start < pos + child.num_tokens:
            found = child
        node, pos = child, pos + child.num_tokens
    return found if start is not None and found is not None else node
