"""The router's working-set ledger: demand per rank weighted by measured return rates, as conversations
grow, move, expire and lose their cache. Evidence without decay (window=inf) so every rate is exact."""

from __future__ import annotations

import math

from controller.cost import CandidateState, CostConfig, order
from controller.demand import DemandLedger

SYS = [1, 2, 3, 4]  # 4 blocks every conversation shares; their group is the fork block, 4
G = 4


def conv(tag: int, turns: int) -> list[int]:
    return SYS + [tag * 1000 + i for i in range(turns)]


def one_shot(tag: int, n: int = 10) -> list[int]:
    return [tag * 100_000 + i for i in range(n)]


def test_one_shots_that_never_return_weigh_nothing_and_returns_earn_weight() -> None:
    ws = DemandLedger(window=math.inf)
    for i in range(8):
        ws.place(("w0", 0), one_shot(i), 0, now=0.0)
    assert ws.demand(("w0", 0)) == 0 and len(ws) == 8  # recorded, but no evidence that any returns
    # the same prompt again is a return: (group 0, first) now 1 of 9 placed+1 -> rate 0.1
    ws.place(("w0", 0), one_shot(7), 0, now=1.0)
    assert ws.evidence.rate((0, 0)) == 1 / 9
    # three conversations on w1, each back for a 2nd turn: (G, first) rate 3/4; (G, later) 0/4
    for tag in (1, 2, 3):
        ws.place(("w1", 0), conv(tag, 2), 4, now=0.0, group=G)
    for tag in (1, 2, 3):
        ws.place(("w1", 0), conv(tag, 3), 4, now=1.0)
    assert ws.evidence.rate((G, 0)) == 3 / 4 and ws.evidence.rate((G, 1)) == 0.0
    assert ws.demand(("w1", 0)) == 0  # later turns have not been seen to return yet
    # a new conversation there (7 blocks, 4 shared): 3/4 * 3 own + 3/4 * 4 shared = 5.25 -> 5
    assert ws.demand_with(("w1", 0), None, 7, 4, group=G) == 5
    # a 3rd turn of each: (G, later) 3 returned of 6 placed -> 3/7; 3 records of 3 own blocks + shared
    for tag in (1, 2, 3):
        ws.place(("w1", 0), conv(tag, 4), 4, now=2.0)
    assert ws.evidence.rate((G, 1)) == 3 / 7
    assert ws.demand(("w1", 0)) == round(3 / 7 * (3 * 4) + 3 / 7 * 4)  # 6.86 -> 7


def teach_returns(ws: DemandLedger, group: int, n: int) -> None:
    """n conversations on a rank of their own, each back twice: both stages of `group` earn weight."""
    for i in range(n):
        for t in range(3):
            ws.place(("teach", 0), conv(900 + i, t + 1), 4, now=0.0, group=group)
    ws.forget_rank(("teach", 0))


def test_the_next_turn_replaces_its_record_and_can_move_it() -> None:
    ws = DemandLedger(window=math.inf)
    teach_returns(ws, G, 3)  # (G, first): 3/4; (G, later): 3/7
    r0, r1 = 3 / 4, 3 / 7
    ws.place(("w0", 0), conv(1, 3), 4, now=0.0, group=G)  # 7 blocks, 4 shared
    ws.place(("w0", 0), conv(2, 5), 4, now=0.0, group=G)  # 9 blocks
    r0 = 3 / 6  # two more first requests placed, none returned yet
    assert ws.demand(("w0", 0)) == round(r0 * (3 + 5) + r0 * 4)
    ws.place(("w0", 0), conv(1, 6), 4, now=1.0)  # conversation 1's next turn: a return; 6 own blocks
    r0, r1 = 4 / 6, 3 / 8
    assert len(ws) == 2 and ws.demand(("w0", 0)) == round(r1 * 6 + r0 * 5 + r0 * 4)
    prev = ws.previous(conv(2, 7))
    assert prev is not None and prev[1].num_blocks == 9 and prev[1].turns == 1
    assert ws.demand_with(("w0", 0), prev[1], 0, 0) == round(r1 * 6 + r1 * 4)  # if conversation 2 left
    ws.place(("w1", 0), conv(2, 7), 4, now=2.0)  # conversation 2 moves to w1 (and returned)
    r0, r1 = 5 / 6, 3 / 9
    assert len(ws) == 2
    assert (ws.demand(("w0", 0)), ws.demand(("w1", 0))) == (round(r1 * 10), round(r1 * 11))


def test_records_expire_after_their_ttl_and_leave_with_a_cache_loss() -> None:
    ws = DemandLedger(ttl_s=10.0, window=math.inf)
    teach_returns(ws, G, 4)  # (G, later): 4 returned of 8 placed -> 4/9
    ws.place(("w0", 0), conv(1, 3), 4, now=0.0, group=G)
    ws.place(("w1", 0), conv(2, 3), 4, now=5.0, group=G)
    ws.place(("w0", 0), conv(1, 4), 4, now=6.0)  # later turns now: each 4/10 of its 8 blocks
    ws.place(("w1", 0), conv(2, 4), 4, now=7.0)
    assert ws.demand(("w0", 0)) == ws.demand(("w1", 0)) == round(4 / 10 * 8) == 3
    ws.expire(now=16.5)  # conversation 1 idle 10.5 s > 10 s; conversation 2 idle 9.5 s
    assert (ws.demand(("w0", 0)), ws.demand(("w1", 0))) == (0, 3)
    ws.forget_rank(("w1", 0))  # AllBlocksCleared, sleep or reset on w1
    assert ws.demand(("w1", 0)) == 0 and len(ws) == 0


def test_an_over_committed_worker_loses_a_conversation_it_holds_warm() -> None:
    """Cost: warm on w0 but w0's working set is 400 blocks over its capacity; w1 has room. The
    request moves (its prefill on w1 is less than w0's recurring excess); with w0 within capacity
    it stays (control)."""
    B, n = 16, 2000  # a 2,000-token conversation, 1,900 tokens warm on w0

    def cands(w0_demand: int) -> list[CandidateState]:
        w0 = CandidateState(
            "w0",
            0,
            True,
            True,
            B,
            1900,
            num_resident_blocks=1000,
            num_gpu_blocks=1000,
            num_demand_blocks=w0_demand,
        )
        w1 = CandidateState(
            "w1",
            0,
            True,
            True,
            B,
            0,
            num_resident_blocks=200,
            num_gpu_blocks=1000,
            num_demand_blocks=200 + n // B,
        )
        return [w0, w1]

    over = order(CostConfig(), n, cands(1400), 256.0)
    fits = order(CostConfig(), n, cands(900), 256.0)
    assert over[0].state.worker == "w1" and over[1].terms.evicted_tokens == 400 * B
    assert fits[0].state.worker == "w0" and fits[0].terms.evicted_tokens == 0
