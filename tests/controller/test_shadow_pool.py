"""The block-pool shadow (controller/shadow_pool.py): vLLM's free queue and ref counts, exact block ids and
eviction order, fed by routes and corrected by KV events."""

from __future__ import annotations

import pytest

from controller.shadow import ShadowPools
from controller.shadow_pool import RankPool


def test_the_docstring_walk_through_null_block_fresh_blocks_then_lru_tail_first() -> None:
    p = RankPool(num_gpu_blocks=5)  # block 0 is the null block: 4 usable
    assert p.num_free() == 4
    assert p.allocate("r1", [11, 12], 1, now=0.0) == []
    assert p.queue() == [None] and p.num_free() == 1
    p.free("r1", now=9.0)  # reversed: the partial block, then 12, then 11 join the tail
    assert p.queue() == [None, None, 12, 11]
    assert p.allocate("r2", [21, 22], 0, now=1.0) == []  # the fresh block, then the freed partial one
    assert p.queue() == [12, 11]
    assert p.allocate("r3", [31], 0, now=2.0) == [12]  # r1's tail first, its head stays
    assert p.queue() == [11] and p.cached(11) and not p.cached(12)


def test_a_hit_touches_its_blocks_out_of_the_queue_and_pinned_blocks_are_never_evicted() -> None:
    p = RankPool(num_gpu_blocks=5)
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=0.0)
    assert p.queue() == [None, 3, 2, 1]
    assert p.allocate("b", [1, 2, 9], 0, now=1.0) == []  # hit 1, 2 (touched out), 9 takes the fresh block
    assert p.queue() == [3]
    assert p.allocate("c", [7], 0, now=2.0) == [3]
    assert p.allocate("d", [8], 0, now=3.0) == []  # nothing free: 1, 2, 9 and 7 are pinned; d waits
    assert p.queue() == [] and p.num_waiting() == 1 and not p.cached(8)
    assert p.free("b", now=4.0) == [9]  # 9, 2, 1 rejoin in that order; d is admitted and takes the front
    assert p.queue() == [2, 1] and p.cached(8) and p.num_waiting() == 0
    p.free("c", now=5.0)
    assert p.allocate("e", [5, 6], 0, now=6.0) == [2, 1]
    assert p.queue() == [7]


def test_a_waiting_request_puts_the_queue_front_at_risk_before_it_is_admitted() -> None:
    p = RankPool(num_gpu_blocks=5)  # 4 usable
    p.allocate("a", [1, 2], 0, now=0.0)
    p.allocate("b", [3, 4], 0, now=0.0)  # the pool is full of pinned blocks
    p.free("a", now=1.0)
    assert p.queue() == [2, 1]
    assert p.allocate("c", [5, 6, 7], 0, now=2.0) == []  # 3 new blocks, 2 free: waits behind b
    assert p.at_risk() == {1, 2}
    assert p.resident_prefix([1, 2], 2, now=2.0) == 0  # c will take 2 and 1 before a route sent now runs
    assert p.allocate("d", [1, 2], 0, now=2.5) == [] and p.num_waiting() == 2  # first come, first served
    assert p.free("b", now=3.0) == [2, 1, 4]  # c admitted: 2, 1, 4 evicted; then d: 1, 2 are new again
    assert p.queue() == [3] and p.num_waiting() == 1  # d needs 2 blocks, 1 is free
    assert p.free("c", now=4.0) == [3, 7]  # c's 7, 6, 5 rejoin behind 3; d admitted takes 3 and 7
    assert p.queue() == [6, 5] and p.cached(1) and p.cached(2) and not p.cached(7)


