"""A node's KV budget (--node-kv-bytes) holds for creates placed at once: they all read the same offer, so the host
that admits them checks its room again, counting the creates still prefilling on it (workers/host_slots.py
`_check_room`). NOTE: before, the budget was placement's alone: six creates at once on a node of 6 blocks' budget
all went there, and it held 31 blocks (one create at a time: one session, 6 blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support.workers import SPEC, together

from fleet.core.errors import ResourceExhausted
from workers.fleet import KernelFleet
from workers.spec import make_kernel

PROMPTS = [f"You are racing agent number {i}; answer in a line." for i in range(6)]   # 48 tokens: 3 blocks each


def _create(f: KernelFleet, tenant: str, i: int) -> Any:
    try:
        return f.create_session(tenant, f"s{i}", PROMPTS[i])["node"]
    except ResourceExhausted as e:
        return e


def _run(url: str, tenant: str, at_once: bool) -> tuple[dict[int, Any], int, KernelFleet]:
    f = KernelFleet(url, SPEC, node_kv_bytes=6 * make_kernel(SPEC).block_bytes, call_timeout_s=120.0)
    if at_once:
        out = together(len(PROMPTS), lambda i: _create(f, tenant, i))
    else:
        out = {i: _create(f, tenant, i) for i in range(len(PROMPTS))}
    [stats] = f.node_stats()
    return out, stats["kv_used_bytes"], f


def test_creates_placed_at_once_never_overfill_a_nodes_kv_budget(ray_cluster: None, tmp_path: Path,
                                                                 tenant: str) -> None:
    bb = make_kernel(SPEC).block_bytes
    one_by_one, used_serial, control = _run(f"sqlite:///{tmp_path / 'serial.db'}", tenant, at_once=False)
    control.shutdown()
    at_once, used, f = _run(f"sqlite:///{tmp_path / 'race.db'}", tenant, at_once=True)
    try:
        ok = sorted(i for i, o in at_once.items() if isinstance(o, str))
        print({i: o if isinstance(o, str) else str(o)[:90] for i, o in at_once.items()}, used // bb)
        assert sum(isinstance(o, str) for o in one_by_one.values()) == 1 and used_serial == 6 * bb   # the control
        assert len(ok) == 1 and used == used_serial                     # before: 6 sessions, 31 blocks
        refused = [o for o in at_once.values() if not isinstance(o, str)]
        assert all(e.code == "RESOURCE_EXHAUSTED" and "--node-kv-bytes" in str(e) for e in refused)
        # one its host refused, with no other node left, says so (the host's word: its node, what it has free);
        # NOTE: placement's word alone said "0 eligible nodes, the most free: 0 bytes" beside a full node
        [nid] = f.hosts
        assert all(f"node {nid} has no KV room" in str(e) or " 1 eligible nodes" in str(e) for e in refused)
        assert [r["session"] for r in f.list_sessions(tenant=tenant)] == [f"s{i}" for i in ok]   # nothing left behind
        assert all(f.store.oplog_read(tenant, f"s{i}") == [] for i in at_once if i not in ok)
        f.close(tenant, f"s{ok[0]}")
        assert f.create_session(tenant, "again", PROMPTS[0])["state"] == "active"   # room again once it closed
    finally:
        f.shutdown()
