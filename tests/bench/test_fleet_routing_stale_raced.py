"""The fleet routing report's split of stale warm routes: those that raced a reset or a sleep behind the
router's back on their own worker (the blocks were there when it routed), and the rest."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.summary import stale_raced  # noqa: E402


def _rec(worker: str, issued_s: float | None, ttft_s: float | None, matched: int, cached: int) -> dict[str, Any]:
    return {"worker": worker, "issued_s": issued_s, "ttft_s": ttft_s, "total_s": ttft_s, "verdict": "WARM",
            "matched_tokens": matched, "cached_tokens": cached}


RESET = {"verb": "reset_prefix_cache", "worker": "w1", "via": "direct", "ok": True, "took_s": 0.05, "t_s": 2.0}


def test_only_stale_routes_in_flight_across_an_action_behind_the_back_on_their_worker_count() -> None:
    recs = [
        _rec("w1", 1.9, 0.2, 512, 0),    # issued before the reset ended, first token after it began: raced
        _rec("w1", 1.0, 0.1, 512, 0),    # first token before the reset began: stale for another reason
        _rec("w2", 1.9, 0.2, 512, 0),    # another worker
        _rec("w1", 2.1, 0.2, 512, 0),    # issued after the reset ended: the router could have known
        _rec("w1", 1.9, 0.2, 512, 512),  # not stale
    ]
    assert stale_raced(recs, [RESET]) == 1
    assert stale_raced(recs, [{**RESET, "via": "controller"}]) == 0  # through the controller: it knew
    assert stale_raced(recs, [{**RESET, "verb": "sleep"}]) == 1
    assert stale_raced(recs, [{**RESET, "verb": "wake_up"}]) == 0
    assert stale_raced(recs, [{**RESET, "ok": False}]) == 0


def test_results_without_issue_times_say_nothing() -> None:
    assert stale_raced([_rec("w1", None, 0.2, 512, 0)], [RESET]) is None


def test_a_reset_races_until_its_cleared_event_is_published() -> None:
    """vLLM publishes a reset's AllBlocksCleared with its next engine step, after that step's forward pass (the
    stand-in too): until then no event has told any router, so a stale route issued in between raced it. A sleep's
    is not extended: the router watches the sleep itself."""
    recs = [
        _rec("w1", 2.1, 0.2, 512, 0),    # after the reset ended, before its event was published: raced
        _rec("w1", 2.4, 0.2, 512, 0),    # after the event: the router could have known
    ]
    published = {**RESET, "cleared_s": 2.3}
    assert stale_raced(recs, [published]) == 1
    assert stale_raced(recs, [RESET]) == 0  # control: without the publish time, only the action's own window
    assert stale_raced(recs, [{**published, "verb": "sleep"}]) == 0


def test_the_summary_table_says_na_where_no_verdict_was_read() -> None:
    from peers.report import stale_cell

    assert stale_cell({"stale_warm": None, "stale_raced": None}) == "n/a"  # AIPerf's records carry no verdict
    assert stale_cell({"stale_warm": 0, "stale_raced": 0}) == "0"  # counted, none: not "n/a"
    assert stale_cell({"stale_warm": 5, "stale_raced": 5}) == "5 (5 raced)"
    assert stale_cell({"stale_warm": 5, "stale_raced": 5, "warm": 440}, of_warm=True) == "5 (440), 5 raced"
    assert stale_cell({"stale_warm": None, "stale_raced": None, "warm": None}, of_warm=True) == "n/a"


def test_a_prompt_resident_whole_is_owed_all_but_its_last_block() -> None:
    """vLLM reuses at most the whole blocks of a prompt's first n - 1 tokens (the stand-in too, since it models
    that): a 64-token prompt matched whole and answered 48 cached is not stale; 32 is, and so is 48 where the match
    was not the whole prompt. NOTE: before, the first read stale."""
    from peers.summary import stale

    def rec(matched: int, cached: int, n: int | None) -> dict[str, Any]:
        return {**_rec("w1", 1.0, 0.1, matched, cached), "prompt_tokens": n}

    assert not stale(rec(64, 48, 64)) and stale(rec(64, 32, 64))
    assert stale(rec(64, 48, 70)) and not stale(rec(64, 64, 70))  # control: more prompt than match
    assert stale(rec(64, 48, None))  # no usage to read the prompt's length from: the match is owed whole
    assert not stale(rec(16, 0, 16))  # one block, resident whole: vLLM reuses none of it
