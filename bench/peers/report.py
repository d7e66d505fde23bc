"""The fleet routing bench's markdown section and plot, from each run's figures (peers/summary.py).

Ratios are against the best PEER (vllm-router, sglang-router, the sticky hash) of the same cell,
on each metric separately: prefilled tokens against the peer that prefilled least of those that
completed every request, TTFT p99 against the peer with the lowest p99, requests/s against the
fastest peer.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from peers.repeats import collapse
from peers.summary import completed, summarize

PEER_KINDS = ("vllm", "sglang", "sticky")
OURS = ("kvfleet", "kvfleet-ctl", "kvfleet-ctl-preempt", "kvfleet-blind")
SLEEP_MODES = {  # how vLLM's /sleep meets requests in flight
    "abort": ": requests in flight end unfinished",
    "wait": ": requests in flight finish first, new ones wait for the wake",
}


def stale_cell(s: dict[str, Any], of_warm: bool = False) -> str:
    """The stale warm count, with how many of them raced an action behind the router's back (`of_warm`: and of how
    many WARM verdicts, as the contenders' tables show it)."""
    if s["stale_warm"] is None:  # no verdicts to count: a peer, or a driver that does not read them (AIPerf)
        return "n/a"
    raced = s.get("stale_raced")
    if of_warm:
        return f"{s['stale_warm']} ({s['warm']})" + (f", {raced} raced" if raced else "")
    return str(s["stale_warm"]) + (f" ({raced} raced)" if raced else "")


def best_peers(cell: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]] | None]:
    peers = [
        (r["contender"], r["summary"]) for r in cell["runs"] if r["kind"] in PEER_KINDS and "summary" in r
    ]
    if not peers:
        return {"prefilled": None, "ttft_p99": None, "rps": None}
    with_ttft = [p for p in peers if p[1]["ttft_p99"] is not None]
    # NOTE: a request that failed before a worker admitted it prefilled nothing, so a peer that lost requests could be
    # the best on prefill by the prompts it never ran; only a peer that completed every request is compared (any peer
    # where none did). A peer's TTFT counts its timed-out requests at the timeout, and req/s counts completed ones
    whole = [p for p in peers if p[1]["ok"] == p[1]["n"]] or peers
    return {
        "prefilled": min(whole, key=lambda p: p[1]["prefilled"]),
        "ttft_p99": min(with_ttft, key=lambda p: p[1]["ttft_p99"]) if with_ttft else None,
        "rps": max(peers, key=lambda p: p[1]["rps"]),
    }


def _ratio(x: float | None, best: tuple[str, dict[str, Any]] | None, key: str) -> str:
    if x is None or best is None or not best[1][key]:
        return "-"
    return f"{x / best[1][key]:.2f}x"


def _name(best: dict[str, Any], key: str) -> str:
    return best[key][0] if best[key] else "-"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}" if x >= 0.01 else f"{1e3 * x:.1f}"


def cell_title(cell: dict[str, Any]) -> str:
    w = cell["workload"]
    return f"{w['name']}, {cell['cache']} cache ({cell['num_blocks']:,} blocks/worker)"


