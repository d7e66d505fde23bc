"""The prefix index keeps its block hashes where CPython's cyclic collector never walks them.

A set is always tracked by the collector and every collection that reaches it visits each member: with
router_bench's 64 workers x 100k blocks a full collection took 250-265 ms, every Route waiting meanwhile. A dict
holding only ints and None is never tracked (docs/routing.md, "The cyclic garbage collector and the index").
"""

from __future__ import annotations

import gc

from controller.index import PrefixIndex
from controller.vllm.events import AllBlocksCleared, BlockRemoved, BlockStored

KEY = ("w0", 0)


def stored(hashes: range, medium: str | None = "GPU", group: int | None = 0) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=16,
                       medium=medium, group_idx=group)


def test_stored_hashes_are_not_tracked_by_the_collector() -> None:
    idx = PrefixIndex()
    idx.apply(KEY, stored(range(1, 1000)))  # GPU, group 0
    idx.apply(KEY, stored(range(1 << 62, (1 << 62) + 500), medium="CPU"))  # an offloaded tier
    idx.apply(KEY, stored(range(2000, 2100), medium="DISK"))
    idx.apply(KEY, BlockRemoved(block_hashes=tuple(range(1, 100)), medium="GPU", group_idx=0))
    gc.collect()
    tiers = idx.rank(KEY).tiers
    assert len(tiers) == 3
    for tier, hashes in tiers.items():
        assert not gc.is_tracked(hashes), f"tier {tier}: its hashes are walked by every collection reaching them"
    assert idx.match(KEY, range(100, 1000)) == 900 and idx.num_blocks(KEY) == 900 + 500 + 100
    assert idx.held_and_new(KEY, stored(range(990, 1010))) == (900, 10)


def test_refilled_after_a_clear_still_not_tracked() -> None:
    """A clear (reset_prefix_cache) and an epoch drop start the rank over: what it stores next is untracked too."""
    idx = PrefixIndex()
    idx.apply(KEY, stored(range(1, 50)))
    idx.apply(KEY, AllBlocksCleared())
    idx.apply(KEY, stored(range(50, 60)))
    assert idx.resident(KEY) == set(range(50, 60))
    idx.drop(KEY)
    idx.apply(KEY, stored(range(60, 70)))
    assert [gc.is_tracked(s) for s in idx.rank(KEY).tiers.values()] == [False]
    assert idx.match(KEY, [60, 61, 99]) == 2
