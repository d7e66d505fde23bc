"""A worker whose replay socket floods the controller with events never freezes it (issue #31 item 1).

The peer is a real ZMQ ROUTER, in its own thread, that answers every replay request with many
batches of 600 `AllBlocksCleared` events each (vLLM's wire format), well inside the batch and byte
caps of one replay. Another tenant calls WhoAmI every 10 ms from its own thread meanwhile. Before
the fix, the controller applied a whole replay on its event loop without yielding (and again on
every tail poll): WhoAmI waited for it. Now events are applied in slices that yield, each rank has
an event budget, and the worker that overruns it is marked faulty: not routed to, listed as
phase "faulty", counted in the metrics. The full-scale flood of the issue (19,000 batches) is
bench/event_flood.py, with these helpers (tests/support/kv_flood.py).
"""

from __future__ import annotations

from pathlib import Path

from support.kv_flood import run_flood


async def test_a_flooding_replay_endpoint_does_not_freeze_the_controller(tmp_path: Path) -> None:
    r = await run_flood(tmp_path, batches=1500)  # 900,000 events per replay
    print(
        f"register {r['register_s']:.2f}s; WhoAmI n={len(r['latencies'])} p50={r['p50'] * 1e3:.1f}ms "
        f"p99={r['p99'] * 1e3:.1f}ms max={r['max'] * 1e3:.0f}ms; replay requests {r['requests']}; rows {r['rows']}"
    )
    assert not r["errors"] and len(r["latencies"]) > 50
    assert r["p99"] < 0.1, f"another tenant's WhoAmI p99 {r['p99'] * 1e3:.0f} ms during the flood"
    assert r["rows"][("flooder", 0)] == ("faulty", False)
    assert (
        r["rows"][("honest", 0)][1] and r["rows"][("honest", 0)][0] != "faulty"
    )  # control: not every worker
    assert r["faulty"]["flooder"] == 1 and r["faulty"]["honest"] in (None, 0)
