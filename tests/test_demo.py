"""A shortened `kvfleet demo` end to end (3 agents x 8 turns) on the shared local Ray cluster:
the invariants the summary claims, each beside a control that shows it could fail."""

from __future__ import annotations

from fleet.cli.demo import run_demo
from fleet.demo.workload import DemoConfig


async def test_short_demo_invariants(ray_cluster: None) -> None:
    # The demo's fleet is scoped by its own store (actor names carry a hash of the store URL) and its
    # supervisors stop with its controller, so it shares the run's Ray cluster safely.
    cfg = DemoConfig(agents=3, turns=8)
    out = await run_demo(cfg)
    s, pol = out.summary, out.summary["policies"]
    live, oracle, blind, rr = pol["kvfleet"], pol["oracle"], pol["blind"], pol["round_robin"]
    for name, p in pol.items():
        print(f"{name:12s} prefill {p['prefill_tokens']:6d} reused {p['reused_tokens']:6d} "
              f"stale warm {p['stale_warm_routes']:2d} to sleeping {p['to_sleeping']:2d}")
    # figures are consistent: one trace, every token either reused or prefilled
    assert s["workload"]["requests"] == cfg.agents * cfg.turns + cfg.branches * cfg.branch_turns
    for p in pol.values():
        assert p["reused_tokens"] + p["prefill_tokens"] == p["total_tokens"] == s["workload"]["prompt_tokens"]
    # the offline model is the live workers' own code: kvfleet's choices replayed give the live numbers
    assert s["model_fidelity"]["delta"] == 0 and s["model_fidelity"]["replayed_to_sleeping"] == 0
    # fail-closed routing: nothing stale, nothing to a sleeping worker ...
    assert live["stale_warm_routes"] == 0 and live["to_sleeping"] == 0
    # ... while the same sleeps do catch a router blind to lifecycle (the control)
    assert blind["to_sleeping"] > 0 and blind["stale_warm_routes"] > 0
    assert live["prefill_tokens"] <= blind["prefill_tokens"] and live["prefill_tokens"] < rr["prefill_tokens"]
    assert oracle["prefill_tokens"] <= live["prefill_tokens"] <= 1.03 * oracle["prefill_tokens"]
    q = s["quarantine"]
    print(f"quarantine witness: max|d| = {q['max_abs_delta']}, control = {q['control']}")
    assert q["evicted"] and q["write_time"] and q["max_abs_delta"] == 0.0 and q["control"] > 0.0
    assert [e["event"].split()[0] for e in s["lifecycle"] if "via" in e["event"]] == \
        ["sleep", "sleep", "wake_up", "wake_up"]
    rows = {r.session_id: r for r in out.sessions}
    assert set(rows) == {"agent-0", "agent-1", "agent-2"}                    # the branches were closed
    assert rows["agent-1"].quarantined_spans == 1 and rows["agent-0"].quarantined_spans == 0
    assert len(out.workers) == 3 and out.nodes and out.nodes[0].hit_tokens > 0  # agents adopted the prompt
