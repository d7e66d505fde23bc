"""Events the radix tree emits; the shell drains them with `RadixTree.take_events()`.

They mirror vLLM's KV events (BlockStored / BlockRemoved / AllBlocksCleared) in shape, so a consumer
that understands one understands the other, but they speak of the tree's own pages: block ids are
page ids (ints, allocated in order, never reused while the tree lives), not content hashes. Hence
their own names (PagesStored / PagesRemoved / AllPagesCleared): the vLLM events a controller decodes
are controller.vllm.events, the structs the stand-in publishes are fleet.app.testkit.sim_vllm.wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PagesStored:
    """Pages newly cached, in order. `token_ids` holds only these pages' tokens.

    Attributes:
        block_ids: the new pages' ids, root-to-leaf order.
        parent_block_id: the page just before the first new one (None when the run starts at 0).
        token_ids: len == len(block_ids) * block_size.
        block_size: tokens per page.
    """

    block_ids: tuple[int, ...]
    parent_block_id: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """Pages dropped from the tree (memory eviction or policy eviction by name)."""

    block_ids: tuple[int, ...]
    reason: str = "evict"  # "evict" (memory pressure) | "policy" (evict_node)


@dataclass(frozen=True, slots=True)
class AllPagesCleared:
    """Every page is gone (`reset`). Consumers must drop all state derived from this tree."""


RadixEvent = PagesStored | PagesRemoved | AllPagesCleared
