"""One tenant's flood and another tenant's requests on the same workers: the quiet tenant's time to first token.

Two clocked `kvfleet sim-vllm` stand-ins (the 8B-on-H100 cost model, `--max-num-seqs 16`: a batch that fills,
so requests wait in the worker's queue; `--scheduling-policy priority`, which with every priority at 0, as the
peers and kvfleet without `--fair-priority` send, is vLLM's arrival order). Tenant acme runs 64 closed-loop
clients, each sending prompts of 500-1,500 tokens for 32-96 tokens (seeded, uniform), non-streaming, one after
another. Tenant bravo sends 30
streamed requests one after another (a 200-token prompt for 8 tokens, 0.1 s apart) and its time to the first
streamed event is timed. Each contender runs the same workload in front of fresh stand-ins:

  alone             bravo with no flood, through kvfleet (the reference)
  kvfleet           the kvfleet proxy as it starts by default
  kvfleet-fair      the same with --fair-priority (controller/proxy/fair.py)
  vllm-kv_aware     vllm-router kv_aware with the stand-ins' KV events, if installed

    python bench/tenant_fairness.py [--no-docs] [--contenders kvfleet,kvfleet-fair]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchdoc import write_section  # noqa: E402
from peers.launch import CONTENDERS, Spec, Unavailable, start  # noqa: E402
from peers.workers import MODEL, SimFleet, engine_config  # noqa: E402

ENGINE = {"time_scale": 1.0, "max_num_seqs": 16, "scheduling_policy": "priority"}
FLOOD_CLIENTS, FLOOD_PROMPT, FLOOD_TOKENS = 64, 1000, 64  # means: each request draws from 0.5x-1.5x
QUIET_REQUESTS, QUIET_PROMPT, QUIET_TOKENS, QUIET_GAP_S = 30, 200, 8, 0.1
SPECS = {
    "alone": Spec("alone", "bravo alone, through the kvfleet proxy", "kvfleet"),
    "kvfleet": CONTENDERS["kvfleet"],
    "kvfleet-fair": Spec("kvfleet-fair", "kvfleet proxy --fair-priority", "kvfleet", proxy_args=("--fair-priority",)),
    "vllm-kv_aware": CONTENDERS["vllm-kv_aware"],
}


def words(seed: str, n: int) -> str:
    """About `n` stand-in tokens of text (one word each)."""
    return " ".join(f"{seed}{i % 97}" for i in range(n))


async def quiet(run: Any) -> list[float]:
    """bravo's streamed requests, one after another: the seconds to each one's first event."""
    out = []
    for i in range(QUIET_REQUESTS):
        body = {"model": MODEL, "messages": [{"role": "user", "content": words(f"q{i}x", QUIET_PROMPT)}],
                "max_tokens": QUIET_TOKENS, "stream": True}
        t0 = time.perf_counter()
        async with run.http.post(run.url + "/v1/chat/completions", json=body, headers=run.headers("bravo")) as r:
            first = None
            async for _ in r.content.iter_any():
                first = first or time.perf_counter() - t0
            if r.status != 200 or first is None:
                raise RuntimeError(f"bravo's request {i}: status {r.status}")
        out.append(first)
        await asyncio.sleep(QUIET_GAP_S)
    return out


async def flood(run: Any, stop: asyncio.Event, done: list[float]) -> None:
    """acme's closed-loop clients until `stop`; `done` gets each answered request's latency."""
    async def client(k: int) -> None:
        rng, i = random.Random(k), 0
        while not stop.is_set():  # NOTE: sizes vary, or the batches fill and drain in lockstep waves
            size, n = (int(x * rng.uniform(0.5, 1.5)) for x in (FLOOD_PROMPT, FLOOD_TOKENS))
            body = {"model": MODEL, "messages": [{"role": "user", "content": words(f"f{k}y{i}x", size)}],
                    "max_tokens": n}
            t0 = time.perf_counter()
            try:
                async with run.http.post(run.url + "/v1/chat/completions", json=body,
                                         headers=run.headers("acme")) as r:
                    await r.read()
                    if r.status == 200:
                        done.append(time.perf_counter() - t0)
            except aiohttp.ClientError:
                pass
            i += 1

    await asyncio.gather(*(client(k) for k in range(FLOOD_CLIENTS)))


async def run_one(spec: Spec, tmp: Path) -> dict[str, Any]:
    cfg, _ = engine_config(4096, 16, ENGINE)
    fleet = await SimFleet.start(2, cfg)
    try:
        run = await start(spec, fleet, tmp, ("acme", "bravo"))
    except Unavailable:
        await fleet.stop()
        raise
    try:
        stop, done = asyncio.Event(), []
        task = None
        if spec.name != "alone":
            task = asyncio.create_task(flood(run, stop, done))
            await asyncio.sleep(5.0)     # the batches fill and the queues form
        t0, n0 = time.perf_counter(), len(done)
        ttft = await quiet(run)
        took, answered = time.perf_counter() - t0, len(done) - n0
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 120)
        return {"ttft": ttft, "flood_per_s": answered / took, "flood": done}
    finally:
        await run.stop()
        await fleet.stop()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(results: dict[str, dict[str, Any]], skipped: dict[str, str]) -> str:
    ref = results.get("kvfleet")
    lines = [
        "## One tenant's flood and another's requests (`python bench/tenant_fairness.py`)",
        "",
        "One run on this machine's 2 shared cores. Two clocked `kvfleet sim-vllm` stand-ins (the 8B-on-H100 cost "
        f"model, `--max-num-seqs {ENGINE['max_num_seqs']}`, `--scheduling-policy priority`: with every priority "
        "at 0, as the peers and kvfleet without `--fair-priority` send, that is arrival order). Tenant acme runs "
        f"{FLOOD_CLIENTS} closed-loop clients (prompts of {FLOOD_PROMPT // 2}-{3 * FLOOD_PROMPT // 2} tokens for "
        f"{FLOOD_TOKENS // 2}-{3 * FLOOD_TOKENS // 2} tokens, seeded, non-streaming); tenant bravo sends {QUIET_REQUESTS} streamed requests one after another "
        f"({QUIET_PROMPT}-token prompts for {QUIET_TOKENS} tokens, {QUIET_GAP_S} s apart), starting 5 s into the "
        "flood. bravo's time to its first streamed event, at the client, in ms; acme's requests answered per "
        "second while bravo ran, and the latency of all its answered requests. Each contender in front of fresh "
        "stand-ins, in turn.",
        "",
        "| contender | bravo TTFT p50 | p90 | max | vs kvfleet p50 | acme answered / s | acme latency p50 / p90 s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        p50 = statistics.median(r["ttft"])
        vs = f"{p50 / statistics.median(ref['ttft']):.2f}x" if ref else "-"
        fl = f"{statistics.median(r['flood']):.2f} / {pct(r['flood'], 0.9):.2f}" if r["flood"] else "-"
        lines.append(f"| {SPECS[name].label} | {1000 * p50:.0f} | {1000 * pct(r['ttft'], 0.9):.0f} | "
                     f"{1000 * max(r['ttft']):.0f} | {vs} | {r['flood_per_s']:.1f} | {fl} |")
    for name, why in skipped.items():
        lines.append(f"| {SPECS[name].label} | not run: {why} | | | | | |")
    return "\n".join(lines)


async def main_async(names: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    results, skipped = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                results[name] = await run_one(SPECS[name], Path(tmp))
            except Unavailable as e:
                skipped[name] = str(e)[:120]
            print(name, results.get(name, {}).get("flood_per_s"), skipped.get(name, ""), flush=True)
    return results, skipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contenders", default=",".join(SPECS))
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args()
    results, skipped = asyncio.run(main_async(a.contenders.split(",")))
    body = report(results, skipped)
    print(body)
    if not a.no_docs:
        write_section("tenant-fairness", body)


if __name__ == "__main__":
    main()
