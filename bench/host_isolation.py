"""One tenant's heavy session traffic on a shared kernel host, and another tenant's calls beside it.

A real controller (loopback gRPC, a local Ray of 4 logical CPUs, so its kernel host has 4 lane threads,
SQLite) with two tenants. The victim, bravo, times its own calls (GetSession: info and digest; a 60-token
append; a create; a 1,000-token append) with nothing else running, then while acme runs 4 loops of one kind
of load, then after it:

  fork      forks of a 7,000-token session (its blocks adopted copy-on-write), each closed again
  create    creates of distinct 8,000-token system prompts (their blocks published to the host's cache)
  generate  generate(256) on 4 sessions of its own: kernel work on 3 of the host's 4 threads

Both stay inside acme's default quotas. Run side by side against another tree (`--against REV`: a
git worktree of that revision, the same scenario in its own process, before or after this tree's in
turn), so the machine's load is shared.

    python bench/host_isolation.py [--against REV] [--no-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchdoc import write_section  # noqa: E402
from worktree import worktree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALLS = (("GetSession", 8), ("append", 8), ("create", 5), ("append 1k", 5))
CPUS = 4


async def scenario() -> dict[str, dict[str, list[float]]]:
    """The victim's latencies (ms) per phase and call, in this process's tree."""
    import ray
    from support.controller import make_tokens, start_controller

    from fleet.sdk import AsyncFleetClient

    out: dict[str, dict[str, list[float]]] = {}
    ray.init(address="local", num_cpus=CPUS, namespace="kvfleet", include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    tmp = Path(tempfile.mkdtemp())
    tokens = make_tokens(tmp)
    ctl = await start_controller(f"sqlite:///{tmp / 'kvfleet.db'}", tokens)
    a, b = AsyncFleetClient(ctl.address, tokens.a), AsyncFleetClient(ctl.address, tokens.b)
    try:
        await b.create_session("b0", "You are the quiet agent.")
        await a.create_session("a0", "You are the loud agent.")
        await a.append("a0", "w" * 7000)
        for k in range(4):
            await a.create_session(f"g{k}", "You are the loud agent.")

        async def victim(phase: str) -> None:
            calls: dict[str, Callable[[int], Awaitable[Any]]] = {
                "GetSession": lambda i: b.get_session("b0"),
                "append": lambda i: b.append("b0", "short message here " * 3),
                "create": lambda i: b.create_session(f"b-{len(out)}-{i}", "You are the quiet agent."),
                "append 1k": lambda i: b.append(f"b-{len(out)}-{i}", "m" * 1000)}
            out[phase] = {}
            for name, n in CALLS:
                xs = []
                for i in range(n):
                    t0 = time.perf_counter()
                    await calls[name](i)
                    xs.append(1000 * (time.perf_counter() - t0))
                    await asyncio.sleep(0.05)
                out[phase][name] = xs

        await victim("alone")
        for kind in ("fork", "create", "generate"):
            stop, done = asyncio.Event(), [0]

            async def load(k: int, kind: str = kind, stop: asyncio.Event = stop, done: list[int] = done) -> None:
                i = 0
                while not stop.is_set():
                    sid = f"{kind}-{k}-{i}"
                    if kind == "generate":
                        await a.generate(f"g{k}", 256)
                    else:
                        if kind == "fork":
                            await a.fork("a0", sid)
                        else:
                            await a.create_session(sid, f"{k} {i} " + "p" * 8000)
                        await a.close_session(sid)
                    done[0] += 1
                    i += 1

            tasks = [asyncio.create_task(load(k)) for k in range(4)]
            await asyncio.sleep(2.0)
            await victim(f"with acme's {kind}s")
            stop.set()
            await asyncio.gather(*tasks)
            out[f"with acme's {kind}s"]["acme calls"] = [float(done[0])]
    finally:
        for x in (a, b):
            await x.close()
        await ctl.stop(grace=1)
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def run_tree(tree: Path) -> dict[str, Any]:
    """The scenario in its own process, with `tree` first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{tree}{os.pathsep}{tree / 'tests'}"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "host_isolation.py"), "--child"], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=900)
    if p.returncode:
        raise SystemExit(f"the scenario failed in {tree}:\n{p.stderr[-3000:]}")
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def report(trees: dict[str, dict[str, Any]]) -> str:
    names = list(trees)
    lines = [
        "## A heavy tenant on a shared kernel host (`python bench/host_isolation.py`)",
        "",
        f"One run on this machine's 2 shared cores. A real controller (loopback gRPC, local Ray of {CPUS} logical "
        f"CPUs, so the kernel host has {CPUS} lane threads and one tenant may use {CPUS - 1}; SQLite), two tenants. "
        "The victim, bravo, times its own calls alone, then while acme runs 4 loops of forks of a 7,000-token "
        "session, of creates of distinct 8,000-token prompts (each closed again), or of generate(256) on "
        "4 sessions of its own, within acme's default quotas. Milliseconds, median / max over 8 calls (5 "
        "creates, 5 appends of 1,000 tokens). The trees ran the same scenario in their own processes, in turn. "
        "A fork adopts its parent's blocks and a create publishes its prompt's blocks to the host's cache: one "
        "object-store call per block, which ran on the host's event loop until cfbdee0 moved them to "
        "the tenant's own lane. Decoding is kernel work on acme's lane threads: the kernel mostly holds the "
        "interpreter lock, so each running thread got about an equal share of the CPU until the host shared it "
        "per tenant (workers/lanes.py `CpuShare`). The max is what a call waited behind such work; the median, "
        "what it shares the host's CPU with.",
        "",
        "| phase | call | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for phase in trees[names[0]]:
        for call, _ in CALLS:
            cells = []
            for n in names:
                xs = trees[n][phase][call]
                cells.append(f"{statistics.median(xs):.1f} / {max(xs):.1f}")
            lines.append(f"| {phase} | {call} | " + " | ".join(cells) + " |")
        if "acme calls" in trees[names[0]][phase]:
            lines.append(f"| {phase} | acme's loads done meanwhile | "
                         + " | ".join(f"{trees[n][phase]['acme calls'][0]:.0f}" for n in names) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default=None, help="a git revision to run beside this tree")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(asyncio.run(scenario())))
        return
    trees = {"this tree": run_tree(ROOT)}
    if a.against:
        with worktree(a.against) as other:
            trees[f"at {a.against}"] = run_tree(other)
    body = report(trees)
    print(body)
    if not a.no_docs:
        write_section("host-isolation", body)


if __name__ == "__main__":
    main()
