"""Multi-node scenarios on a real Ray cluster of several raylets on this machine (run as a script).

    python tests/workers/multinode_scenarios.py OUT.json

`ray.cluster_utils.Cluster` starts a head with 0 CPUs (as the chart's KubeRay head) and small
CPU nodes, one of them advertising a custom `accel` resource: real multi-node scheduling, object
transfer between raylets and node death. Each scenario writes its findings (and its timings, for
bench/fleet_nodes.py; the tests assert none of them) under its name in OUT.json as soon as it
ends, or {"error": traceback} when it fails, so one failure does not hide the others.

It runs in its own process: the pytest process already holds a single-node Ray, and a process
has one Ray connection. The Cluster must not leak either: `Cluster` writes its address to Ray's
default temp dir, where every other `ray.init()` on the machine would pick it up; we give it a
private temp dir and do not write the address file.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from fleet.core.errors import ResourceExhausted  # noqa: E402
from workers.fleet import KernelFleet  # noqa: E402
from workers.placement import RAY_NAMESPACE, fleet_scope, host_name  # noqa: E402
from workers.registry import SessionRegistry  # noqa: E402
from workers.spec import KernelSpec  # noqa: E402

SPEC = KernelSpec(block_size=16)
HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4, "health_check_initial_delay_ms": 0}
T = "acme"
LOGS: dict[int, Path] = {}  # controller pid -> its log (its tail goes into a failure's message)


def start_cluster(num_nodes: int = 2, accel_node: bool = True) -> Any:
    """A head with 0 CPUs + `num_nodes` nodes of 1 CPU (the last one with an `accel` resource)."""
    import ray._private.utils as ray_utils
    from ray.cluster_utils import Cluster

    ray_utils.write_ray_address = lambda *a, **k: None   # never advertise this cluster machine-wide
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="kvmn")   # short: Ray's socket paths must fit
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "_system_config": HEALTH})
    for i in range(num_nodes):
        extra = {"accel": 1.0} if accel_node and i == num_nodes - 1 else {}
        cluster.add_node(num_cpus=1, resources=extra)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
    return cluster


def wait_node_dead(node_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            return
        time.sleep(0.1)
    raise AssertionError(f"node {node_id} still alive")


def wait_unreachable(actor: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnschedulableError):
            return
        time.sleep(0.1)
    raise AssertionError("an actor of the dead node still answers")


def wait_host(f: KernelFleet, node_id: str, timeout_s: float = 60.0) -> None:
    """Wait until the fleet has a kernel host on a node that just joined and that host answers.

    NOTE: asked for itself, not through the fleet's fan-out (node_stats, placement): a host that is
    still starting misses the fan-out's probe window and is held down for SUSPECT_S (10 s), which a
    test polling node_stats() would only sit out."""
    deadline = time.monotonic() + timeout_s
    while node_id not in f.refresh_nodes():
        if time.monotonic() > deadline:
            raise AssertionError(f"the fleet started no host on node {node_id}")
        time.sleep(0.1)
    ray.get(f.hosts[node_id].stats.remote(), timeout=max(1.0, deadline - time.monotonic()))


def actor_info(url: str, tenant: str, sid: str) -> dict[str, Any]:
    """A session's own info row, asked of the kernel host that holds it (its node from the registry)."""
    from fleet.cas import open_store

    with open_store(url) as store:
        node = SessionRegistry(store).get(tenant, sid).node  # type: ignore[index]
    host = ray.get_actor(host_name(node, fleet_scope(url)), namespace=RAY_NAMESPACE)
    return dict(ray.get(host.call.remote(tenant, sid, "info"), timeout=60))


