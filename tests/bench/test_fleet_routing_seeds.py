"""The fleet routing bench's runs under several trace seeds, pooled (bench/peers/seeds.py): runs that differ in more
than the seed are refused, files of different cells (and commits) are pooled cell by cell, the pooled best peer is
fixed by every run, and the seed-by-seed count takes each seed's own best peer."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.seeds import check, main, report  # noqa: E402


def _run(name: str, kind: str, prefilled: int, lost: int = 0, counters: dict[str, float] | None = None) -> dict[str, Any]:
    """A saved run as fleet_routing writes it: 4 requests (`lost` of them timed out), one worker's counters."""
    recs = [{"status": 0 if i < lost else 200, "finish_reason": "stop", "ttft_s": None if i < lost else 0.05,
             "verdict": "", "cached_tokens": 0, "matched_tokens": 0, "attempts": 1, "issued_s": 0.0, "total_s": 0.1,
             "worker": "w0"} for i in range(4)]
    worker = {"queries": prefilled, "hits": 0, "arrivals": 4, "to_sleeping": 0}
    return {"contender": name, "kind": kind, "records": recs, "workers": {"w0": worker}, "events": [],
            "wall_s": 1.0, "timeout_s": 10.0, "proxy_counters": counters or {}}


def _results(seed: int, runs: list[dict[str, Any]], commit: str = "abc1234", think_s: float = 0.1,
             workload: str = "demo") -> dict[str, Any]:
    return {"commit": commit, "repeats": 3, "cells_arg": f"{workload}/tight",
            "options": {"seed": seed, "think_s": think_s, "timeout_s": 10.0},
            "cells": [{"workload": {"name": workload}, "cache": "tight", "runs": runs}]}


def test_runs_that_differ_in_more_than_the_seed_or_repeat_one_are_refused() -> None:
    a = _results(1, [_run("kvfleet", "kvfleet", 100)])
    assert check([a, _results(2, [_run("kvfleet", "kvfleet", 100)])]) == {"demo/tight": [1, 2]}
    # files of other cells are pooled cell by cell; the same seed may come once per cell
    assert check([a, _results(1, [], workload="tenants2"), _results(0, [])]) == {"demo/tight": [1, 0],
                                                                               "tenants2/tight": [1]}
    with pytest.raises(ValueError, match="demo/tight: runs of different commits"):
        check([a, _results(2, [], commit="def5678")])
    # another cell may come from another commit: each cell is pooled alone
    assert check([a, _results(1, [], commit="def5678", workload="tenants2")]) == {"demo/tight": [1], "tenants2/tight": [1]}
    with pytest.raises(ValueError, match="more than the seed"):
        check([a, _results(2, [], think_s=0.5)])
    with pytest.raises(ValueError, match="more than the seed"):  # a --quick run's cells are smaller
        check([a, {**_results(2, []), "quick": True}])
    with pytest.raises(ValueError, match="demo/tight comes twice under seed 1"):
        check([a, _results(1, [])])


def test_the_pooled_best_peer_is_fixed_by_every_run_and_each_seed_has_its_own() -> None:
    # seed 1: sticky lowest (median 90 vs 100); seed 2: kv_aware lowest (96 vs 130). Pooled over the six runs each,
    # kv_aware's median (97) is below sticky's (130), so the cell's best peer is kv_aware, whoever won one seed.
    s1 = [_run("kvfleet", "kvfleet", p) for p in (96, 98, 99)]
    s1 += [_run("sticky", "sticky", p) for p in (88, 90, 140)] + [_run("vllm-kv_aware", "vllm", p) for p in (100,) * 3]
    s2 = [_run("kvfleet", "kvfleet", p) for p in (94, 97, 96)]
    s2 += [_run("sticky", "sticky", p) for p in (130,) * 3] + [_run("vllm-kv_aware", "vllm", p) for p in (95, 96, 97)]
    text = report([_results(1, s1), _results(2, s2)])
    assert "(the pooled best peer: vllm-kv_aware)" in text
    assert "| kvfleet | 98 | 96 | 96 (6) | 0.99x |" in text  # pooled median_low of 94..99 against kv_aware's 97
    assert "| sticky | 90 | 130 | 130 (6) | 1.34x |" in text  # median_low of (88, 90, 130, 130, 130, 140)
    # seed by seed: 98 against sticky's 90 (a loss), 96 against kv_aware's 96 (level counts as at or below)
    assert "in 1 of 2 seeds (seed 1: 1.09x sticky; seed 2: 1.00x vllm-kv_aware)" in text


def test_a_peer_that_lost_requests_is_not_the_best_on_prefill() -> None:
    runs = [_run("kvfleet", "kvfleet", 100), _run("sticky", "sticky", 110), _run("vllm-cache_aware", "vllm", 50, 2)]
    text = report([_results(0, runs)])
    assert "(the pooled best peer: sticky)" in text and "in 1 of 1 seeds (seed 0: 0.91x sticky)" in text
    # its 2 requests not completed are shown, and its TTFT percentiles count them at the 10 s client timeout
    assert "| vllm-cache_aware | 50 | 50 (1) | 0.45x | 10,000 / 10,000 | 2 |" in text
    assert "judged" not in text  # no proxy judged tool results in these runs: no such column
    control = report([_results(0, [*runs[:2], _run("vllm-cache_aware", "vllm", 50)])])
    assert "(the pooled best peer: vllm-cache_aware)" in control


def test_the_tool_results_kvfleets_proxy_judged_and_withheld_are_summed_over_every_run() -> None:
    judged = {"judged CLEAN": 10.0, "judged SUSPECT": 1.0, "withheld placeholder": 1.0, "probes awake": 3.0}
    runs = [_run("kvfleet", "kvfleet", 100, counters=judged), _run("kvfleet", "kvfleet", 100, counters=judged),
            _run("sticky", "sticky", 110)]
    text = report([_results(0, runs)])
    assert "| TTFT p50 / p99 ms, pooled | requests not completed | tool results judged / withheld |" in text
    assert "| kvfleet | 100 | 100 (2) | 0.91x | 50 / 50 | 0 | 22 / 2 |" in text  # probes are not judged results
    assert "| sticky | 110 | 110 (1) | 1.00x | 50 / 50 | 0 | 0 / 0 |" in text


def test_a_file_that_is_not_a_saved_run_is_refused_by_name(tmp_path: Path) -> None:
    bad, partial = tmp_path / "bad.json", tmp_path / "partial.json"
    bad.write_text("{not json")
    partial.write_text('{"options": {"seed": 0}}')
    with pytest.raises(SystemExit, match="bad.json: not a saved fleet_routing run"):
        main([str(bad), "--no-docs"])
    with pytest.raises(SystemExit, match="seeds: a run has no 'cells'"):
        main([str(partial), "--no-docs"])
    with pytest.raises(SystemExit, match="missing.json: not a saved fleet_routing run"):
        main([str(tmp_path / "missing.json"), "--no-docs"])