def headline(cells: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| workload, cache | best peer: prefill | kvfleet prefill | kvfleet-ctl prefill | best peer: TTFT p99 | "
        "kvfleet TTFT p99 | best peer: req/s | kvfleet req/s | kvfleet stale warm / to sleeping |",
        "|---|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for c in cells:
        b, s = c["best"], {r["contender"]: r["summary"] for r in c["runs"] if "summary" in r}
        k, kc = s.get("kvfleet"), s.get("kvfleet-ctl")
        rows.append(
            f"| {c['workload']['name']}, {c['cache']} | {_name(b, 'prefilled')} | "
            f"{_ratio(k and k['prefilled'], b['prefilled'], 'prefilled')} | "
            f"{_ratio(kc and kc['prefilled'], b['prefilled'], 'prefilled')} | {_name(b, 'ttft_p99')} | "
            f"{_ratio(k and k['ttft_p99'], b['ttft_p99'], 'ttft_p99')} | {_name(b, 'rps')} | "
            f"{_ratio(k and k['rps'], b['rps'], 'rps')} | "
            f"{(stale_cell(k) + ' / ' + str(k['to_sleeping'])) if k else '-'} |"
        )
    return rows


def detail(cell: dict[str, Any]) -> list[str]:
    w = cell["workload"]
    sent_by = next((r["driver"] for r in cell["runs"] if r.get("driver")), None)
    repeated = any("spread" in r.get("summary", {}) for r in cell["runs"])
    rows = [
        f"**{cell_title(cell)}**: {w['description']}; {w['requests']} requests, working set "
        f"{w['working_set_tokens']:,} tokens, longest prompt {w['longest_prompt']:,}"
        + (f"; scale {w['scale']}" if w.get("scale") else "")
        + (f"; open loop over {w['open_loop_s']} s" if w.get("open_loop_s") else "")
        + "."
        + (f" Requests sent by AIPerf {sent_by['version']} (`--driver aiperf`, bench/peers/aiperf_driver.py), which "
           "does not read kvfleet's verdict headers: no stale-warm count." if sent_by else ""),
        "",
        "| contender | prefilled tokens (" + ("range over the runs; " if repeated else "") + "of them computed again "
        "after a preemption) | x best peer | hit rate | TTFT p50 / p99 ms" + (" (p99's range)" if repeated else "")
        + " | req/s | ok / timed out | "
        "to sleeping | req share max / min | token share max | stale warm (of WARM) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    b = cell["best"]["prefilled"]
    sim = any(r.get("summary", {}).get("sim_ttft_p50") is not None for r in cell["runs"])
    if sim:
        rows[2] = rows[2].replace(" | req/s |", " | workers' TTFT p50 / p99 ms (bucket bound) | req/s |")
        rows[3] += "---:|"
    for r in cell["runs"]:
        if "summary" not in r:
            rows.append(
                f"| {r['contender']} | not run: {first_sentence(r['unavailable'])} |" + " |" * (9 + sim)
            )
            continue
        s = r["summary"]
        stale = stale_cell(s, of_warm=True)
        rows.append(
            f"| {r['contender']} | {s['prefilled']:,} ({_spread_text(s, 'prefilled', '{:,}-{:,}; ')}{s.get('recomputed', 0):,}) | "
            f"{_ratio(s['prefilled'], b, 'prefilled')} | "
            f"{100 * s['hit_rate']:.1f}% | {_ttft(s)}{_spread_text(s, 'ttft_p99', ' ({}-{})', scale=_ms)} | "
            + (f"{_ms(s['sim_ttft_p50'])} / {_ms(s['sim_ttft_p99'])} | " if sim else "")
            + f"{s['rps']:.0f} | "
            f"{s['ok']} / {s['timed_out']} | {s['to_sleeping']} | {100 * s['req_share_max']:.0f}% / "
            f"{100 * s['req_share_min']:.0f}% | {100 * s['tok_share_max']:.0f}% | {stale} |"
        )
    return rows


def _spread_text(s: dict[str, Any], key: str, fmt: str, scale: Any = None) -> str:
    """A repeated contender's range over its runs in `fmt` (its low and its high), or nothing for a single run."""
    lo_hi = s.get("spread", {}).get(key)
    if not lo_hi:
        return ""
    return fmt.format(*(scale(x) if scale else x for x in lo_hi))


def first_sentence(text: str) -> str:
    return re.sub(r"\s+", " ", text.split(";")[0])[:160].replace("|", "/")


def verdicts(cells: list[dict[str, Any]]) -> list[str]:
    """Where kvfleet (behind its back) prefilled less than the best peer, and where it did not."""
    wins, losses = [], []
    for c in cells:
        s = {r["contender"]: r["summary"] for r in c["runs"] if "summary" in r}
        b = c["best"]["prefilled"]
        if "kvfleet" not in s or b is None:
            continue
        ratio = s["kvfleet"]["prefilled"] / max(b[1]["prefilled"], 1)
        (wins if ratio < 0.995 else losses).append(
            f"{c['workload']['name']}/{c['cache']} {ratio:.2f}x vs {b[0]}"
        )
    out = []
    if wins:
        out.append(
            f"kvfleet prefilled fewer tokens than the best peer in {len(wins)} of {len(wins) + len(losses)} "
            f"cells: {'; '.join(wins)}."
        )
    if losses:
        out.append(f"It did not (equal or more) in {len(losses)}: {'; '.join(losses)}.")
    return out


def _ttft(s: dict[str, Any]) -> str:
    """TTFT p50 / p99, each ">=" where timed-out requests, counted at the client timeout, may hold it up."""
    mark = ">=" if s.get("ttft_lower_bound") else ""
    return f"{mark}{_ms(s['ttft_p50'])} / {mark}{_ms(s['ttft_p99'])}"


def observations(cells: list[dict[str, Any]]) -> list[str]:
    """Facts of this run worth a sentence: idle workers under kvfleet, failed requests. A contender that ran
    several times in a cell gets one sentence there, its runs' figures listed in order."""
    idle: dict[str, list[str]] = {}
    failed: dict[tuple[str, str], list[tuple[int, int, dict[str, int]]]] = {}
    for c in cells:
        where = f"{c['workload']['name']}/{c['cache']}"
        for r in c["runs"]:
            if r["contender"] == "kvfleet" and "workers" in r:
                idle.setdefault(where, []).append(
                    f"{sum(w['arrivals'] == 0 for w in r['workers'].values())} of {len(r['workers'])}")
            if "summary" in r:
                errs: dict[str, int] = {}
                for x in r["records"]:
                    if not completed(x):
                        key = first_sentence(x["error"])[:110]
                        errs[key] = errs.get(key, 0) + 1
                failed.setdefault((r["contender"], where), []).append((r["summary"]["n"] - r["summary"]["ok"],
                                                                       r["summary"]["n"], errs))
    out = []
    for (name, where), runs in failed.items():
        errs = {}
        for _, _, e in runs:
            for k, v in e.items():
                errs[k] = errs.get(k, 0) + v
        if errs:
            top = max(errs, key=lambda k: errs[k])
            counts = ", ".join(str(f) for f, _, _ in runs)
            out.append(f"{name} in {where}: {counts} of {runs[0][1]} requests failed"
                       + (f" (its {len(runs)} runs)" if len(runs) > 1 else "")
                       + f" (most often, {errs[top]}x: `{top}`).")
    shown = [f"{where} ({', '.join(n)})" for where, n in idle.items() if any(not x.startswith("0 ") for x in n)]
    if shown:
        out.insert(0, "kvfleet sent no request at all to some workers in: " + ", ".join(shown) + ".")
    return out


def normalize(cmd: list[str]) -> str:
    """A launch command with this run's ports, tokens and paths replaced by placeholders."""
    text = " ".join(cmd)
    text = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"(--port|--prometheus-port) \d+", r"\1 PORT", text)
    text = re.sub(r"\S*/python[\d.]*(?=\s)", "python", text)
    text = re.sub(r"\S*/(vllm-router|sglang-router)(?=\s)", r"\1", text)
    text = re.sub(r"\S*/bench/peers/", "bench/peers/", text)
    text = re.sub(r"sqlite:///\S+", "sqlite:///STATE/kv.db", text)
    return re.sub(r"--tokens-file \S+", "--tokens-file STATE/tokens.json", text)


def commands(cells: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, str] = {}
    for c in cells:
        for r in c["runs"]:
            if "command" in r and r["contender"] not in seen:
                seen[r["contender"]] = f"{normalize(r['command'])}   # {c['workload']['workers']} workers"
    return [f"{n}: {cmd}" for n, cmd in seen.items()]


def report(results: dict[str, Any]) -> str:
    cells = results["cells"]
    for c in cells:
        for r in c["runs"]:
            if "records" in r:
                r["summary"] = summarize(r)
    facts, launched = observations(cells), commands(cells)  # every run's, before the repeats become medians
    for c in cells:
        collapse(c)
        c["best"] = best_peers(c)
    repeats = results.get("repeats", 1)
    o, v, sc = results["options"], results["versions"], results["sim_config"]
    mode = results.get("sleep_mode", "abort")  # runs that did not record it used vLLM's default
    not_run = sorted(
        {
            f"{r['contender']}: {first_sentence(r['unavailable'])}"
            for c in cells
            for r in c["runs"]
            if "unavailable" in r
        }
    )
    wl = cells[0]["workload"] if cells else {}
    at = {k: f"{100 * wl.get(k, d):.0f}%" for k, d in (("sleep_at", 0.35), ("wake_at", 0.5), ("reset_at", 0.7))}
    clock = {
        k: x
        for k, x in sc.items()
        if k not in ("model", "block_size", "num_blocks", "hash_algo", "hash_seed", "loras", "max_model_len")
    }
    title = results.get("title") or (
        "Fleet routing: kvfleet vs vllm-router, sglang-router and a sticky hash (`./dev.sh bench fleet_routing"
        + (f" --repeat {repeats}" if repeats > 1 else "") + "`)"
    )
    lines = [
        f"## {title}",
        "",
        *(
            []
            if o.get("hazards", True)
            else ["**A control run (`--no-hazards`): no sleep, wake or reset happened; what follows about them "
                  "does not apply.**", ""]
        ),
        f"Measured at commit `{results['commit']}` ({'quick run' if results['quick'] else 'default size'}, "
        f"{results['took_s'] / 60:.1f} min on this machine's 2 shared cores). Every contender gets fresh "
        f"`kvfleet sim-vllm` stand-ins (block size {sc['block_size']}, sha256 block hashes; engine options beyond "
        f"the cache size: {clock or 'none'}) and the same trace: agents whose conversations grow by a tool result, "
        "an instruction and an answer per turn, every turn re-sending the whole history as streamed OpenAI "
        f"`/v1/chat/completions` (max_tokens {results['max_tokens']}), with a seeded think time (mean "
        f"{1e3 * o['think_s']:.0f} ms) between an agent's turns. Behind every router's back (HTTP straight to the "
        f"worker) the busiest worker is slept (level 1, mode {mode}{SLEEP_MODES.get(mode, '')}) when {at['sleep_at']} of the "
        "trace's requests were issued and woken once "
        f"{at['wake_at']} were and at least {o['sleep_min_s']} s passed (at most {o['sleep_max_s']} s"
        + (f", and at the latest at {at['reset_at']}: every router meets the sleep, the wake and the reset in that "
           "order" if o.get("wake_before_reset") else "")
        + f"); at {at['reset_at']} "
        + ("the prefix cache of the awake worker holding the most cached blocks is reset"
           if o.get("reset_target") == "cached" else "the busiest awake worker's prefix cache is reset")
        + (" (`reset_running_requests=true`: requests running there are preempted and computed again, so the "
           f"reset lands at {at['reset_at']} whatever the router's load)" if results.get("reset_mode") == "preempt" else
           " (asked every 20 ms, up to 100 times, until the worker is idle enough to accept it)")
        + ". `kvfleet-ctl` gets the same actions through the kvfleet controller instead"
        + (" (its reset drains the worker first; `kvfleet-ctl-preempt`, where it ran, gets the reset behind the backs "
           "through the controller, `reset_running_requests=true`)" if results.get("reset_mode") == "preempt" else "")
        + ". "
        f"Client timeout {o['timeout_s']:.0f} s per request. Peers: vllm-router "
        f"{v['vllm-router']}, sglang-router {v['sglang-router']} (PyPI)."
        + (
            " A replayed trace (open loop) sends each request at its own time instead, one user message "
            "each; its scale is stated per cell."
            if any(c["workload"].get("open_loop_s") for c in cells)
            else ""
        )
        + (f" kvfleet's quarantine detector: {results['detector']}." if results.get("detector") else ""),
        "",
        "Prefilled tokens and hit rates are the stand-ins' own counters (prompt tokens run minus prefix-cache "
        "hits, as vLLM's `prefix_cache_queries`/`prefix_cache_hits`); TTFT is client side (first SSE event, "
        'router included); "to sleeping" counts requests that reached a worker while it slept (counted at '
        "the worker); a request is ok when its answer is a 200 whose stream did not end with finish_reason "
        '"abort"; a stale warm route is a kvfleet WARM verdict whose matched tokens exceed the tokens '
        "the worker reported cached for that request (whatever the cause: a lifecycle action behind its back, or "
        "an eviction its index had not yet seen); \"raced\" counts those of them that raced a reset or a sleep "
        "behind the router's back on their own worker (issued before the action ended, first token after it "
        "began: the blocks were there when it routed; for a reset, issued before the worker published its "
        "AllBlocksCleared, which vLLM sends with its next engine step, after that step's forward pass: no event had "
        "told any router). Ratios are against the best peer of the cell on "
        "each metric (lower is better for prefill and TTFT, higher for req/s; on prefill, of the peers that "
        "completed every request, where one did: a request that failed before it ran prefilled nothing). There "
        "is no oracle here (no "
        "offline optimum is computed anywhere in this repo; the greedy rule with perfect knowledge in the "
        "fleet prefill section is not one). "
        + (f"Each contender ran {repeats} times per cell, the contenders' order rotating from run to run; every "
           "figure is the median of those runs (the middle one; its range in parentheses in the tables below), "
           "except the stale warm routes, requests to sleeping workers and failures, which are their sums. "
           if repeats > 1 else "Each contender ran once per cell. ")
        + "Placement depends on how concurrent requests interleave: while this bench was written, three runs of "
        "one quick cell moved kvfleet's prefilled tokens by about +-10%, so smaller differences are not findings.",
        "",
        *headline(cells),
        "",
        *verdicts(cells),
        "",
        *[f"- {x}" for x in facts],
        "",
        "![prefilled tokens per contender, relative to the best peer](fleet_routing.png)",
        "",
    ]
    for c in cells:
        lines += [*detail(c), ""]
    lines += [
        "How each contender was launched (ports, tokens and paths replaced):",
        "",
        "```",
        *launched,
        "```",
        "",
    ]
    if not_run:
        lines += ["Not run: " + "; ".join(not_run) + ".", ""]
    lines += NOTES
    return "\n".join(lines)


NOTES = [
    "Reading it:",
    "",
    "- The stand-ins answer as fast as this machine runs them unless their engine options above include a "
    "latency model, so TTFT and req/s compare the routers' own overheads (a Python proxy making a "
    "tokenize call and a gRPC route call per request, against Rust routers) more than cache effects. "
    "Prefilled tokens are the figure that does not depend on the machine.",
    "- A request that reached a sleeping stand-in waits (vLLM queues it) until the wake or until the client "
    "gives up; one still queued at the wake is then run, and its prompt counts as prefilled.",
    "- vllm-router's kv_aware and cache_aware ask each worker for `/v1/chat/completions/render` (the "
    "stand-in answers 404) and then use its `/tokenize`; kv_aware then matches the token ids against the "
    "blocks the KV events announced. sglang-router's cache_aware matches request text in its own radix tree, "
    "without KV events. kvfleet's proxy also calls the worker's `/tokenize` before routing.",
    "- kvfleet-blind (fleet/app/testkit/baseline.py) trusts AllBlocksCleared only and breaks ties by worker name, so "
    "cold requests all go to the same worker; it exists to count what lifecycle blindness costs, not as a "
    "placement policy.",
]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cells = results["cells"]
    names = [r["contender"] for r in cells[0]["runs"]]
    fig, ax = plt.subplots(figsize=(13, 4.8))
    width = 0.85 / len(names)
    for k, name in enumerate(names):
        xs, ys = [], []
        for i, c in enumerate(cells):
            r = next((r for r in c["runs"] if r["contender"] == name and "summary" in r), None)
            b = c["best"]["prefilled"]
            if r is not None and b is not None:
                xs.append(i + k * width)
                ys.append(r["summary"]["prefilled"] / max(b[1]["prefilled"], 1))
        ax.bar(
            xs, ys, width, label=name, hatch="//" if name in OURS else None, edgecolor="black", linewidth=0.3
        )
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(
        [i + 0.425 - width / 2 for i in range(len(cells))],
        [f"{c['workload']['name']}\n{c['cache']}" for c in cells],
        fontsize=8,
    )
    ax.set_yscale("log")
    fmt = FuncFormatter(lambda y, _: f"{y:g}x")
    ax.yaxis.set_major_formatter(fmt)
    ax.yaxis.set_minor_formatter(fmt)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_ylabel("prefilled tokens / best peer's (log; lower is better)")
    ax.set_title(
        "Fleet routing: prefilled tokens relative to the best peer per cell ("
        + (f"medians of {results['repeats']} runs, " if results.get("repeats", 1) > 1 else "")
        + f"commit {results['commit'][:7]})"
    )
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