def max_delta(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# -- scenarios ---------------------------------------------------------------------------------

def placement(cluster: Any, tmp: Path) -> dict[str, Any]:
    """The 0-CPU head gets no kernel host; sessions spread over the CPU nodes; a fleet whose
    sessions need `accel` uses only the node that has it."""
    head = cluster.head_node.node_id
    cpu_nodes = sorted(n.node_id for n in cluster.worker_nodes)
    f = KernelFleet(f"sqlite:///{tmp / 'place.db'}", SPEC, node_refresh_s=0.0)
    g = KernelFleet(f"sqlite:///{tmp / 'accel.db'}", SPEC, node_refresh_s=0.0, resources={"accel": 0.01})
    try:
        prompts = ["You are a planner.", "Answer tersely, as a critic."]   # no shared prefix: load decides
        nodes = [f.create_session(T, f"p{i}", p)["node"] for i, p in enumerate(prompts)]
        accel = [g.create_session(T, f"a{i}", p)["node"] for i, p in enumerate(prompts)]
        accel_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("accel"))
        return {"head": head, "cpu_nodes": cpu_nodes, "supervised": sorted(f.hosts),
                "session_nodes": nodes, "accel_supervised": sorted(g.hosts), "accel_session_nodes": accel,
                "accel_node": accel_node}
    finally:
        f.shutdown()
        g.shutdown()


