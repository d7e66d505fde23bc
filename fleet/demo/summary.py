"""The demo's summary: the live run's figures beside the offline replay of the same trace under
the oracle and the two baselines. Every figure is a count of tokens or routes (docs/demo.md).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from fleet.demo.live import LiveResult
from fleet.demo.model import PolicyResult, replay_all
from fleet.demo.workload import DemoConfig

ORDER = ("kvfleet", "oracle", "blind", "round_robin")
LABELS = {"kvfleet": "kvfleet (live)", "oracle": "greedy oracle (true caches)", "blind": "prefix-aware, lifecycle-blind",
          "round_robin": "round-robin"}


def live_figures(res: LiveResult) -> PolicyResult:
    """kvfleet's figures from the live run: the stand-ins' own reused-token counts."""
    out = PolicyResult("kvfleet")
    for r in res.trace.requests():
        out.num_requests += 1
        out.total_tokens += r.num_tokens
        out.reused_tokens += r.cached_tokens
        if r.claimed_tokens > 0:
            out.warm_routes += 1
            out.stale_warm_routes += r.sent_to_sleeping or r.cached_tokens < r.claimed_tokens
    out.to_sleeping = res.sent_to_sleeping
    return out


def summarize(cfg: DemoConfig, res: LiveResult) -> dict[str, Any]:
    """Everything the demo reports, as plain data (the --json output)."""
    replayed = replay_all(res.trace)
    live = live_figures(res)
    pol = {"kvfleet": live.to_dict(), **{k: v.to_dict() for k, v in replayed.items() if k != "kvfleet"}}
    oracle = replayed["oracle"].prefill_tokens
    reqs = res.trace.requests()
    return {
        "workload": {"agents": cfg.agents, "turns": cfg.turns, "branches": cfg.branches,
                     "branch_turns": cfg.branch_turns, "requests": len(reqs), "workers": len(res.trace.workers),
                     "block_size": cfg.block_size, "num_blocks_per_worker": cfg.num_blocks,
                     "prompt_tokens": live.total_tokens, "longest_prompt": max((r.num_tokens for r in reqs), default=0)},
        "policies": pol,
        "kvfleet_over_oracle_prefill": round(live.prefill_tokens / oracle, 6) if oracle else None,
        "within_3pct_of_oracle": bool(oracle) and live.prefill_tokens <= 1.03 * oracle,
        "model_fidelity": {"kvfleet_replayed_prefill": replayed["kvfleet"].prefill_tokens,
                           "kvfleet_live_prefill": live.prefill_tokens,
                           "delta": replayed["kvfleet"].prefill_tokens - live.prefill_tokens,
                           "replayed_stale_warm_routes": replayed["kvfleet"].stale_warm_routes,
                           "replayed_to_sleeping": replayed["kvfleet"].to_sleeping},
        "quarantine": res.quarantine,
        "fork": res.fork,
        "lifecycle": res.lifecycle,
        "wall_s": round(res.wall_s, 1),
    }


def render(summary: dict[str, Any]) -> Group:
    """The summary as rich tables."""
    w = summary["workload"]
    t = Table(title=f"Prefill on the same trace: {w['requests']} requests, {w['prompt_tokens']:,} prompt tokens, "
                    f"{w['workers']} stand-in workers", title_justify="left")
    for col in ("routing", "prefill tokens", "vs oracle", "reused tokens", "hit rate", "stale warm routes",
                "requests to sleeping"):
        t.add_column(col, justify="left" if col == "routing" else "right")
    oracle = summary["policies"]["oracle"]["prefill_tokens"] or 1
    for name in ORDER:
        p = summary["policies"][name]
        stale = "n/a" if name == "round_robin" else str(p["stale_warm_routes"])
        t.add_row(LABELS[name], f"{p['prefill_tokens']:,}", f"{p['prefill_tokens'] / oracle:.3f}x",
                  f"{p['reused_tokens']:,}", f"{100 * p['hit_rate']:.1f}%", stale, str(p["to_sleeping"]),
                  style="bold" if name == "kvfleet" else None)
    q, f, m = summary["quarantine"], summary["fork"], summary["model_fidelity"]
    lines = [
        f"kvfleet / oracle prefill: {summary['kvfleet_over_oracle_prefill']} "
        f"({'within' if summary['within_3pct_of_oracle'] else 'NOT within'} 3%)",
        f"offline model fidelity: kvfleet's choices replayed -> {m['kvfleet_replayed_prefill']:,} prefill tokens vs "
        f"{m['kvfleet_live_prefill']:,} live (delta {m['delta']})",
        f"quarantine witness ({q.get('agent')}, turn {q.get('turn')}, {q.get('tokens')} tokens, "
        f"{'write-time' if q.get('write_time') else 'late'}): max|Δ| evict-vs-never = {q.get('max_abs_delta')}, "
        f"control kept-vs-never = {q.get('control')}",
        f"fork: {f.get('parent')} -> {', '.join(f.get('branches', []))} at {f.get('prefix_tokens')} tokens, "
        f"{f.get('branch_turns')} turns each",
    ]
    lines += [f"turn {e['turn']}: {e['event']}" for e in summary["lifecycle"] if "sleep" in e["event"]
              or "wake" in e["event"]]
    return Group(t, *(Text(x) for x in lines))
