"""The fleet routing report's TTFT percentiles: which requests count, and at what."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.report import pct, summarize  # noqa: E402


def _run(recs: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    workers = {"w0": {"arrivals": len(recs), "to_sleeping": 0, "queries": 100, "hits": 0, "recomputed": 0}}
    return {"kind": "sticky", "records": recs, "workers": workers, "events": [], "wall_s": 1.0, "timeout_s": 10.0,
            **extra}


def _rec(status: int, ttft_s: float | None, finish: str | None = "length") -> dict[str, Any]:
    return {"status": status, "ttft_s": ttft_s, "total_s": ttft_s, "finish_reason": finish, "verdict": None,
            "matched_tokens": 0, "cached_tokens": None, "attempts": 1, "worker": None, "issued_s": 0.0}


def test_the_p99_of_192_requests_is_the_third_slowest() -> None:
    xs = [float(i) for i in range(192)]
    assert pct(xs, 99) == 189.0 and pct(xs, 50) == 96.0  # docs/benchmarks.md: "its third slowest"


def test_a_request_that_timed_out_after_its_first_token_keeps_that_ttft() -> None:
    fast = [_rec(200, 0.05) for _ in range(98)]
    s = summarize(_run([*fast, _rec(0, 9.8), _rec(0, 9.9)]))  # p99 of 100: the second slowest
    assert s["ttft_p99"] == 9.8 and not s["ttft_lower_bound"] and s["timed_out"] == 2
    # control: those that never had a first token count at the client timeout, and mark the tail a lower bound
    s = summarize(_run([*fast, _rec(0, None), _rec(0, None)]))
    assert s["ttft_p99"] == 10.0 and s["ttft_lower_bound"]

