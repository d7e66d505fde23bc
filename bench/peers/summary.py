"""Each fleet routing run's figures: prefilled tokens (the stand-ins' counters), TTFT percentiles (client side,
timed-out requests counted at the timeout), request shares, and the stale warm routes with those that raced an
action behind the router's back."""

from __future__ import annotations

from typing import Any

BLOCK_SIZE = 16  # the stand-ins' block size in every cell of the routing bench (bench/fleet_routing.py)


def pct(xs: list[float], p: float) -> float | None:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else None


def hist_quantile(h: dict[str, float], q: float) -> float | None:
    """Upper bound of the histogram bucket holding quantile q ({le: cumulative count})."""
    items = sorted((float(k), v) for k, v in h.items())
    if not items or items[-1][1] <= 0:
        return None
    return next(le for le, c in items if c >= q * items[-1][1])


def completed(rec: dict[str, Any]) -> bool:
    """A 200 whose stream the worker did not abort (a 200 stream can still end finish_reason abort)."""
    return bool(rec["status"] == 200 and rec.get("finish_reason") != "abort")


def prefilled(workers: list[dict[str, Any]]) -> int:
    """Prompt tokens the workers computed: queries less hits, plus the prompts a preemption made them compute
    again (older results have no "recomputed": none were counted then)."""
    return sum(w["queries"] - w["hits"] + w.get("recomputed", 0) for w in workers)


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    recs, ws = run["records"], list(run["workers"].values())
    ok = [r for r in recs if completed(r)]
    q, hits = sum(w["queries"] for w in ws), sum(w["hits"] for w in ws)
    arrivals, tokens = [w["arrivals"] for w in ws], [w["queries"] for w in ws]
    # NOTE: a request that timed out waited the whole client timeout for a first token that never came; left out,
    # a contender that timed out was given a better tail than one that answered late. It counts at the timeout (a
    # lower bound: the cell's percentile is then marked ">=")
    timeout = run.get("timeout_s")
    lost = [timeout for r in recs if r["status"] == 0 and r["ttft_s"] is None] if timeout else []
    # NOTE: one that timed out after its first token has a TTFT of its own; it was in neither list, so a first token
    # that came at 9.9 s of a 10 s timeout left the tail, where one that never came counted at 10 s
    late = [r["ttft_s"] for r in recs if r["status"] == 0 and r["ttft_s"] is not None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None] + late + lost
    ours = run["kind"] in ("kvfleet", "blind") and "driver" not in run  # AIPerf does not read our verdict headers
    slept = [e.get("slept_s") for e in run["events"] if e["verb"] == "wake_up"]
    return {
        "prefilled": prefilled(ws),
        # of them, the prompts a preemption made the workers compute again (a reset of running requests behind the
        # router's back): it moves a cell's totals from run to run more than most placements do
        "recomputed": sum(w.get("recomputed", 0) for w in ws),
        "queries": q,
        "hit_rate": hits / q if q else 0.0,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "ttft_lower_bound": bool(lost),  # timed-out requests counted at the client timeout
        "rps": len(ok) / run["wall_s"] if run["wall_s"] else 0.0,
        "ok": len(ok),
        "n": len(recs),
        "timed_out": sum(r["status"] == 0 for r in recs),
        "errors": sum(r["status"] != 0 and not completed(r) for r in recs),  # aborted streams included
        "aborted": sum(r["status"] == 200 and not completed(r) for r in recs),
        "to_sleeping": sum(w["to_sleeping"] for w in ws),
        "req_share_max": max(arrivals) / max(sum(arrivals), 1),
        "req_share_min": min(arrivals) / max(sum(arrivals), 1),
        "tok_share_max": max(tokens) / max(sum(tokens), 1),
        "warm": sum(r["verdict"] == "WARM" for r in recs) if ours else None,
        "stale_warm": sum(map(stale, recs)) if ours else None,
        "stale_raced": stale_raced(recs, run["events"]) if ours else None,
        "retried": sum(r["attempts"] > 1 for r in recs) if ours else None,
        "sim_ttft_p50": hist_quantile(run.get("sim_ttft") or {}, 0.5),
        "sim_ttft_p99": hist_quantile(run.get("sim_ttft") or {}, 0.99),
        "slept_s": slept[0] if slept else None,
    }


def stale(r: dict[str, Any], block_size: int = BLOCK_SIZE) -> bool:
    """A stale warm route: a WARM verdict whose matched tokens exceed what the worker reported cached, of those vLLM
    reuses. NOTE: vLLM computes a prompt's last token whatever it holds, so it reuses at most the whole blocks of the
    first prompt_tokens - 1: a prompt of whole blocks resident entirely (matched == prompt_tokens) is owed one block
    less. Since the stand-in does as vLLM does (a fully cached prompt hits all but its last block), such a route read
    stale here, with nothing stale about it."""
    if r["verdict"] != "WARM" or r["cached_tokens"] is None:
        return False
    owed, n = r["matched_tokens"], r.get("prompt_tokens")
    if n is not None and owed >= n > 0:
        owed = (n - 1) // block_size * block_size
    return bool(r["cached_tokens"] < owed)


def stale_raced(recs: list[dict[str, Any]], events: list[dict[str, Any]]) -> int | None:
    """Stale warm routes that raced a reset or a sleep behind the router's back on their own worker: issued
    before that action ended, first token (or end) after it began. No router could have known: the blocks were
    there when it routed. A reset's window runs on until its AllBlocksCleared was published (`cleared_s`, where
    the run recorded it): vLLM publishes it with its next engine step, after that step's forward pass, and no
    other signal of a reset reaches a router. A sleep's does not: the router watches the sleep itself.
    None for records without their issue time (results from before it was recorded)."""
    if any(r.get("issued_s") is None for r in recs):
        return None
    behind = [(e["worker"], e["t_s"] - e.get("took_s", 0.0),
               max(e["t_s"], e.get("cleared_s") or 0.0) if e["verb"] == "reset_prefix_cache" else e["t_s"])
              for e in events
              if e.get("via") == "direct" and e.get("ok") and e["verb"] in ("reset_prefix_cache", "sleep")]
    n = 0
    for r in recs:
        if not stale(r):
            continue
        first = r["issued_s"] + (r["ttft_s"] if r["ttft_s"] is not None else r["total_s"] or 0.0)
        n += any(w == r["worker"] and r["issued_s"] <= end and first >= start for w, start, end in behind)
    return n
