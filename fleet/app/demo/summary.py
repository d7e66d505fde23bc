"""The demo's summary: the live run's figures beside the offline replay of the same trace under
other routings (session-sticky, greedy with perfect knowledge, lifecycle-blind, round-robin). Every figure is a count of tokens or routes (docs/demo.md).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from fleet.app.demo.live import LiveResult
from fleet.app.demo.model import PolicyResult, replay_all
from fleet.app.demo.workload import DemoConfig

ORDER = ("kvfleet", "vllm_router", "sticky", "greedy", "blind", "round_robin")
LABELS = {"kvfleet": "kvfleet (live)", "vllm_router": "vllm-router kv_aware (live replay)",
          "sticky": "session-sticky hash (skips sleeping)",
          "greedy": "greedy longest prefix, perfect knowledge", "blind": "prefix-aware, lifecycle-blind",
          "round_robin": "round-robin"}
NO_CLAIMS = frozenset({"round_robin", "sticky", "vllm_router"})  # routings that claim no warmth: stale is n/a


def live_figures(res: LiveResult) -> PolicyResult:
    """kvfleet's figures from the live run: the stand-ins' own reused-token counts."""
    out = PolicyResult.for_workers("kvfleet", res.trace.workers)
    for r in res.trace.requests():
        out.num_requests += 1
        out.count(r.worker, r.num_tokens)
        out.total_tokens += r.num_tokens
        out.reused_tokens += r.cached_tokens
        if r.claimed_tokens > 0:
            out.warm_routes += 1
            out.stale_warm_routes += r.sent_to_sleeping or r.cached_tokens < r.claimed_tokens
    out.to_sleeping = res.sent_to_sleeping
    return out


def summarize(cfg: DemoConfig, res: LiveResult, vllm_router: PolicyResult | None = None) -> dict[str, Any]:
    """Everything the demo reports, as plain data (the --json output). `vllm_router`: the trace
    replayed live through vLLM's router (fleet.app.demo.peers), when it ran."""
    replayed = replay_all(res.trace)
    if vllm_router is not None:
        replayed["vllm_router"] = vllm_router
    live = live_figures(res)
    pol = {"kvfleet": live.to_dict(), **{k: v.to_dict() for k, v in replayed.items() if k != "kvfleet"}}
    best, others, unranked = best_other(replayed)
    reqs = res.trace.requests()
    return {
        "workload": {"agents": cfg.agents, "turns": cfg.turns, "branches": cfg.branches,
                     "branch_turns": cfg.branch_turns, "requests": len(reqs), "workers": len(res.trace.workers),
                     "block_size": cfg.block_size, "num_blocks_per_worker": cfg.num_blocks,
                     "prompt_tokens": live.total_tokens, "longest_prompt": max((r.num_tokens for r in reqs), default=0),
                     "final_history_blocks": sum(_final_blocks(res, cfg.block_size).values())},
        "policies": pol,
        "best_other": best,
        "unranked": unranked,
        "kvfleet_over_best_other_prefill": round(live.prefill_tokens / others[best], 6) if others[best] else None,
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


def best_other(replayed: dict[str, PolicyResult]) -> tuple[str, dict[str, int], dict[str, int]]:
    """The other routing with the least prefill, the prefill of each routing ranked, and the routings left
    unranked (name -> requests never answered). NOTE: a routing that left requests unanswered prefilled for
    fewer requests; it was crowned "the best other routing" on that (vllm-router, 12 of 42 unanswered)."""
    unranked = {k: v.failed for k, v in replayed.items() if k != "kvfleet" and v.failed}
    others = {k: v.prefill_tokens for k, v in replayed.items() if k != "kvfleet" and k not in unranked}
    return min(others, key=lambda k: others[k]), others, unranked


def _final_blocks(res: LiveResult, block_size: int) -> dict[str, int]:
    """Blocks of each agent's last request (its history at the end)."""
    last: dict[str, int] = {}
    for r in res.trace.requests():
        last[r.agent] = -(-r.num_tokens // block_size)
    return last


def witness_line(q: dict[str, Any]) -> str:
    """The quarantine witness in one line, its two figures to 3 significant digits (0 stays 0)."""
    def fig(x: Any) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    return (f"quarantine witness ({q.get('agent')}, turn {q.get('turn')}, {q.get('tokens')} tokens, "
            f"{'write-time' if q.get('write_time') else 'late'}): max|Δ| evict-vs-never = "
            f"{fig(q.get('max_abs_delta'))}, control kept-vs-never = {fig(q.get('control'))}")


def render(summary: dict[str, Any]) -> Group:
    """The summary as rich tables."""
    w = summary["workload"]
    t = Table(title=f"Prefill on the same trace: {w['requests']} requests, {w['prompt_tokens']:,} prompt tokens, "
                    f"{w['workers']} stand-in workers x {w['num_blocks_per_worker']:,} blocks "
                    f"(final histories: {w['final_history_blocks']:,} blocks)", title_justify="left")
    for col in ("routing", "prefill tokens", "vs kvfleet", "hit rate", "requests per worker", "max/min",
                "stale warm routes", "requests to sleeping"):
        t.add_column(col, justify="left" if col == "routing" else "right")
    ours = summary["policies"]["kvfleet"]["prefill_tokens"] or 1
    for name in [n for n in ORDER if n in summary["policies"]]:
        p = summary["policies"][name]
        stale = "n/a" if name in NO_CLAIMS else str(p["stale_warm_routes"])
        share = "/".join(str(v) for v in p["per_worker"].values())
        mm = "inf" if p["max_min_share"] is None else f"{p['max_min_share']:.2f}"
        t.add_row(LABELS[name], f"{p['prefill_tokens']:,}", f"{p['prefill_tokens'] / ours:.2f}x",
                  f"{100 * p['hit_rate']:.1f}%", share, mm, stale,
                  str(p["to_sleeping"]) + (f" ({p['failed']} never answered)" if p.get("failed") else ""),
                  style="bold" if name == "kvfleet" else None)
    q, f, m = summary["quarantine"], summary["fork"], summary["model_fidelity"]
    lines = [
        f"kvfleet prefill / the best other routing ({LABELS[summary['best_other']]}): "
        f"{summary['kvfleet_over_best_other_prefill']}",
        *[f"{LABELS[k]}: not ranked, {n} of {summary['policies'][k]['requests']} requests never answered (its "
          "prefill and hit rate count the answered ones only)" for k, n in summary.get("unranked", {}).items()],
        *([] if "vllm_router" in summary["policies"] else
          ["vllm-router row: not installed (./dev.sh bench fleet_routing installs it; the demo then replays "
           "its trace through it)"]),
        f"offline model fidelity: kvfleet's choices replayed -> {m['kvfleet_replayed_prefill']:,} prefill tokens vs "
        f"{m['kvfleet_live_prefill']:,} live (delta {m['delta']})",
        witness_line(q),
        f"fork: {f.get('parent')} -> {', '.join(f.get('branches', []))} at {f.get('prefix_tokens')} tokens, "
        f"{f.get('branch_turns')} turns each",
    ]
    lines += [f"turn {e['turn']}: {e['event']}" for e in summary["lifecycle"] if "sleep" in e["event"]
              or "wake" in e["event"]]
    return Group(t, *(Text(x) for x in lines))