def budget(cluster: Any, tmp: Path) -> dict[str, Any]:
    """Per-node KV budget of 6 blocks; a 44-token prompt holds 3 blocks, plus 2 cached on its node.

    b1 -> some node A (5 blocks). b2, same prompt: A still fits it, because it adopts A's 2 cached
    blocks and holds 1 of its own (A: 6, full). A fork of b1: A is full, so it goes to the other
    node B and adopts b1's blocks moved by Ray (copies: they count on B, 3 blocks). b3, same
    prompt: warm on A but A is full: B (3 + 3 + 2 cached = 8). b4: no room anywhere."""
    bb = f_block_bytes()
    url = f"sqlite:///{tmp / 'budget.db'}"
    f = KernelFleet(url, SPEC, node_refresh_s=0.0, node_kv_bytes=6 * bb)
    try:
        prompt = "You are a budget agent; answer in one line."       # 44 bytes: 3 blocks
        b1 = f.create_session(T, "b1", prompt)
        b2 = f.create_session(T, "b2", prompt)
        fork = f.fork(T, "b1", "b1f")
        b3 = f.create_session(T, "b3", prompt)
        try:
            f.create_session(T, "b4", prompt)
            refused = "created"
        except ResourceExhausted as e:
            refused = f"{e.code}: {e}"
        used = {s["node"]: s["kv_used_bytes"] // bb for s in f.node_stats()}
        return {"b1": b1["node"], "b2": b2["node"], "b2_adopted": b2["adopted_tokens"], "fork": fork["node"],
                "fork_moved_blocks": fork["moved_bytes"] // bb,
                "fork_delta": max_delta(f.last_logits(T, "b1f"), f.last_logits(T, "b1")),
                "b3": b3["node"], "b4": refused, "used_blocks": used,
                "listed": [r["session"] for r in f.list_sessions(tenant=T)]}
    finally:
        f.shutdown()


def f_block_bytes() -> int:
    from workers.spec import make_kernel

    return int(make_kernel(SPEC).block_bytes)


def nodes_come_and_go(cluster: Any, tmp: Path) -> dict[str, Any]:
    """A node joins and takes the next session; it dies with live sessions: listing and creating
    still work, one session answers on its next call, the rest are regenerated by reconcile(),
    all bit-identical (digest and logits) on surviving nodes."""
    f = KernelFleet(f"sqlite:///{tmp / 'churn.db'}", SPEC, node_refresh_s=0.0)
    try:
        # no shared first block: least-loaded placement puts one on each node (a warm prefix would
        # put both on one node, and the newcomer would then tie with the other on load)
        for i, prompt in enumerate(["Resident planner: keep notes.", "Archivist on duty; be terse."]):
            f.create_session(T, f"old{i}", prompt)
        t0 = time.perf_counter()
        new = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        wait_host(f, new.node_id)
        deadline = time.monotonic() + 60      # in the node table; then its host must answer
        while new.node_id not in {s["node"] for s in f.node_stats()} and time.monotonic() < deadline:
            time.sleep(0.2)
        join_s = time.perf_counter() - t0
        placed = [f.create_session(T, f"new{i}", f"You are newcomer agent number {i}.")["node"] for i in range(2)]
        sids = [f"old{i}" for i in range(2)] + [f"new{i}" for i in range(2)]
        for sid in sids:
            f.append(T, sid, f"Work item for {sid}: summarise the log.")
        before = {sid: (f.digest(T, sid), f.last_logits(T, sid)) for sid in sids}
        on_new = [sid for sid in sids if f._record(T, sid).node == new.node_id]
        if not on_new:
            raise AssertionError(f"no session on the new node {new.node_id}: placed on {placed}")
        host = f.hosts[new.node_id]
        cluster.remove_node(new, allow_graceful=False)                  # SIGKILL its raylet
        wait_node_dead(new.node_id)
        wait_unreachable(host)      # its host process notices a moment later; until then it answers
        rows = {r["session"]: r["state"] for r in f.list_sessions(tenant=T)}
        extra = f.create_session(T, "after", "You are created after the loss.")["node"]
        t0 = time.perf_counter()
        first = f.digest(T, on_new[0])                                  # regenerated on its next call
        next_call_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reconciled = f.reconcile()
        reconcile_s = time.perf_counter() - t0
        after = {sid: (f.digest(T, sid), f.last_logits(T, sid)) for sid in sids}
        return {
            "new_node": new.node_id, "placed": placed, "on_new": on_new, "rows_after_loss": rows,
            "created_after_loss_on": extra, "supervised_after": sorted(f.hosts),
            "first_digest_equal": first == before[on_new[0]][0], "reconciled": reconciled,
            "digests_equal": {s: after[s][0] == before[s][0] for s in sids},
            "logits_max_delta": max(max_delta(after[s][1], before[s][1]) for s in sids),
            "control_delta": max_delta(before[sids[0]][1], before[sids[1]][1]),
            "nodes_after": {s: f._record(T, s).node for s in sids},
            "regenerations": f.num_regenerations, "join_s": join_s, "next_call_regen_s": next_call_s,
            "reconcile_s": reconcile_s,
        }
    finally:
        f.shutdown()


def cross_node_fork(cluster: Any, tmp: Path) -> dict[str, Any]:
    """A fork on another node adopts the parent's blocks (moved by Ray) and equals a replayed
    fork bit for bit; control: the two branches differ once they diverge."""
    url = f"sqlite:///{tmp / 'fork.db'}"
    f = KernelFleet(url, SPEC, node_refresh_s=0.0)
    try:
        parent = f.create_session(T, "parent", "You are the parent agent. " * 4)
        f.append(T, "parent", "Here is a long task description that both branches will share. " * 3)
        other = next(n for n in f.hosts if n != parent["node"])
        t0 = time.perf_counter()
        shared = f.fork(T, "parent", "shared", node=other)
        shared_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        replayed = f.fork(T, "parent", "replayed", share=False, node=other)
        replay_s = time.perf_counter() - t0
        equal_now = max_delta(f.last_logits(T, "shared"), f.last_logits(T, "replayed"))
        f.append(T, "shared", "Continue with step two.")
        f.append(T, "replayed", "Continue with step two.")
        equal_after = max_delta(f.last_logits(T, "shared"), f.last_logits(T, "replayed"))
        f.append(T, "replayed", "But first, a detour.")
        control = max_delta(f.last_logits(T, "shared"), f.last_logits(T, "replayed"))
        si, ri = actor_info(url, T, "shared"), actor_info(url, T, "replayed")
        # the other node's kernel now stands for one on another CPU code path (its model_id differs): a fork
        # there replays, it adopts none of the parent's blocks (before, blocks of other bits were adopted)
        ray.get(f.hosts[other].__ray_call__.remote(_other_code_path))
        foreign = f.fork(T, "parent", "foreign", node=other)
        f.fork(T, "parent", "again", share=False, node=other)
        foreign_delta = max_delta(f.last_logits(T, "foreign"), f.last_logits(T, "again"))
        return {"foreign_node": foreign["node"], "foreign_adopted": foreign["adopted_tokens"],
                "foreign_moved_bytes": foreign["moved_bytes"], "foreign_delta": foreign_delta,
                "parent_node": parent["node"], "other": other, "shared_node": shared["node"],
                "replayed_node": replayed["node"], "moved_bytes": shared["moved_bytes"],
                "replay_moved_bytes": replayed["moved_bytes"], "adopted_tokens": shared["adopted_tokens"],
                "shared_prefilled": si["prefilled_tokens"], "replayed_prefilled": ri["prefilled_tokens"],
                "shared_tokens": si["tokens"], "max_delta": equal_now, "max_delta_after_append": equal_after,
                "control_delta": control, "shared_fork_s": shared_s, "replayed_fork_s": replay_s}
    finally:
        f.shutdown()


def re_rotated_fork(cluster: Any, tmp: Path) -> dict[str, Any]:
    """A fork on another node of a parent whose KV a reposition eviction re-rotated: the child replays its log, so
    it fetches nothing, and the parent's node files none of the parent's blocks (a later session whose prompt
    starts with the parent's tokens computes what a prefill of them does)."""
    from workers.spec import make_kernel

    f = KernelFleet(f"sqlite:///{tmp / 'rerotated.db'}", SPEC, node_refresh_s=0.0)
    try:
        system, task = "You are the parent agent. " * 4, "Here is a long task description that both share. " * 3
        parent = f.create_session(T, "P", system)
        f.append(T, "P", "An aside that will be evicted with reposition. " * 2)
        f.append(T, "P", task)
        exact = f.evict(T, "P", 1, mode="reposition").result.exact
        other = next(n for n in f.hosts if n != parent["node"])
        child = f.fork(T, "P", "C", node=other)
        victim = f.create_session(T, "V", system + task + " And then some more words.")
        s = make_kernel(SPEC).session()
        s.append(f.tokens(T, "V"))
        return {"exact": exact, "parent_node": parent["node"], "child_node": child["node"], "other": other,
                "child_adopted": child["adopted_tokens"], "child_moved_bytes": child["moved_bytes"],
                "child_equals_parent": f.digest(T, "C") == f.digest(T, "P"),
                "victim_node": victim["node"], "victim_adopted": victim["adopted_tokens"],
                "victim_equals_prefill": f.digest(T, "V") == s.digest(),
                "victim_delta": max_delta(f.last_logits(T, "V"), s.last_logits)}
    finally:
        f.shutdown()


def owner_dies_mid_fork(cluster: Any, tmp: Path) -> dict[str, Any]:
    """A fork on another node whose parent's host (the owner of the blocks it shares) dies after handing out their
    refs, before the child's host fetched them: the child replays its log instead, and the fork succeeds."""
    f = KernelFleet(f"sqlite:///{tmp / 'owner.db'}", SPEC, node_refresh_s=0.0)
    try:
        parent = f.create_session(T, "P", "You are the parent agent. " * 8)
        f.append(T, "P", "Shared task description, long enough for several blocks. " * 6)
        other = next(n for n in f.hosts if n != parent["node"])
        call, killed = f.nodes.call, []

        def owner_dies(node: str, method: str, *args: Any) -> Any:
            out = call(node, method, *args)
            if method == "share_prefix":
                killed.append(len(out["refs"]))
                ray.kill(f.hosts[parent["node"]], no_restart=False)   # Ray restarts it, empty
                time.sleep(2)
            return out

        f.nodes.call = owner_dies  # type: ignore[method-assign]
        try:
            child = f.fork(T, "P", "C", node=other)
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - the outcome is the finding
            child, outcome = {}, f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
        finally:
            f.nodes.call = call  # type: ignore[method-assign]
        out: dict[str, Any] = {"outcome": outcome, "refs_handed_out": killed, "other": other}
        if child:
            out.update(child_node=child["node"], child_adopted=child["adopted_tokens"],
                       child_moved_bytes=child["moved_bytes"], child_equals_parent=f.digest(T, "C") == f.digest(T, "P"),
                       parent_regenerations=f.num_regenerations)
        return out
    finally:
        f.shutdown()


def rebuild_model_id(cluster: Any, tmp: Path) -> dict[str, Any]:
    """A lost session is rebuilt on a survivor whose kernel has its model_id, though another survivor of another
    model_id (a third node that joins, standing for another CPU code path) holds fewer sessions; with no survivor of
    its model_id left, it is rebuilt all the same, and its record says so. Its node is held down to make it lost
    (the fleet's own view of a dead node); the third node leaves at the end."""
    new = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    f = KernelFleet(f"sqlite:///{tmp / 'model.db'}", SPEC, node_refresh_s=0.0)
    try:
        wait_host(f, new.node_id)
        ray.get(f.hosts[new.node_id].__ray_call__.remote(_other_code_path))
        ids = {n: f.nodes.call(n, "model_id") for n in f.hosts}
        placed = {f.create_session(T, f"s{i}", p)["node"]: f"s{i}" for i, p in enumerate(
            ["You are a planner.", "Answer tersely, as a critic.", "Archivist on duty; be terse."])}
        native = sorted(n for n in f.hosts if n != new.node_id)
        x, y = native
        sid = placed[x]
        for i in range(2):   # y holds 3 sessions, the foreign node 1: load alone would pick the foreign node
            f.fork(T, placed[y], f"y{i}", share=False, node=y)
        before = f.digest(T, sid)
        f.release_session(T, sid)
        f.nodes.hold_down(x, 300)
        same = f.digest(T, sid) == before
        first = f.registry.get(T, sid)
        f.release_session(T, sid)
        f.nodes.hold_down(y, 300)
        f.digest(T, sid)
        second = f.registry.get(T, sid)
        row = next(r for r in f.list_sessions(tenant=T) if r["session"] == sid)
        return {"ids": ids, "x": x, "y": y, "foreign": new.node_id, "native_id": ids[x],
                "first": first.to_dict() if first else None, "first_digest_equal": same,
                "second": second.to_dict() if second else None,
                "row": {k: row.get(k) for k in ("model_id", "rebuilt_from_model_id", "state", "node")}}
    finally:
        f.shutdown()
        cluster.remove_node(new)
        wait_node_dead(new.node_id)


def _other_code_path(host: Any) -> None:
    """(In a kernel host, by __ray_call__) its kernel, loaded by now, reports the model_id of another CPU code path."""
    host._loading.result()[0].model_id = "another-code-path"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _controller(url: str, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    path = tmp / f"controller-{time.time_ns()}.log"
    log = open(path, "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.app.cli.main", "controller", "--listen", f"127.0.0.1:{port}",
         "--metrics-port", "-1", "--store", url, "--ray-address", ray.get_runtime_context().gcs_address],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    LOGS[proc.pid] = path
    return proc


def controller_restart(cluster: Any, tmp: Path) -> dict[str, Any]:
    """A real `kvfleet controller` joined with --ray-address is SIGKILLed and started again:
    its sessions are still there, in the same processes, and nothing is prefilled again."""
    from fleet.sdk import FleetClient

    url, port = f"sqlite:///{tmp / 'ctl.db'}", _free_port()
    sids = ["c1", "c2"]
    proc = _controller(url, port, tmp)
    try:
        with FleetClient(f"127.0.0.1:{port}") as c:
            tenant = _create(c, sids, proc)
        before = {sid: actor_info(url, tenant, sid) for sid in sids}
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t0 = time.perf_counter()
        proc = _controller(url, port, tmp)
        with FleetClient(f"127.0.0.1:{port}") as c:
            appended = [_retry(lambda sid=sid: c.append(sid, "After the restart, go on."), proc).num_tokens
                        for sid in sids]
            first_call_s = time.perf_counter() - t0
            rows = {r.session_id: r.state for r in c.sessions(fleet=True)}
        after = {sid: actor_info(url, tenant, sid) for sid in sids}
        return {
            "same_pid": {s: after[s]["pid"] == before[s]["pid"] for s in sids},
            "replayed_ops": {s: after[s]["replayed_ops"] for s in sids},
            "prefilled_before": {s: before[s]["prefilled_tokens"] for s in sids},
            "prefilled_after": {s: after[s]["prefilled_tokens"] for s in sids},
            "tokens_added": {s: after[s]["tokens"] - before[s]["tokens"] for s in sids},
            "rows": rows, "appended": appended, "restart_to_first_answer_s": first_call_s,
        }
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        _stop_detached(url)


def _create(c: Any, sids: list[str], proc: subprocess.Popen[bytes]) -> str:
    for sid in sids:
        _retry(lambda sid=sid: c.create_session(sid, f"You are durable agent {sid}."), proc)
        c.append(sid, f"Remember the number {len(sid) * 7}.")
    return str(c.whoami().tenant)


def _retry(fn: Callable[[], Any], proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> Any:
    """Call through the controller until it is up (it starts while we wait); fail at once if it exited."""
    from fleet.core.errors import Unavailable

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except Unavailable:
            if proc.poll() is not None:
                log = LOGS[proc.pid].read_text(errors="replace")[-3000:]
                raise AssertionError(f"the controller exited ({proc.returncode}):\n{log}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _stop_detached(url: str) -> None:
    """The controller's fleet is detached: take it down from here (reattach, then shut down)."""
    KernelFleet(url, SPEC, detached=True).shutdown()


def node_loss(cluster: Any, tmp: Path) -> dict[str, Any]:
    """node_loss_scenario.py's scenario on this cluster, once a third CPU node has joined (the one
    nodes_come_and_go added is gone): it kills a node, so it runs last."""
    from node_loss_scenario import node_loss as scenario

    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    return scenario(cluster, tmp)


SCENARIOS: dict[str, Callable[[Any, Path], dict[str, Any]]] = {
    "placement": placement, "budget": budget, "nodes_come_and_go": nodes_come_and_go,
    "cross_node_fork": cross_node_fork, "re_rotated_fork": re_rotated_fork,
    "owner_dies_mid_fork": owner_dies_mid_fork, "rebuild_model_id": rebuild_model_id,
    "controller_restart": controller_restart,
    "node_loss": node_loss,  # last: it SIGKILLs a node
}


def run(out: Path, scenarios: dict[str, Callable[[Any, Path], dict[str, Any]]], **cluster_kw: Any) -> None:
    """Run `scenarios` in turn on one fresh cluster (`start_cluster(**cluster_kw)`); OUT.json gets each one's
    result (or its traceback) and wall time as it finishes, by name."""
    results: dict[str, Any] = {}
    cluster = start_cluster(**cluster_kw)
    tmp = Path(tempfile.mkdtemp(prefix="kvfleet-mn-"))
    try:
        for name, scenario in scenarios.items():
            t0 = time.perf_counter()
            try:
                results[name] = scenario(cluster, tmp)
            except Exception:  # noqa: BLE001 - reported to the test, which fails on it
                results[name] = {"error": traceback.format_exc()}
            results[name]["wall_s"] = time.perf_counter() - t0
            out.write_text(json.dumps(results, default=str))
    finally:
        ray.shutdown()
        cluster.shutdown()
        for d in (tmp, Path(os.environ["RAY_TMPDIR"])):
            shutil.rmtree(d, ignore_errors=True)


def main(out: Path, names: list[str]) -> None:
    run(out, {name: SCENARIOS[name] for name in names or list(SCENARIOS)})


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
