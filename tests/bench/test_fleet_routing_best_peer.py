"""The fleet routing report's best peer per metric: only peers count (never kvfleet's own contenders), and on
prefilled tokens only a peer that completed every request, where one did."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from peers.report import best_peers  # noqa: E402


def _run(name: str, kind: str, prefilled: int, ok: int, p99: float = 1.0, rps: float = 10.0) -> dict[str, Any]:
    return {"contender": name, "kind": kind,
            "summary": {"prefilled": prefilled, "ok": ok, "n": 192, "ttft_p99": p99, "rps": rps}}


def test_a_peer_that_lost_requests_is_not_the_best_on_prefill() -> None:
    cell = {"runs": [
        _run("kvfleet", "kvfleet", 90_000, 192),
        _run("kvfleet-ctl", "kvfleet", 80_000, 192, p99=0.1, rps=99.0),  # never a peer, however good
        _run("kvfleet-blind", "blind", 70_000, 192),
        _run("vllm-cache_aware", "vllm", 95_000, 189),  # three timed out before a worker ran them
        _run("sticky", "sticky", 100_000, 192),
    ]}
    b = best_peers(cell)
    assert b["prefilled"] is not None and b["prefilled"][0] == "sticky"
    assert b["ttft_p99"] is not None and b["ttft_p99"][0] in ("vllm-cache_aware", "sticky")
    assert b["rps"] is not None and b["rps"][0] in ("vllm-cache_aware", "sticky")
    # control: where no peer completed every request, the least prefill of them all
    cell["runs"][-1] = _run("sticky", "sticky", 100_000, 190)
    b = best_peers(cell)
    assert b["prefilled"] is not None and b["prefilled"][0] == "vllm-cache_aware"