def test_a_block_cached_after_the_first_miss_is_not_a_hit_it_takes_a_new_block() -> None:
    """vLLM hits only the leading cached blocks; every later block gets a new block from the queue's front even
    if its hash is cached on its own (the pool then maps the hash to both copies). Before, the shadow reused
    such blocks: it under-counted what a request took, and a route trusted blocks LRU had dropped (a stale
    WARM route through the controller in agents16x4 / very-tight)."""
    p = RankPool(num_gpu_blocks=6)  # 5 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=0.0)
    assert p.queue() == [None, None, 3, 2, 1]
    assert p.allocate("b", [9, 2, 3], 0, now=1.0) == [3]  # 9 misses: 3 new blocks, the third evicts 3 ...
    assert p.queue() == [2, 1] and p.cached(2) and p.cached(3)  # ... and holds 3 again; 2's copy is unhashed
    p.free("b", now=2.0)
    assert p.queue() == [2, 1, 3, None, 9]
    p.allocate("c", [1, 2], 0, now=3.0)  # a prefix hit still touches its blocks out of the queue
    p.allocate("d", [7, 8, 3, 9], 0, now=4.0)  # all pinned: 4 new blocks wanted, 3 free: d waits ...
    assert p.num_waiting() == 1 and p.at_risk() == {3, 9}  # ... and will take the whole queue
    assert p.resident_prefix([3], 1, now=4.0) == 0


def test_a_request_running_across_a_clear_holds_its_blocks_again_when_they_are_stored() -> None:
    """A reset behind the controller's back clears every hash; a request routed just before it runs after it (or
    is preempted and runs again) and its blocks are stored again. They are that request's, pinned, and rejoin
    the queue tail first when it ends. Before, the shadow queued them as free in stored order: LRU was expected
    to evict the rebuilt history's first block at once, and the next turn was routed cold (long-context)."""
    p = RankPool(num_gpu_blocks=8)  # 7 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.cleared()  # the reset: a's blocks are hashless while it runs
    p.stored([1, 2, 3], now=1.0)  # a ran after it: its blocks are stored again
    assert p.num_free() == 4  # no slot taken twice
    p.free("a", now=2.0)
    assert p.queue() == [None, None, None, None, 3, 2, 1]
    assert p.allocate("b", [9, 10, 11, 12, 13], 0, now=3.0) == [3]  # the tail goes first, the head stays
    assert p.resident_prefix([1, 2, 3], 3, now=3.0) == 2


def test_blocks_stored_unpredicted_queue_last_block_first() -> None:
    """A BlockStored is one request's chain, and vLLM frees a request's blocks last first: its unpredicted blocks
    queue so (a replay after a restart, another router's request). Before, head first: LRU was expected to drop
    the prompt's first block, hiding all of it."""
    p = RankPool(num_gpu_blocks=6)  # 5 usable
    p.stored([1, 2, 3], now=0.0)
    p.stored([4, 5], now=0.0)
    assert p.queue() == [3, 2, 1, 5, 4]  # NOTE: before, [1, 2, 3, 4, 5]
    assert p.allocate("a", [9], 0, now=1.0) == [3]
    assert p.resident_prefix([1, 2, 3], 3, now=1.0) == 2  # NOTE: before, 0


def test_shared_blocks_count_references_and_rejoin_the_queue_only_when_the_last_one_ends() -> None:
    p = RankPool(num_gpu_blocks=6)  # 5 usable
    p.allocate("a", [1, 2], 0, now=0.0)
    p.allocate("b", [1, 2, 3], 0, now=0.0)  # shares 1, 2 (ref 2)
    p.free("a", now=9.0)
    assert p.queue() == [None, None]  # 1 and 2 still held by b
    p.free("b", now=9.0)
    assert p.queue() == [None, None, 3, 2, 1]
    assert p.allocate("c", [4, 5, 6, 7], 0, now=1.0) == [3, 2]


def test_predicted_evictions_hide_index_matches_until_confirmed_or_past_the_grace() -> None:
    p = RankPool(num_gpu_blocks=4, grace_s=5.0)  # 3 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=9.0)
    assert p.allocate("b", [4, 5], 0, now=1.0) == [3, 2]
    # the index still holds 1, 2, 3 (no BlockRemoved yet): only block 1 is resident as far as LRU goes
    assert p.resident_prefix([1, 2, 3], 3, now=1.5) == 1
    p.removed([3])  # confirmed: no longer a prediction (the index drops it itself)
    assert list(p.evicted) == [2]
    assert p.resident_prefix([1, 2, 3], 3, now=6.0) == 3  # 2's BlockRemoved never came: the index is trusted


