"""The fleet on several Ray nodes, side by side in one run (`python bench/fleet_nodes.py`).

One `ray.cluster_utils.Cluster` on this machine (a head with 0 CPUs, three 1-CPU raylets):
session create/append latency of a fleet held to 1 node and of one on all 3, calls interleaved;
a node SIGKILLed under live sessions and the time to regenerate them on the survivors; a
cross-node fork (blocks moved by Ray) against a replayed fork; a real `kvfleet controller`
SIGKILLed and restarted (tokens prefilled again: the target is 0). The cluster and the last two
parts are the ones the tests run (tests/workers/multinode_scenarios.py); here they are timed. Writes its section of
docs/benchmarks.md (`bench:fleet-nodes`).

All raylets share this machine's cores, so 3 nodes here measure the cost of the multi-node
paths (placement probes, cross-node calls), not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "workers")]

import multinode_scenarios as ms  # noqa: E402
import ray  # noqa: E402

from workers.fleet import KernelFleet  # noqa: E402

T = "bench"


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e3:.1f} / {xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f}"


def latency(urls: dict[str, str], resources: dict[str, dict[str, float]], num_sessions: int,
            num_appends: int) -> dict[str, dict[str, Any]]:
    """Create `num_sessions` sessions (distinct prompts) and append `num_appends` turns to each, in
    every fleet of `urls`, call by call interleaved across the fleets (same machine load for all)."""
    fleets = {k: KernelFleet(u, ms.SPEC, node_refresh_s=1.0, resources=resources[k]) for k, u in urls.items()}
    creates: dict[str, list[float]] = {k: [] for k in fleets}
    appends: dict[str, list[float]] = {k: [] for k in fleets}
    try:
        for i in range(num_sessions):
            for k, f in fleets.items():
                t0 = time.perf_counter()
                f.create_session(T, f"s{i}", f"Agent {i}: you review pull requests for team {i * 7}.")
                creates[k].append(time.perf_counter() - t0)
        for j in range(num_appends):
            for i in range(num_sessions):
                for k, f in fleets.items():
                    t0 = time.perf_counter()
                    f.append(T, f"s{i}", f"Turn {j}: look at file {i}-{j} and say what is wrong.")
                    appends[k].append(time.perf_counter() - t0)
        return {k: {"create": _ms(creates[k]), "append": _ms(appends[k]), "nodes": len(f.hosts),
                    "nodes_used": len({f._record(T, f"s{i}").node for i in range(num_sessions)})}
                for k, f in fleets.items()}
    finally:
        for f in fleets.values():
            f.shutdown()


def node_loss(cluster: Any, url: str, num_sessions: int) -> dict[str, Any]:
    """Sessions of a few hundred tokens over every node; the busiest node is SIGKILLed; reconcile()."""
    f = KernelFleet(url, ms.SPEC, node_refresh_s=0.0)
    try:
        for i in range(num_sessions):
            f.create_session(T, f"l{i}", f"Long-lived agent {i} with a detailed brief. " * 3)
            for j in range(3):
                f.append(T, f"l{i}", f"Observation {j} for agent {i}: " + "the build log says little. " * 3)
        where = {f"l{i}": f._record(T, f"l{i}").node for i in range(num_sessions)}
        victim = max(set(where.values()), key=list(where.values()).count)
        lost = [s for s, n in where.items() if n == victim]
        tokens = sum(len(f.tokens(T, s)) for s in lost)
        before = {s: f.digest(T, s) for s in lost}
        cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == victim), allow_graceful=False)
        t_kill = time.perf_counter()
        ms.wait_node_dead(victim)
        detected = time.perf_counter() - t_kill
        t0 = time.perf_counter()
        n = f.reconcile()
        regen = time.perf_counter() - t0
        same = all(f.digest(T, s) == d for s, d in before.items())
        return {"lost": len(lost), "regenerated": n, "tokens": tokens, "detect_s": detected, "reconcile_s": regen,
                "bit_identical": same}
    finally:
        f.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--appends", type=int, default=5)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="kvfleet-bench-nodes-"))
    cluster = ms.start_cluster(num_nodes=2)                   # the second node has `accel`
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        lat = latency({"one": f"sqlite:///{tmp / 'one.db'}", "three": f"sqlite:///{tmp / 'three.db'}"},
                      {"one": {"accel": 0.01}, "three": {}}, args.sessions, args.appends)
        one, three = lat["one"], lat["three"]
        loss = node_loss(cluster, f"sqlite:///{tmp / 'loss.db'}", args.sessions)
        fork = ms.cross_node_fork(cluster, tmp)
        ctl = ms.controller_restart(cluster, tmp)
    finally:
        ray.shutdown()
        cluster.shutdown()
        for d in (tmp, Path(os.environ["RAY_TMPDIR"])):
            shutil.rmtree(d, ignore_errors=True)
    body = report(args, one, three, loss, fork, ctl)
    print(body)
    from benchdoc import write_section

    write_section("fleet-nodes", body)
    return 0


def report(args: Any, one: dict[str, Any], three: dict[str, Any], loss: dict[str, Any], fork: dict[str, Any],
           ctl: dict[str, Any]) -> str:
    redone = sum(ctl["prefilled_after"][s] - ctl["prefilled_before"][s] - ctl["tokens_added"][s]
                 for s in ctl["prefilled_before"])
    return f"""
