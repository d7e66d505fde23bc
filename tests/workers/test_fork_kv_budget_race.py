"""A node's KV budget (--node-kv-bytes) holds for forks placed at once, as for creates (test_kv_budget_race.py): they
all read the parent's node's offer, so the host that admits a fork checks its room again, counting the forks still
restoring there (workers/host_slots.py `_check_room`). NOTE: before, a fork's host checked its session budget only:
six forks at once of a parent on a node of 8 blocks' budget all stayed there (13 blocks; one at a time: one fork,
8 blocks). A fork refused there, with no other node left, is told so by that host (its node, what it has free)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.workers import SPEC, together

from fleet.core.errors import ResourceExhausted
from workers.fleet import KernelFleet
from workers.spec import make_kernel

PROMPT = "You are the parent agent of six forks; answer in a line."
N = 6


def _fork(f: KernelFleet, tenant: str, i: int, share: bool) -> Any:
    try:
        return f.fork(tenant, "p", f"c{i}", share=share)["node"]
    except ResourceExhausted as e:
        return e


def _run(url: str, tenant: str, at_once: bool, share: bool = True) -> tuple[dict[int, Any], int, KernelFleet]:
    f = KernelFleet(url, SPEC, node_kv_bytes=8 * make_kernel(SPEC).block_bytes, call_timeout_s=120.0)
    f.create_session(tenant, "p", PROMPT)
    if at_once:
        out = together(N, lambda i: _fork(f, tenant, i, share))
    else:
        out = {i: _fork(f, tenant, i, share) for i in range(N)}
    [stats] = f.node_stats()
    return out, stats["kv_used_bytes"], f


def test_forks_placed_at_once_never_overfill_a_nodes_kv_budget(ray_cluster: None, tmp_path: Path,
                                                               tenant: str) -> None:
    bb = make_kernel(SPEC).block_bytes
    one_by_one, used_serial, control = _run(f"sqlite:///{tmp_path / 'serial.db'}", tenant, at_once=False)
    control.shutdown()
    at_once, used, f = _run(f"sqlite:///{tmp_path / 'race.db'}", tenant, at_once=True)
    try:
        ok = sorted(i for i, o in at_once.items() if isinstance(o, str))
        print({i: o if isinstance(o, str) else str(o)[:160] for i, o in at_once.items()}, used // bb, used_serial // bb)
        serial_ok = sum(isinstance(o, str) for o in one_by_one.values())
        assert 0 < serial_ok < N and used_serial <= 8 * bb                 # the control: the budget binds
        assert len(ok) == serial_ok and used == used_serial                # before: 6 forks
        refused = [o for o in at_once.values() if not isinstance(o, str)]
        assert all(e.code == "RESOURCE_EXHAUSTED" and "--node-kv-bytes" in str(e) for e in refused)
        # a fork its host refused, with no other node left, says so (the host's word, its node named); placement's
        # word alone said "0 eligible nodes, the most free: 0 bytes" beside a node that was there and full
        [nid] = f.hosts
        assert all(f"node {nid} has no KV room" in str(e) or " 1 eligible nodes" in str(e) for e in refused)
        assert sorted(r["session"] for r in f.list_sessions(tenant=tenant)) == sorted(["p", *(f"c{i}" for i in ok)])
        assert all(f.store.oplog_read(tenant, f"c{i}") == [] for i in at_once if i not in ok)   # nothing left behind
    finally:
        f.shutdown()