def test_an_untracked_routes_predictions_hide_blocks_from_its_own_tenant_only() -> None:
    """An untracked Route is freed at once and may never be sent: the evictions it predicts hide blocks from
    its own tenant's Routes, not another's (before, a tenant's untracked Routes, never sent, made every other
    tenant's Route on the rank COLD for the grace). A tracked route's predictions hide them from everyone."""
    p = RankPool(num_gpu_blocks=4, grace_s=5.0)  # 3 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=0.0)
    assert p.allocate("u", [4, 5], 0, now=1.0, speculative="h") == [3, 2]
    p.free("u", now=1.0)
    assert p.resident_prefix([1, 2, 3], 3, now=1.5, owner="h") == 1    # h's own Routes believe it
    assert p.resident_prefix([1, 2, 3], 3, now=1.5, owner="a") == 3    # NOTE: before, 1
    q = RankPool(num_gpu_blocks=4, grace_s=5.0)                        # control: the same route tracked
    q.allocate("a", [1, 2, 3], 0, now=0.0)
    q.free("a", now=0.0)
    assert q.allocate("t", [4, 5], 0, now=1.0) == [3, 2]
    assert q.resident_prefix([1, 2, 3], 3, now=1.5, owner="a") == 1


def test_an_untracked_route_leaves_the_pool_as_it_was() -> None:
    """An untracked Route may never be sent: what it would evict is read off the queue's front, and the pool does
    not change (a request that is sent is seen through its events). Before, it was admitted and freed at once: its
    hit moved to the tail, the blocks it took left the model and its never-sent blocks joined the tail hashed, so
    the next tracked route predicted, for every tenant, the eviction of a block vLLM kept."""
    p = RankPool(num_gpu_blocks=6, grace_s=5.0)  # 5 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=0.0)
    p.allocate("b", [4, 5], 0, now=0.0)
    p.free("b", now=0.0)
    assert p.queue() == [3, 2, 1, 5, 4]
    # hit 4 (it would leave the queue first), then 9, 8 and a partial block: three taken from the front
    assert p.allocate("u", [4, 9, 8], 1, now=1.0, speculative="h") == [3, 2, 1]
    p.free("u", now=1.0)
    assert p.queue() == [3, 2, 1, 5, 4] and not p.cached(9)      # NOTE: before, [5, None, 8, 9, 4]
    assert p.speculate([4, 9, 8], 1, now=1.0, owner="h") == [3, 2, 1]  # the same again: nothing was taken
    assert p.allocate("t", [7], 0, now=2.0) == [3]                # NOTE: before, [5]
    assert p.resident_prefix([1, 2, 3], 3, now=2.5, owner="h") == 0  # h believes its own predictions ...
    assert p.resident_prefix([1, 2, 3], 3, now=2.5, owner="x") == 2  # ... others only the tracked route's
    assert p.resident_prefix([4, 5], 2, now=2.5, owner="x") == 2


def test_a_tracked_routes_evictions_are_believed_by_every_tenant_while_it_may_be_on_its_way() -> None:
    """Tracking is the caller's choice. Every tenant's Routes believe a tracked route's predicted evictions for
    `unsent_s` (the time its request needs to reach the engine); past that only its own tenant's, until a
    BlockStored of one of its new blocks shows the request sent. Before, every tenant believed them for the whole
    5 s grace, sent or not: one tenant's tracked Route, never sent, made another's resident prompt COLD."""
    p = RankPool(num_gpu_blocks=4, grace_s=5.0, unsent_s=1.0)  # 3 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=0.0)
    assert p.allocate("t", [4, 5], 0, now=1.0, owner="m") == [3, 2]
    assert p.resident_prefix([1, 2, 3], 3, now=1.9, owner="v") == 1  # it may be on its way
    assert p.resident_prefix([1, 2, 3], 3, now=2.0, owner="v") == 3  # NOTE: before, 1 until 6.0
    assert p.resident_prefix([1, 2, 3], 3, now=2.0, owner="m") == 1  # its own tenant's Routes still believe it
    p.stored([4], now=2.1)  # the request is on the worker
    assert p.resident_prefix([1, 2, 3], 3, now=2.2, owner="v") == 1
    p.free("t", now=3.0)  # shown sent: freed as usual, tail first
    assert p.queue() == [1, 5, 4] and p.resident_prefix([1, 2, 3], 3, now=5.9, owner="v") == 1  # its age is kept
    assert p.resident_prefix([1, 2, 3], 3, now=6.0, owner="v") == 3


