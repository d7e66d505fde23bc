"""Node loss on a real multi-node Ray cluster, called at once (run as a script; issue #31 item 2).

    python tests/workers/node_loss_scenario.py OUT.json

A 0-CPU head and three 1-CPU nodes (`ray.cluster_utils.Cluster`, see multinode_scenarios.py); the
tests run it as multinode_scenarios.py's last scenario, on that script's cluster with a third node
added (one cluster start for both).
Six sessions are spread by load, two per node. Then one node's raylet is SIGKILLed together with
its worker processes (its supervisor and session actors), and right away, before Ray declares the
node dead, every session gets an append, the sessions are listed and a new one is created. Every
call and its duration go into OUT.json, with the same calls timed before the loss as the control.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
from multinode_scenarios import SPEC, run, wait_host  # noqa: E402

from workers.fleet import KernelFleet  # noqa: E402

T = "acme"
PROMPTS = [
    "Resident planner: keep notes.",
    "Archivist on duty; be terse.",
    "Critic: point out flaws.",
    "Scheduler, plan the week.",
    "Translator into plain words.",
    "Summariser of long logs.",
]


def _timed(fn: Any) -> tuple[str, float]:
    t0 = time.perf_counter()
    try:
        fn()
        out = "ok"
    except Exception as e:  # noqa: BLE001 - the outcome is the finding
        out = f"{type(e).__name__}: {str(e)[:300]}"
    return out, time.perf_counter() - t0


def _round(f: KernelFleet, sids: list[str], tag: str) -> dict[str, Any]:
    """A listing, a create, then one append per session: each outcome and its seconds."""
    listed = _timed(lambda: f.list_sessions(tenant=T))
    created = _timed(lambda: f.create_session(T, f"new-{tag}", f"You are created {tag} the loss."))
    calls = {
        sid: _timed(lambda sid=sid: f.append(T, sid, f"{tag}: next work item for {sid}.")) for sid in sids
    }
    return {"appends": calls, "list": listed, "create": created}


def node_loss(cluster: Any, tmp: Path) -> dict[str, Any]:
    f = KernelFleet(f"sqlite:///{tmp / 'loss.db'}", SPEC, call_timeout_s=60.0)
    try:
        for nid in f.refresh_nodes():  # every node's host answers before the first placement
            wait_host(f, nid)
        sids = [f"s{i}" for i in range(len(PROMPTS))]
        for sid, prompt in zip(sids, PROMPTS, strict=True):
            f.create_session(T, sid, prompt)
        nodes = {sid: f._record(T, sid).node for sid in sids}
        victim = nodes["s0"]
        before = _round(f, sids, "before")
        pids = [int(f.info(T, sid)["pid"]) for sid in sids if nodes[sid] == victim]
        pids += [int(s["pid"]) for s in f.node_stats() if s["node"] == victim]
        node = next(n for n in cluster.worker_nodes if n.node_id == victim)
        cluster.remove_node(node, allow_graceful=False)  # SIGKILL its raylet (and Ray's other daemons)
        for pid in pids:  # and its workers: the supervisor and the session actors
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        alive_in_table = any(n["NodeID"] == victim and n["Alive"] for n in ray.nodes())
        after = _round(f, sids, "after")
        recs = {sid: f._record(T, sid) for sid in sids}
        return {
            "victim": victim,
            "nodes": nodes,
            "victims": [s for s in sids if nodes[s] == victim],
            "node_alive_in_table_at_first_call": alive_in_table,
            "before": before,
            "after": after,
            "epochs": {s: r.epoch for s, r in recs.items()},
            "nodes_after": {s: r.node for s, r in recs.items()},
        }
    finally:
        f.shutdown()


def main(out: Path) -> None:
    run(out, {"node_loss": node_loss}, num_nodes=3, accel_node=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
