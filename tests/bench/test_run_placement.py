"""bench/peers/placement.py on a hand-made run: requests land in the phase of their issued count, and the session
timeline shows where each went and what it prefilled."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from peers.placement import phase_names, phases, timeline  # noqa: E402

CELL = {"workload": {"requests": 10, "sleep_at": 0.3, "wake_at": 0.5, "reset_at": 0.7}}


def _rec(issued: int, session: str, prompt: int, cached: int, worker: str | None = "w0") -> dict:
    return {"issued": issued, "issued_s": issued / 10, "session": session, "prompt_tokens": prompt,
            "cached_tokens": cached, "worker": worker}


def test_phases_split_prefill_by_the_issued_count_at_each_hazard_fraction() -> None:
    run = {"records": [_rec(0, "a", 100, 0), _rec(2, "b", 50, 10), _rec(3, "a", 120, 100), _rec(5, "b", 60, 40),
                       _rec(6, "a", 130, 0), _rec(7, "b", 70, 0), _rec(9, "a", 140, 130)]}
    assert phases(CELL, run) == [100 + 40, 20, 20 + 130, 70 + 10]
    # a request that failed before its worker answered has no counts: it adds nothing (it raised TypeError before)
    run["records"].append(_rec(8, "b", None, None))  # type: ignore[arg-type]
    assert phases(CELL, run) == [100 + 40, 20, 20 + 130, 70 + 10]
    assert phase_names(CELL) == ["issued 0-30%", "issued 30-50%", "issued 50-70%", "issued 70-100%"]


def test_the_timeline_puts_each_request_in_its_sessions_column_with_its_worker() -> None:
    run = {"records": [_rec(1, "s-b", 50, 10, "w1"), _rec(0, "s-a", 100, 0), _rec(2, "s-a", 120, 100, None)]}
    lines = timeline(run, 0, 2)
    assert len(lines) == 3  # a header and requests 0 and 1, in issued order
    assert lines[1].split()[:3] == ["0", "0.00", "w0:100/100"]
    assert lines[2].split()[:3] == ["1", "0.10", "w1:40/50"]
    assert "?:20/120" in timeline(run, 2, 3)[1]  # a peer's record names no worker