def test_a_tracked_route_that_ends_with_no_event_showing_it_sent_is_undone() -> None:
    """Released (or ended by the ledger) before any of its blocks was stored, a tracked route may never have been
    sent: the blocks it took go back to the queue's front as they were, and what it predicted is withdrawn. Its
    hits are freed as usual. Control: the same route shown sent is freed tail first and its evictions stand."""
    p = RankPool(num_gpu_blocks=6, grace_s=5.0)  # 5 usable
    p.allocate("a", [1, 2, 3], 0, now=0.0)
    p.free("a", now=0.0)
    p.allocate("b", [4], 0, now=0.0)
    p.free("b", now=0.0)
    assert p.queue() == [None, 3, 2, 1, 4]
    assert p.allocate("t", [4, 7, 8], 1, now=1.0, owner="m") == [3, 2]  # hit 4; 7, 8 and a partial: fresh, 3, 2
    assert p.queue() == [1]
    assert p.free("t", now=1.1) == []
    assert p.queue() == [None, 3, 2, 1, 4] and not p.cached(7) and not p.evicted  # NOTE: before, [1, None, 8, 7, 4]
    assert p.allocate("c", [9, 10], 0, now=2.0) == [3]  # NOTE: before, [1]

    q = RankPool(num_gpu_blocks=6, grace_s=5.0)  # control
    q.allocate("a", [1, 2, 3], 0, now=0.0)
    q.free("a", now=0.0)
    q.allocate("b", [4], 0, now=0.0)
    q.free("b", now=0.0)
    assert q.allocate("t", [4, 7, 8], 1, now=1.0, owner="m") == [3, 2]
    q.stored([7, 8], now=1.05)
    q.free("t", now=1.1)
    assert q.queue() == [1, None, 8, 7, 4] and list(q.evicted) == [3, 2]
    assert q.resident_prefix([1, 2, 3], 3, now=1.5, owner="v") == 1

    r = RankPool(num_gpu_blocks=4, grace_s=5.0)  # 3 usable: a route whose only new block is its partial one
    r.allocate("a", [1, 2, 3], 0, now=0.0)
    r.free("a", now=0.0)
    assert r.allocate("t", [1, 2], 1, now=1.0, owner="m") == [3]  # no new full block: no BlockStored will come
    r.removed([3])  # but the worker ran it: 3 is gone
    r.free("t", now=2.0)
    assert r.queue() == [None, 2, 1] and not r.cached(3)  # its slot comes back unhashed, at the front


@pytest.mark.parametrize("first", ["r1", "r2"])
def test_an_unsent_route_undone_after_a_clear_gives_a_shared_block_back_once(first: str) -> None:
    """Two tracked routes of one prompt (the second hits the first's blocks), a clear while both hold them, both
    ended unsent, in either order: each block comes back once, when its last holder ends. Before, the undo of the
    first route's admission gave back blocks the second still held, and its free gave them back again: 11 free
    slots in an 8-block pool, and no eviction predicted after. Control: the pool's size."""
    p = RankPool(num_gpu_blocks=9)  # 8 usable
    p.allocate("r1", [1, 2, 3], 0, now=0.0, owner="a")
    p.allocate("r2", [1, 2, 3], 0, now=0.1, owner="a")  # hits r1's blocks
    p.cleared()
    p.free(first, now=0.2)
    assert p.num_free() == 5
    p.free("r2" if first == "r1" else "r1", now=0.3)
    assert p.num_free() == 8 and p.queue() == [None] * 8
    big = [100 + i for i in range(8)]
    p.stored(big, now=1.0)  # the worker's pool is full
    assert p.allocate("r3", [200, 201, 202], 0, now=1.1, owner="b") == [107, 106, 105]  # NOTE: before, []
    assert p.resident_prefix(big, 8, now=1.2, owner="c") == 5  # NOTE: before, 8


