"""NodeCache: a kernel host's radix prefix cache (workers/host.py's KernelHost holds one, as `cache`).

    RadixTree  key: salt(tenant) + tokens (one salt page per tenant: tenants never share)
               values: ObjectRefs of single KV blocks, each ray.put once by the host (so eviction frees them)

A create adopts the blocks its prompt matches (`adoptable`, locked until its session holds them) and then
`publish`es its own block-aligned blocks the tree lacks; a fork adopts its parent's the same way. `evict_node`
drops a named path by policy. The tree's blocks count once toward the node's KV budget (`cached_bytes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray

from fleet.core.errors import InvalidArgument
from fleet.core.radix import RadixTree
from workers.placement import tenant_salt

if TYPE_CHECKING:
    from workers.lanes import TenantLanes
    from workers.session_kernel import SessionKernel


def check_evict_start(start: Any, block_size: int, num_tokens: int) -> None:
    """The one rule for a policy eviction's `start`: an int (not a bool), a block multiple, inside the path's
    `num_tokens` tokens. NOTE: the host puts the tenant's salt page in front of the path and shifts `start` by
    one block; unchecked, `start=-block_size` named the salt page, and the eviction dropped every block the
    tenant had cached on the node, for every prompt."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < num_tokens or start % block_size:
        raise InvalidArgument(f"evict_prefix: start must be a multiple of the block size {block_size} in "
                              f"[0, {num_tokens}) (the prompt's tokens), got {start!r}; nothing was evicted")


class NodeCache:
    """The node's prefix cache and its counts (queried and hit tokens of creates, evicted blocks).

    Args:
        budget_bytes: the tree's budget (part of the node's KV budget).
        lanes: the host's lanes (`publish` puts blocks on the tenant's lane).
    """

    def __init__(self, block_size: int, bytes_per_token: int, budget_bytes: int, policy: str,
                 lanes: TenantLanes) -> None:
        self.block_size, self.bytes_per_token, self.lanes = block_size, bytes_per_token, lanes
        capacity = max(budget_bytes // bytes_per_token, 2 * block_size)
        self.tree = RadixTree(page_size=block_size, capacity_tokens=capacity, policy=policy)
        self.num_queried_tokens = self.num_hit_tokens = 0
        self.num_evicted_blocks = 0

    def key(self, tenant: str, tokens: list[int]) -> list[int]:
        return tenant_salt(tenant, self.block_size) + list(tokens)

    def num_warm(self, tenant: str, tokens: list[int]) -> int:
        """Tokens of `tokens` the tree holds for `tenant` (counts nothing: a placement probe's)."""
        m = self.tree.match_prefix(self.key(tenant, tokens), count=False)
        return max(0, m.num_matched - self.block_size)

    def cached_bytes(self) -> int:
        """KV bytes of the tree's blocks (each once, in the object store)."""
        salt = self.block_size * len(self.tree.root.children)   # one salt page per tenant: no KV
        return (self.tree.num_cached_tokens - salt) * self.bytes_per_token

    def count_hits(self, tokens: list[int], refs: list[Any]) -> None:
        """A create's prompt `tokens`, of which it adopted `refs` (one per block)."""
        self.num_queried_tokens += len(tokens)
        self.num_hit_tokens += len(refs) * self.block_size

    def adoptable(self, tenant: str, tokens: list[int]) -> tuple[Any, list[Any]]:
        """Lock and return the cached blocks a new session may adopt (at most len - 1 tokens,
        so the session computes its own last logits)."""
        m = self.tree.match_prefix(self.key(tenant, tokens), count=False)
        limit = (len(tokens) - 1) // self.block_size
        refs = []
        for v in m.values[1:1 + limit]:  # a page inserted without a value ends what can be adopted
            if v is None:
                break
            refs.append(v)
        self.tree.inc_lock_ref(m.node)
        return m.node, refs

    async def publish(self, tenant: str, tokens: list[int], s: SessionKernel) -> None:
        """Put the session's block-aligned `tokens` in the tree (only blocks the tree lacks).

        The key is the exported prefix's own tokens, so a session that moved on meanwhile (a fork
        point read earlier) never files blocks under tokens they do not hold; and a session whose KV no
        longer follows its tokens (a reposition eviction re-rotated it) exports nothing
        (`SessionKernel.export_prefix`), so every block in the tree is what a prefill of its tokens computes."""
        n = len(tokens) - len(tokens) % self.block_size
        if n == 0 or self._num_cached_pages(self.key(tenant, tokens[:n])) >= n // self.block_size:
            return
        try:
            prefix = await s.export_prefix(n)
        except Exception:  # noqa: BLE001 - it got shorter, was re-rotated or closed meanwhile: nothing to publish
            return
        key = self.key(tenant, list(prefix.tokens))
        have = self._num_cached_pages(key)                    # again: other creates ran meanwhile
        # NOTE: the puts run on the tenant's lane: one per block on the host's loop held it 250-340 ms for a
        # 7k-token prompt, and every other tenant's calls on the host waited (append 6.7 -> 460 ms at worst)
        refs = await self.lanes.run(tenant, lambda: [ray.put(b) for b in prefix.blocks[have:]])
        now = self._num_cached_pages(key)                     # and again: the loop served others meanwhile
        values = [None] * (1 + max(have, now)) + refs[max(0, now - have):]
        self.tree.insert(key, values)
        self._drain_events()

    def _num_cached_pages(self, key: list[int]) -> int:
        """Session pages of `key` already cached (the salt page not counted)."""
        return max(0, self.tree.match_prefix(key, count=False).num_matched // self.block_size - 1)

    def _drain_events(self) -> None:
        from fleet.core.radix import PagesRemoved

        self.num_evicted_blocks += sum(len(e.block_ids) for e in self.tree.take_events()
                                       if isinstance(e, PagesRemoved))

    def evict_node(self, tenant: str, tokens: list[int], start: int = 0) -> dict[str, Any]:
        """Policy eviction by name: drop the tenant's cached blocks on this token path from
        position `start` (a block multiple inside `tokens`) down, with everything cached below them,
        regardless of recency. Raises NotFound when the path is not cached here, InvalidArgument for a
        `start` outside it (`check_evict_start`: nothing is dropped)."""
        check_evict_start(start, self.block_size, len(tokens))
        r = self.tree.evict_node(self.key(tenant, tokens), start=self.block_size + start)
        self._drain_events()
        return {"num_evicted": r.num_evicted, "block_ids": list(r.block_ids)}
