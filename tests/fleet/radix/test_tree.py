"""RadixTree: exact block ids, node ids, events and eviction order (CONTRIBUTING §11)."""

from __future__ import annotations

import pytest

from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound
from fleet.core.radix import AllPagesCleared, PagesRemoved, PagesStored, RadixTree


def test_insert_match_split_exact_ids_and_events() -> None:
    t = RadixTree.simulated(page_size=2)
    r = t.insert([1, 2, 3, 4, 5])                     # trailing partial page is not cached
    assert (r.num_existing, r.num_inserted, r.block_ids, r.node.node_id) == (0, 4, (0, 1), 1)
    assert t.take_events() == [PagesStored((0, 1), None, (1, 2, 3, 4), 2)]
    m = t.match_prefix([1, 2, 3, 4, 9, 9])
    assert (m.num_matched, m.block_ids, m.node.node_id) == (4, (0, 1), 1)
    r = t.insert([1, 2, 7, 8])                         # splits node 1 after page 0
    assert (r.num_existing, r.num_inserted, r.block_ids) == (2, 2, (0, 2))
    assert [(n.node_id, n.key, n.block_ids) for n in t.nodes()] == [
        (2, (1, 2), [0]), (1, (3, 4), [1]), (3, (7, 8), [2])]
    assert t.take_events() == [PagesStored((2,), 0, (7, 8), 2)]
    m = t.match_prefix([1, 2, 3])                      # page-aligned: matches only [1, 2]
    assert (m.num_matched, m.block_ids, m.node.node_id) == (2, (0,), 2)
    assert (t.num_queried_tokens, t.num_hit_tokens, t.num_cached_tokens) == (9, 6, 6)


def test_values_are_kept_per_page() -> None:
    t = RadixTree.simulated(page_size=2)
    t.insert([1, 2, 3, 4], value=["a", "b"])
    t.insert([1, 2, 3, 4, 5, 6], value=["X", "Y", "c"])   # existing pages keep their values
    assert t.match_prefix([1, 2, 3, 4, 5, 6]).values == ("a", "b", "c")
    assert t.match_prefix([9, 9]).values == ()


def test_lru_eviction_order_is_exact() -> None:
    t = RadixTree.simulated(page_size=1, policy="lru")
    for seq in ([1, 2], [3, 4], [5, 6]):               # nodes 1, 2, 3; blocks 0-1, 2-3, 4-5
        t.insert(seq)
    t.match_prefix([1, 2])                             # A is now the most recent
    t.take_events()
    r = t.evict(2)
    assert (r.num_evicted, r.node_ids, r.block_ids) == (2, (2,), (2, 3))
    r = t.evict(3)
    assert (r.num_evicted, r.node_ids, r.block_ids) == (4, (3, 1), (4, 5, 0, 1))
    assert t.take_events() == [PagesRemoved((2, 3)), PagesRemoved((4, 5)), PagesRemoved((0, 1))]
    assert t.num_cached_tokens == 0


def test_parent_becomes_evictable_after_its_last_child() -> None:
    t = RadixTree.simulated(policy="lru")
    t.insert([1, 2, 3])
    t.insert([1, 2, 4])                                # node 2 = [1,2] (split), 1 = [3], 3 = [4]
    t.match_prefix([9])                                # tick
    t.insert([7])                                      # node 4, newest
    r = t.evict(4)
    assert r.node_ids == (1, 3, 2)                     # both children, then their parent


def test_lfu_and_mru_orders() -> None:
    lfu = RadixTree.simulated(policy="lfu")
    for seq in ([1], [2], [3]):
        lfu.insert(seq)
    lfu.match_prefix([1]); lfu.match_prefix([1]); lfu.match_prefix([3])  # noqa: E702
    assert lfu.evict(3).node_ids == (2, 3, 1)
    mru = RadixTree.simulated(policy="mru")
    for seq in ([1], [2], [3]):
        mru.insert(seq)
    mru.match_prefix([1])
    assert mru.evict(2).node_ids == (1, 3)


def test_next_use_evicts_never_reused_first_and_protects_the_cycle() -> None:
    t = RadixTree.simulated(policy="next-use")
    t.insert([1, 1])                                   # node 1: will be re-read every 2 ticks
    t.insert([2, 2])                                   # node 2: one-off, never re-read
    for _ in range(3):
        t.match_prefix([1, 1])
        t.insert([9])                                  # unrelated tick (node 3, parent = root)
    leaf = t.insert([1, 1, 5]).node                    # node 4 inherits node 1's interval (2)
    assert (leaf.node_id, leaf.interval) == (4, 2)
    assert t.evict(1).node_ids == (2,)                 # the one-off goes first
    assert t.evict(1).node_ids == (3,)                 # then the other never-re-read node
    assert t.evict(1).node_ids == (4,)                 # the cycle's continuation last


