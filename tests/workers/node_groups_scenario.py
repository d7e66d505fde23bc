"""Kernel specs per node group on a real multi-node Ray (run as a script: OUT.json).

    python tests/workers/node_groups_scenario.py OUT.json

A head with 0 CPUs and three 1-CPU raylets labelled kvfleet.dev/group = cpu, fast, gpu (none has
a GPU). The fleet's spec runs numpy by default, torch on `fast` and torch/CUDA on `gpu`: the `gpu`
node must get no supervisor and no session (it has no GPU, so it never builds a CUDA kernel), the
`fast` node's sessions must run torch and the `cpu` node's numpy. Run in its own process for the
reasons given in tests/workers/multinode_scenarios.py (one Ray connection per process; the
cluster's address is never advertised machine-wide).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import ray  # noqa: E402
from support.workers import scenario_result  # noqa: E402

from workers.fleet import KernelFleet  # noqa: E402
from workers.placement import RAY_NAMESPACE  # noqa: E402
from workers.spec import GROUP_LABEL, KernelSpec  # noqa: E402

SPEC = KernelSpec(block_size=16, groups=(("fast", "torch", "cpu"), ("gpu", "torch", "cuda")))
PROMPTS = ["You are a planner.", "Answer tersely, as a critic.", "Summarise the log.", "Check the math."]


def start_cluster() -> Any:
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    ray_utils.write_ray_address = lambda *a, **k: None   # never advertise this cluster machine-wide
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="kvng")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for group in ("cpu", "fast", "gpu"):
        cluster.add_node(num_cpus=1, labels={GROUP_LABEL: group})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
    return cluster


def scenario(tmp: Path) -> dict[str, Any]:
    groups = {n["NodeID"]: (n.get("Labels") or {}).get(GROUP_LABEL, "") for n in ray.nodes() if n["Alive"]}
    f = KernelFleet(f"sqlite:///{tmp / 'groups.db'}", SPEC, node_refresh_s=0.0)
    try:
        for i, p in enumerate(PROMPTS):
            f.create_session("acme", f"s{i}", p)
        rows = f.list_sessions(fleet=True)
        return {"supervised": sorted(groups[n] for n in f.hosts),
                "sessions": sorted((groups[r["node"]], r["backend"], r["device"]) for r in rows),
                "driver_backend": f.kernel.backend, "cross_group_fork": cross_group_fork(f, groups, rows),
                "cuda_everywhere": cuda_everywhere(tmp)}
    finally:
        f.shutdown()


def cuda_everywhere(tmp: Path) -> str:
    """A CUDA default on a cluster without a GPU: the fleet must say so, not blame resources."""
    try:
        KernelFleet(f"sqlite:///{tmp / 'cuda.db'}", KernelSpec(backend="torch", device="cuda"), node_refresh_s=0.0)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "built"


def cross_group_fork(f: KernelFleet, groups: dict[str, str], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Fork a torch (`fast`) session onto the numpy (`cpu`) node: its KV is not portable there, so
    the child must replay the log (nothing adopted, nothing moved) and hold the parent's tokens."""
    parent = next(r for r in rows if groups[r["node"]] == "fast")
    cpu = next(n for n, g in groups.items() if g == "cpu")
    f.append("acme", parent["session"], " a turn long enough to fill more blocks of KV. " * 2)
    try:
        rec = f.fork("acme", parent["session"], "child", share=True, node=cpu)
    except Exception as e:  # noqa: BLE001 - reported: a fork across groups must not fail either
        return {"error": f"{type(e).__name__}: {e}"}
    child = f.info("acme", "child")
    return {"adopted_tokens": rec["adopted_tokens"], "moved_bytes": rec["moved_bytes"],
            "child": (groups[rec["node"]], child["backend"]),
            "same_tokens": f.tokens("acme", "child") == f.tokens("acme", parent["session"])}


def main(out: Path) -> None:
    cluster = start_cluster()
    try:
        scenario_result(out, scenario)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)  # the cluster's files (it left one per run)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