@pytest.mark.parametrize("order", [("r1", "r2", "r3"), ("r3", "r2", "r1"), ("r2", "r1", "r3"), ("r1", "r3", "r2")])
def test_unsent_routes_undone_in_any_order_leave_the_queue_as_it_was(order: tuple[str, str, str]) -> None:
    """Tracked routes that take the queue's front in turn, all undone: whatever the order of their ends, the queue
    is what the worker (which got none of them) still has, and the next sent route evicts its front. Before, each
    undo put its slots at the absolute front: released in the order they came, [1, 2, 3, 4, 5] became
    [4, 2, 3, 1, 5] (two one-block routes: [2, 1, 3, 4]) and the next route was predicted to evict 4 where vLLM
    evicts 1."""
    p = RankPool(num_gpu_blocks=6)  # 5 usable
    for h in (1, 2, 3, 4, 5):
        p.stored([h], 0.0)
    assert p.queue() == [1, 2, 3, 4, 5]
    assert p.allocate("r1", [10], 0, now=1.0, owner="a") == [1]
    assert p.allocate("r2", [20, 21], 0, now=1.0, owner="b") == [2, 3]
    assert p.allocate("r3", [30], 0, now=1.0, owner="a") == [4]
    for r in order:
        p.free(r, now=1.1)
    assert p.queue() == [1, 2, 3, 4, 5] and not p.evicted
    assert p.allocate("s", [40], 0, now=2.0) == [1]


def test_events_correct_the_model() -> None:
    p = RankPool(num_gpu_blocks=4)  # 3 usable
    p.allocate("a", [1, 2], 0, now=0.0)
    p.free("a", now=9.0)
    p.stored([1, 8], now=1.0)  # 1 known; 8 unpredicted (another router's request): takes the fresh slot
    assert p.queue() == [2, 1, 8]
    p.stored([9], now=2.0)  # no fresh block left: LRU drops 2 for it
    assert p.queue() == [1, 8, 9] and list(p.evicted) == [2]
    p.removed([8])  # an eviction the model missed: its slot is the next one taken
    assert p.queue() == [None, 1, 9]
    assert p.allocate("b", [5], 0, now=3.0) == []
    p.cleared()
    assert p.queue() == [None, None] and not p.cached(1) and not p.evicted
    p.free("b", now=9.0)
    assert p.queue() == [None, None, None]  # its hash was cleared while it ran: it comes back unhashed


def test_pools_per_rank_are_made_once_the_capacity_is_known_and_follow_the_routes() -> None:
    s = ShadowPools()
    assert s.allocate(("w0", 0), "r1", [1, 2], 0, None, now=0.0) == []
    assert s.get(("w0", 0)) is None
    s.allocate(("w0", 0), "r1", [1, 2], 0, 3, now=0.0)
    s.free("r1", now=9.0)
    assert s.allocate(("w0", 0), "r2", [3, 4], 0, 3, now=1.0) == [2, 1]
    assert s.resident_prefix(("w0", 0), [1, 2], 2, now=1.0) == 0
    s.drop_worker("w0")
    assert s.get(("w0", 0)) is None and s.resident_prefix(("w0", 0), [1, 2], 2, now=1.0) == 2
    with pytest.raises(ValueError, match="null block"):
        RankPool(1)


