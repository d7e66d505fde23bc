"""The router's working-set ledger: exact demand per rank as conversations grow, move and expire."""

from __future__ import annotations

from controller.demand import WorkingSet

SYS = [1, 2, 3, 4]  # 4 blocks every conversation shares


def conv(tag: int, turns: int) -> list[int]:
    return SYS + [tag * 1000 + i for i in range(turns)]


def test_demand_counts_own_blocks_and_the_shared_prefix_once() -> None:
    ws = WorkingSet()
    ws.place(("w0", 0), conv(1, 3), 4, now=0.0)  # 7 blocks, 4 shared
    ws.place(("w0", 0), conv(2, 5), 4, now=0.0)  # 9 blocks, 4 shared
    assert ws.demand(("w0", 0)) == 4 + 3 + 5 and ws.demand(("w1", 0)) == 0


def test_the_next_turn_replaces_its_record_and_can_move_it() -> None:
    ws = WorkingSet()
    ws.place(("w0", 0), conv(1, 3), 4, now=0.0)
    ws.place(("w0", 0), conv(2, 5), 4, now=0.0)
    ws.place(("w0", 0), conv(1, 6), 4, now=1.0)  # conversation 1's next turn: 3 -> 6 own blocks
    assert ws.demand(("w0", 0)) == 4 + 6 + 5 and len(ws) == 2
    prev = ws.previous(conv(2, 7))
    assert prev is not None and prev[1].num_blocks == 9
    assert ws.demand_with(("w0", 0), prev[1], 0, 0) == 4 + 6  # what w0 needs if conversation 2 leaves
    ws.place(("w1", 0), conv(2, 7), 4, now=2.0)  # conversation 2 moves to w1
    assert (ws.demand(("w0", 0)), ws.demand(("w1", 0))) == (4 + 6, 4 + 7) and len(ws) == 2


def test_records_expire_after_their_ttl_and_with_their_rank() -> None:
    ws = WorkingSet(ttl_s=10.0)
    ws.place(("w0", 0), conv(1, 3), 4, now=0.0)
    ws.place(("w1", 0), conv(2, 3), 4, now=5.0)
    ws.expire(now=12.0)  # conversation 1 idle 12 s > 10 s; conversation 2 idle 7 s
    assert (ws.demand(("w0", 0)), ws.demand(("w1", 0))) == (0, 7)
    ws.forget_rank(("w1", 0))
    assert ws.demand(("w1", 0)) == 0 and len(ws) == 0


def test_demand_with_a_turn_placed_here_or_elsewhere() -> None:
    ws = WorkingSet()
    ws.place(("w0", 0), conv(1, 3), 4, now=0.0)
    ws.place(("w0", 0), conv(2, 5), 4, now=0.0)
    prev = ws.previous(conv(1, 6))
    assert prev is not None
    # conversation 1's next turn (10 blocks, 4 shared): on w0 it replaces its 3 own blocks with 6 ...
    assert ws.demand_with(("w0", 0), prev[1], 10, 4) == 4 + 6 + 5
    # ... on w1 it brings the shared prefix and its 6 own blocks there (w0 keeps its record until placed)
    assert ws.demand_with(("w1", 0), prev[1], 10, 4) == 4 + 6
    assert ws.demand_with(("w1", 0), None, 3, 0) == 3  # a new conversation sharing nothing


def test_an_over_committed_worker_loses_a_conversation_it_holds_warm() -> None:
    """Cost: warm on w0 but w0's working set is 400 blocks over its capacity; w1 has room. The
    request moves (its prefill on w1 is less than w0's recurring excess); with w0 within capacity
    it stays (control)."""
    from controller.cost import CandidateState, CostConfig, rank

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

    over = rank(CostConfig(), n, cands(1400), 256.0)
    fits = rank(CostConfig(), n, cands(900), 256.0)
    print(
        "over-committed:",
        [(r.state.worker, r.terms.total) for r in over],
        "within capacity:",
        [(r.state.worker, r.terms.total) for r in fits],
    )
    assert over[0].state.worker == "w1" and over[1].terms.evicted_tokens == 400 * B
    assert fits[0].state.worker == "w0" and fits[0].terms.evicted_tokens == 0