def test_locks_protect_and_unbalanced_unlock_fails() -> None:
    t = RadixTree.simulated()
    a = t.insert([1, 2]).node
    t.insert([3, 4])
    t.inc_lock_ref(a)
    assert (t.num_locked_tokens, t.num_evictable_tokens) == (2, 2)
    assert t.evict(100).node_ids == (2,)               # only the unlocked leaf
    t.dec_lock_ref(a)
    with pytest.raises(FailedPrecondition):
        t.dec_lock_ref(a)
    assert t.evict(100).node_ids == (1,)


def test_capacity_evicts_on_insert_but_never_the_inserted_path() -> None:
    t = RadixTree.simulated(capacity_tokens=4, policy="lru")
    t.insert([1, 2])
    t.insert([3, 4])
    r = t.insert([5, 6, 7])                            # 7 tokens > 4: evict LRU until it fits
    assert r.evicted.node_ids == (1, 2)
    assert [n.node_id for n in t.nodes()] == [3] and t.num_cached_tokens == 3


def test_evict_node_by_path_and_by_node() -> None:
    t = RadixTree.simulated(page_size=2)
    t.insert([1, 1, 2, 2, 3, 3])                       # node 1
    t.insert([1, 1, 2, 2, 4, 4])                       # split: node 2 = [1,1,2,2]; 3 = [4,4]
    t.insert([1, 1, 5, 5])                             # split: node 4 = [1,1]; 5 = [5,5]
    t.take_events()
    r = t.evict_node([1, 1, 2, 2, 4, 4])               # node-granular: only the [4,4] leaf
    assert (r.node_ids, r.block_ids) == ((3,), (3,))
    r = t.evict_node([1, 1, 2, 2], start=2)            # prune everything below [1,1] via [2,2]
    assert (r.node_ids, r.block_ids) == ((2, 1), (1, 2))
    assert t.take_events() == [PagesRemoved((3,), "policy"), PagesRemoved((1,), "policy"),
                               PagesRemoved((2,), "policy")]
    assert t.match_prefix([1, 1, 5, 5]).num_matched == 4   # the sibling branch is untouched
    node = t.match_prefix([1, 1, 5, 5]).node
    assert t.evict_node(node).node_ids == (5,)


def test_evict_node_errors_change_nothing() -> None:
    t = RadixTree.simulated(page_size=2)
    leaf = t.insert([1, 1, 2, 2]).node
    before = [(n.node_id, n.key) for n in t.nodes()]
    with pytest.raises(NotFound):
        t.evict_node([1, 1, 9, 9])
    with pytest.raises(InvalidArgument):
        t.evict_node([1, 1, 2])                        # not page-aligned
    with pytest.raises(InvalidArgument):
        t.evict_node([1, 1, 2, 2], start=1)
    t.inc_lock_ref(leaf)
    with pytest.raises(FailedPrecondition):
        t.evict_node([1, 1, 2, 2], start=2)
    t.dec_lock_ref(leaf)
    assert [(n.node_id, n.key) for n in t.nodes()] == before and t.num_cached_tokens == 4
    t.evict_node(leaf)
    with pytest.raises(NotFound):
        t.evict_node(leaf)                             # detached node


def test_bad_input_raises_and_changes_nothing() -> None:
    t = RadixTree.simulated(page_size=2)
    t.insert([1, 2])
    for bad in ("ab", [1, -2], [1.0, 2]):
        with pytest.raises(InvalidArgument):
            t.insert(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        t.insert([3, 4, 5, 6], value=["only-one"])
    with pytest.raises(InvalidArgument):
        RadixTree(page_size=0)
    assert [n.key for n in t.nodes()] == [(1, 2)] and t.num_cached_tokens == 2


def test_reset_clears_everything_and_block_ids_carry_on() -> None:
    t = RadixTree.simulated()
    t.insert([1, 2])
    t.match_prefix([1, 2])
    t.take_events()
    t.reset()
    assert t.take_events() == [AllPagesCleared()]
    assert t.num_cached_tokens == 0 and t.match_prefix([1, 2]).num_matched == 0
    assert t.insert([1, 2]).block_ids == (2, 3)
    assert (t.num_queried_tokens, t.num_hit_tokens) == (4, 2)