## Fleet on several Ray nodes (`python bench/fleet_nodes.py`)

One run, one `ray.cluster_utils.Cluster` on this machine (head with 0 CPUs, three 1-CPU raylets;
tiny synthetic model, numpy backend, SQLite store). The 1-node fleet is held to one node by a
custom resource only that node has; the two fleets' calls are interleaved call by call, so both
see the same machine load. All raylets share the machine's cores: 3 nodes here measure what the
multi-node paths cost (placement probes of every node, calls to other raylets), not a speed-up.

| {args.sessions} sessions × {args.appends} appends | nodes used | create ms (median / p90) | append ms (median / p90) |
|---|---|---|---|
| 1 node | {one['nodes_used']} of {one['nodes']} | {one['create']} | {one['append']} |
| 3 nodes | {three['nodes_used']} of {three['nodes']} | {three['create']} | {three['append']} |

| event | figure |
|---|---|
| node SIGKILLed with {loss['lost']} live sessions ({loss['tokens']} tokens) | marked dead by Ray after {loss['detect_s']:.1f} s (health check 0.5 s × 4) |
| `reconcile()`: regenerate them on the survivors | {loss['reconcile_s']:.2f} s for {loss['regenerated']} sessions; bit-identical: {loss['bit_identical']} |
| cross-node fork, sharing (blocks moved by Ray) | {fork['shared_fork_s']:.2f} s; {fork['moved_bytes']:,} bytes moved; {fork['shared_prefilled']} tokens computed |
| cross-node fork, replaying the log | {fork['replayed_fork_s']:.2f} s; 0 bytes moved; {fork['replayed_prefilled']} tokens computed |
| shared vs replayed fork logits | max abs delta {fork['max_delta']} (control, after diverging: {fork['control_delta']:.3f}) |
| controller SIGKILLed and restarted | tokens prefilled again: {redone} (target 0); same actor processes: {all(ctl['same_pid'].values())}; first answer {ctl['restart_to_first_answer_s']:.1f} s after the restart began |

Create latency is mostly Ray starting the session actor's worker process; appends go straight to
the actor on whichever node holds it. The lost sessions were all on one node because their prompts
share a warm prefix there (placement prefers warm nodes). The shared fork computes
{fork['replayed_prefilled'] - fork['shared_prefilled']} fewer tokens than the replayed one; with this tiny model that saving is small
next to the actor's start, and it grows with the model.
"""


if __name__ == "__main__":
    raise SystemExit(main())
