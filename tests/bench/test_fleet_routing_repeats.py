"""Several runs of the fleet routing bench reported as one (bench/peers/repeats.py): the median per contender and
metric with its range, sums for the counts one bad run must not hide, and the best peer chosen by the medians."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.repeats import collapse, merge  # noqa: E402
from peers.report import best_peers  # noqa: E402


def _run(name: str, kind: str, prefilled: int, p99: float, stale: int | None = 0) -> dict[str, Any]:
    summary = {"prefilled": prefilled, "recomputed": 0, "ttft_p50": p99 / 2, "ttft_p99": p99, "rps": 10.0,
               "ok": 192, "n": 192, "stale_warm": stale, "stale_raced": None if stale is None else 0,
               "to_sleeping": 1, "ttft_lower_bound": False}
    return {"contender": name, "kind": kind, "summary": summary}


def _cell(*runs: dict[str, Any]) -> dict[str, Any]:
    return {"workload": {"name": "agents16x4"}, "cache": "tight", "runs": list(runs)}


def test_a_repeated_contender_becomes_its_medians_with_ranges_and_summed_counts() -> None:
    cell = _cell(_run("kvfleet", "kvfleet", 100, 0.3), _run("kvfleet", "kvfleet", 90, 0.9, stale=2),
                 _run("kvfleet", "kvfleet", 120, 0.2), _run("sticky", "sticky", 95, 1.0, stale=None))
    collapse(cell)
    assert [r["contender"] for r in cell["runs"]] == ["kvfleet", "sticky"]
    k, peer = (r["summary"] for r in cell["runs"])
    assert (k["prefilled"], k["ttft_p99"], k["runs"]) == (100, 0.3, 3)
    assert k["spread"]["prefilled"] == (90, 120) and k["spread"]["ttft_p99"] == (0.2, 0.9)
    assert (k["stale_warm"], k["to_sleeping"], k["ok"], k["n"]) == (2, 3, 576, 576)
    assert "spread" not in peer and peer["stale_warm"] is None  # a single run is left as it was


def test_even_counts_take_the_lower_middle_a_measured_figure() -> None:
    cell = _cell(_run("sticky", "sticky", 100, 1.0, None), _run("sticky", "sticky", 110, 2.0, None))
    collapse(cell)
    s = cell["runs"][0]["summary"]
    assert (s["prefilled"], s["ttft_p99"], s["stale_warm"]) == (100, 1.0, None)


def test_the_best_peer_is_chosen_by_the_medians_not_by_one_lucky_run() -> None:
    runs = [_run("sticky", "sticky", p, 1.0, None) for p in (80, 130, 125)]
    runs += [_run("vllm-kv_aware", "vllm", p, 1.0, None) for p in (100, 101, 99)]
    cell = _cell(*runs)
    control = _cell(*(r for r in runs if r is runs[0] or r is runs[3]))  # the first run alone
    assert best_peers(control)["prefilled"][0] == "sticky"
    collapse(cell)
    best = best_peers(cell)["prefilled"]
    assert best[0] == "vllm-kv_aware" and best[1]["prefilled"] == 100


def _results(commit: str, prefilled: int, cache: str = "tight") -> dict[str, Any]:
    cell = _cell(_run("kvfleet", "kvfleet", prefilled, 0.3))
    cell["cache"] = cache
    return {"commit": commit, "took_s": 60.0, "options": {"seed": 0}, "cells": [cell]}


def test_saved_runs_merge_only_within_one_commit_and_the_same_cells() -> None:
    merged = merge([_results("a" * 40, 100), _results("a" * 40, 90), _results("a" * 40, 120)])
    assert merged["repeats"] == 3 and merged["took_s"] == 180.0
    collapse(merged["cells"][0])
    assert merged["cells"][0]["runs"][0]["summary"]["spread"]["prefilled"] == (90, 120)
    with pytest.raises(ValueError, match="different commits"):
        merge([_results("a" * 40, 100), _results("b" * 40, 100)])
    with pytest.raises(ValueError, match="different cells"):
        merge([_results("a" * 40, 100), _results("a" * 40, 100, cache="ample")])


def test_failures_of_a_repeated_contender_make_one_sentence_with_each_runs_count() -> None:
    from peers.report import observations

    def run(failed: int) -> dict[str, Any]:
        r = _run("sticky", "sticky", 100, 1.0, None)
        r["records"] = [{"status": 0, "error": "no complete answer within 10.0s", "ttft_s": None}] * failed
        r["summary"].update(ok=192 - failed)
        return r

    lines = observations([_cell(run(2), run(0), run(3))])
    assert lines == ["sticky in agents16x4/tight: 2, 0, 3 of 192 requests failed (its 3 runs) "
                     "(most often, 5x: `no complete answer within 10.0s`)."]
    assert observations([_cell(run(0), run(0))]) == []  # control: no failure, no sentence
