"""The fleet routing bench's records of kvfleet-blind (bench/peers/blind.py, real stand-ins) name the worker each
request went to, as kvfleet's do: the report's "raced" split of stale warm routes matches a route's worker against
the worker a reset or a sleep hit."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import fleet_routing as fr  # noqa: E402
from peers.launch import CONTENDERS  # noqa: E402
from peers.summary import summarize  # noqa: E402
from routing_trace import agents  # noqa: E402

pytestmark = pytest.mark.timeout(60)


async def test_every_blind_record_names_the_worker_that_counted_it(tmp_path: Path) -> None:
    wl = agents("smoke", 0, num_agents=4, num_workers=2, turns=3, think_s=0.02, system_words=120)
    opt = fr.Options(timeout_s=5.0, sleep_min_s=0.3, sleep_max_s=2.0, think_s=0.02)
    r = await fr.run_one(CONTENDERS["kvfleet-blind"], wl, 256, opt, tmp_path)
    assert "unavailable" not in r, r.get("unavailable")
    assert [x["status"] for x in r["records"]] == [200] * wl.num_requests
    # the blind front never retries: each request reached exactly the worker its record names
    named = Counter(x["worker"] for x in r["records"])
    assert named == {w: s["arrivals"] for w, s in r["workers"].items() if s["arrivals"]}, named
    s = summarize(r)
    assert s["warm"] > 0 and isinstance(s["stale_raced"], int)
