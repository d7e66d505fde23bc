"""A request that is sent touches its cache hit, in vLLM and so in the block-pool shadow: a conversation whose turns
go out through untracked Routes (the SDK's Route) keeps its prefix at the tail of LRU, as vLLM keeps it.

An untracked Route leaves the shadow as it is (tests/controller/test_shadow_tenants.py), so the shadow learns a sent
request from its BlockStored events alone; their parent_block_hash names the hit. Before, the hit never moved: a
conversation's prefix kept the place its first turn gave it, the shadow predicted LRU evicting it where vLLM evicted
older blocks, and the conversation's next turn went COLD for the 5 s grace (the demo's prefill at 512 blocks per
worker: 126,380 tokens before that change, 161,452-171,132 with it, 127,596 with this).
"""

from __future__ import annotations

from pathlib import Path

from support.one_worker import one_worker
from test_shadow_tenants import KEY, NUM_BLOCKS, _chain, _salt, _send, _toks

from controller.shadow_pool import RankPool


def test_a_stored_blocks_parent_and_its_chain_rejoin_the_tail() -> None:
    p = RankPool(num_gpu_blocks=8)  # 7 usable
    p.stored([1, 2, 3], now=0.0)     # a conversation's first turn
    p.stored([4, 5], now=0.0)        # another prompt
    p.stored([6], now=0.0, parent=3)  # the conversation's second turn: it hit 1, 2, 3
    assert p.queue() == [None, 5, 4, 6, 3, 2, 1]  # its prefix after its new block: NOTE: before, [None, 3, 2, 1, 5, 4, 6]
    p.stored([7, 8], now=1.0)
    assert list(p.evicted) == [5]  # NOTE: before, [3]
    assert p.resident_prefix([1, 2, 3], 3, now=1.0) == 3  # NOTE: before, 3 was predicted evicted (0 resident)


def test_a_parent_unknown_here_moves_nothing() -> None:
    p = RankPool(num_gpu_blocks=6)
    p.stored([1, 2], now=0.0)
    p.stored([3], now=0.0, parent=99)
    assert p.queue() == [None, None, 2, 1, 3]


async def test_a_conversation_sent_through_untracked_routes_stays_warm(tmp_path: Path) -> None:
    async with one_worker(tmp_path, NUM_BLOCKS) as (r, sim):
        turn1 = _toks(1, 10)
        await _send(r, sim, turn1, "agent")
        for i in range(2, 7):  # 50 blocks of other prompts: 60 of 63 used
            await _send(r, sim, _toks(i, 10), "other")
        turn2 = turn1 + _toks(90, 2)
        d2 = await r.route(turn2, "m", cache_salt=_salt("agent"), owner="agent")  # untracked, as the SDK routes
        assert (d2.verdict, d2.matched_tokens) == ("WARM", 160)
        await _send(r, sim, turn2, "agent")
        await _send(r, sim, _toks(7, 10), "other")  # 10 new blocks: LRU drops 9 of the oldest others
        turn3 = turn2 + _toks(91, 2)
        assert set(_chain(r, turn2, "agent")) <= set(sim.engine.resident_external())  # vLLM kept the conversation
        d3 = await r.route(turn3, "m", cache_salt=_salt("agent"), owner="agent")
        assert (d3.verdict, d3.matched_tokens) == ("WARM", 192)  # NOTE: before, its prefix was predicted evicted
        pool = r.shadow.get(KEY)
        assert pool is not None and set(_chain(r, turn2, "agent")) <= {h for h in pool.queue() if h is not None}


def test_the_chain_survives_an_undone_route_and_a_hit_withdraws_a_predicted_eviction() -> None:
    """Found by review: an unsent tracked route's admission, undone, dropped the links of the blocks it had taken, so
    the next turn's refresh stopped there and left the prefix at the front; and a refresh stopped at a block the
    shadow had predicted evicted, though the request's hit shows vLLM kept it."""
    p = RankPool(num_gpu_blocks=6)  # 5 usable
    p.stored([1, 2, 3], now=0.0)
    p.allocate("r", [7, 8, 9], 0, now=0.0, owner="x")  # tracked, never sent: takes 2 fresh and 3 ... then undone
    p.free("r", now=0.0)
    p.stored([4], now=1.0, parent=3)
    assert p.queue() == [None, 4, 3, 2, 1]  # NOTE: before, [None, 2, 1, 4, 3]
    q = RankPool(num_gpu_blocks=5)  # 4 usable
    q.stored([1, 2], now=0.0)
    q.allocate("t", [5, 6, 7], 0, now=0.0)  # a tracked route evicts 2 (predicted): only 2 free slots are fresh
    assert 2 in q.evicted and q.resident_prefix([1, 2], 2, now=0.5) == 1
    q.stored([3], now=1.0, parent=2)  # a request hit 1, 2: vLLM kept 2 (and its new block 3 found no free slot)
    assert not q.evicted and q.resident_prefix([1, 2], 2, now=1.0) == 2
    assert q.queue() == [1]  # 3 did not take 1's slot: 1 was a hit. NOTE: before, [3] (1 evicted, then withdrawn)
