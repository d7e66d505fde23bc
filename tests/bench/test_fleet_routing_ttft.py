"""The fleet routing report's TTFT percentiles: which requests count, and at what, for the bench's own driver and
for AIPerf's (bench/peers/aiperf_driver.py reads AIPerf's per-request export)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.aiperf_driver import records  # noqa: E402
from peers.summary import pct, summarize  # noqa: E402


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


def _export(path: Path, errors: list[dict[str, Any] | None]) -> Path:
    """AIPerf 0.13's profile_export.jsonl shape: one line per request (the error's shape as AIPerf wrote it for a
    request its --request-timeout-seconds cut)."""
    lines = []
    for i, err in enumerate(errors):
        md = {"session_num": i, "request_start_ns": i * 10**9, "request_end_ns": i * 10**9 + 10**8}
        m = {"error_isl": {"value": 531, "unit": "tokens"}} if err else {
            "time_to_first_token": {"value": 50.0, "unit": "ms"}, "request_latency": {"value": 100.0, "unit": "ms"},
            "usage_prompt_tokens": {"value": 531, "unit": "tokens"},
            "usage_prompt_cache_read_tokens": {"value": 0, "unit": "tokens"}}
        lines.append(json.dumps({"metadata": md, "metrics": m, **({"error": err} if err else {})}))
    path.write_text("\n".join(lines) + "\n")
    return path


TIMEOUT = {"type": "TimeoutError", "message": "TimeoutError()", "cause": "CancelledError()",
           "cause_chain": ["TimeoutError", "CancelledError"]}


def test_requests_aiperf_timed_out_count_as_timed_out(tmp_path: Path) -> None:
    recs, _ = records(_export(tmp_path / "x.jsonl", [None] * 8 + [TIMEOUT] * 2), "mooncake")
    assert [r["status"] for r in recs] == [200] * 8 + [0] * 2
    s = summarize(_run(recs, driver={"name": "aiperf"}))
    assert s["timed_out"] == 2 and s["ok"] == 8
    assert s["ttft_p99"] == 10.0 and s["ttft_lower_bound"]  # at the client timeout, as the bench's own driver
    # control: another error stays a failure, outside the TTFT percentiles
    other = {"type": "ClientConnectorError", "message": "refused", "code": None}
    recs, _ = records(_export(tmp_path / "y.jsonl", [None] * 8 + [other] * 2), "mooncake")
    s = summarize(_run(recs, driver={"name": "aiperf"}))
    assert s["timed_out"] == 0 and s["errors"] == 2 and s["ttft_p99"] == 0.05 and not s["ttft_lower_bound"]