def test_a_request_larger_than_the_pool_is_not_modelled() -> None:
    """vLLM never runs a prompt whose blocks exceed its pool (it refuses it past max_model_len), so such a
    route neither waits nor evicts here. Before, one (tracked, never sent) waited for its TTL and put every
    free block at risk: every other request's match on the rank was 0. Control: one that fits waits."""
    p = RankPool(num_gpu_blocks=5)  # 4 usable
    p.allocate("a", [1, 2], 0, now=0.0)
    p.allocate("b", [3, 4], 0, now=0.0)  # the pool is full of pinned blocks
    p.free("a", now=1.0)                 # 2 and 1 free, cached
    assert p.allocate("huge", list(range(100, 105)), 0, now=2.0) == []     # 5 blocks > 4 usable
    assert p.num_waiting() == 0 and p.at_risk() == set()
    assert p.resident_prefix([1, 2], 2, now=2.0) == 2                      # NOTE: before, 0
    p.free("huge", now=3.0)                                               # its end is a no-op
    assert p.allocate("fits", [5, 6, 7], 0, now=4.0) == [] and p.num_waiting() == 1
    assert p.at_risk() == {1, 2} and p.resident_prefix([1, 2], 2, now=4.0) == 0


def test_a_waiting_requests_own_hits_at_the_front_are_touched_not_taken_so_the_blocks_behind_are_at_risk() -> None:
    """A waiting turn whose previous turn's blocks lie at the queue's front touches them out of the queue when it is
    admitted, then takes its new blocks from what lies behind them: another conversation's blocks there are at risk.
    Before, its hits counted toward the blocks it takes, and a route trusted blocks that its admission evicted."""
    p = RankPool(num_gpu_blocks=9)  # 8 usable
    p.allocate("x", [10, 11, 12, 13], 0, now=0.0)  # running: pinned until the end
    p.allocate("w", [1, 2], 0, now=0.0)
    p.allocate("c", [30, 31], 0, now=0.0)
    p.free("w", now=1.0)
    p.free("c", now=1.0)
    assert p.queue() == [2, 1, 31, 30]
    assert p.allocate("w2", [1, 2, 3, 4, 5], 0, now=2.0) == []  # touches 1, 2 and needs 3 new: 5 > 4 free, waits
    assert p.num_waiting() == 1
    assert p.at_risk() == {30, 31}
    assert p.resident_prefix([30, 31], 2, now=2.0) == 0
    assert p.free("x", now=3.0) == [31, 30, 13]  # w2 admitted: what it evicts is what was at risk (and 13, freed now)


def test_waiting_requests_are_replayed_in_order_so_a_later_ones_hit_can_be_taken_by_an_earlier_one() -> None:
    """Two requests wait, first come, first served. The first takes its new blocks from the queue's front, where the
    second's hit lies (a prefix another conversation shares, say): those blocks are evicted, not touched, and a
    route for that prefix must not count on them. Before, every waiting request's hit counted as touched, and the
    shared prefix was claimed resident."""
    p = RankPool(num_gpu_blocks=11)  # 10 usable
    p.allocate("x", [10, 11, 12, 13, 14, 15], 0, now=0.0)  # running: 6 pinned
    p.allocate("b1", [1, 2], 0, now=0.0)
    p.free("b1", now=0.5)
    p.allocate("c", [30, 31], 0, now=0.6)
    p.free("c", now=0.7)
    assert p.queue() == [2, 1, 31, 30]
    assert p.allocate("a", [50, 51, 52, 53, 54], 0, now=1.0) == []  # 5 new, 4 free: waits
    assert p.allocate("b2", [1, 2, 3], 0, now=1.1) == []  # behind it
    assert p.at_risk() == {1, 2, 30, 31}
    assert p.resident_prefix([1, 2, 60], 2, now=1.2) == 0
    # x's blocks join the tail, last first; a takes 2, 1, 31, 30, 15; b2, its hit gone, needs 3 new: 14, 13, 12
    assert p.free("x", now=2.0) == [2, 1, 31, 30, 15, 14, 13, 12]
