"""A node's KV budget (--node-kv-bytes) holds for creates and forks placed at once: they all read the same offer, so
the host that admits them checks its room again, counting the creates and forks still filling on it
(workers/host_slots.py `_check_room`). A try its host refused, with no other node left, is told so by that host
(its node, what it has free).

NOTE: before, the budget was placement's alone: six creates at once on a node of 6 blocks' budget all went there,
and it held 31 blocks (one create at a time: one session, 6 blocks); six forks at once of a parent on a node of 8
blocks' budget all stayed there (13 blocks; one at a time: one fork, 8 blocks). And a refused try said "0 eligible
nodes, the most free: 0 bytes" beside a node that was there and full."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.workers import SPEC, together

from fleet.core.errors import ResourceExhausted
from workers.fleet import KernelFleet
from workers.spec import make_kernel

N = 6
PROMPTS = [f"You are racing agent number {i}; answer in a line." for i in range(N)]   # 48 tokens: 3 blocks each
PARENT = "You are the parent agent of six forks; answer in a line."

Race = tuple[dict[int, Any], int, KernelFleet]


def _try(call: Callable[[], dict[str, Any]]) -> Any:
    """The node of a created or forked session, or the ResourceExhausted that refused it."""
    try:
        return call()["node"]
    except ResourceExhausted as e:
        return e


def _race(tmp_path: Path, budget_blocks: int, setup: Callable[[KernelFleet], Any],
          call: Callable[[KernelFleet, int], Any]) -> tuple[Race, Race]:
    """`call(f, i)` for N tries on a fresh one-node fleet with a budget of `budget_blocks`, once one after another
    (the control) and once all at once: per run, i -> node or refusal, the node's KV bytes used, and the fleet (the
    control's shut down, the race's open)."""
    runs = []
    for at_once in (False, True):
        f = KernelFleet(f"sqlite:///{tmp_path / f'{at_once}.db'}", SPEC,
                        node_kv_bytes=budget_blocks * make_kernel(SPEC).block_bytes, call_timeout_s=120.0)
        setup(f)
        out = together(N, lambda i, f=f: call(f, i), at_once)
        [stats] = f.node_stats()
        runs.append((out, stats["kv_used_bytes"], f))
        if not at_once:
            f.shutdown()
    return runs[0], runs[1]


def _admitted(race: Race, bb: int) -> list[int]:
    """The tries that got a node; the refused ones name the flag, and the host's own word or placement's."""
    out, used, f = race
    print({i: o if isinstance(o, str) else str(o)[:160] for i, o in out.items()}, used // bb)
    refused = [o for o in out.values() if not isinstance(o, str)]
    assert all(e.code == "RESOURCE_EXHAUSTED" and "--node-kv-bytes" in str(e) for e in refused)
    [nid] = f.hosts
    assert all(f"node {nid} has no KV room" in str(e) or " 1 eligible nodes" in str(e) for e in refused)
    return sorted(i for i, o in out.items() if isinstance(o, str))


def test_creates_placed_at_once_never_overfill_a_nodes_kv_budget(ray_cluster: None, tmp_path: Path,
                                                                 tenant: str) -> None:
    bb = make_kernel(SPEC).block_bytes
    (one_by_one, used_serial, _), race = _race(
        tmp_path, 6, lambda f: None, lambda f, i: _try(lambda: f.create_session(tenant, f"s{i}", PROMPTS[i])))
    at_once, used, f = race
    try:
        ok = _admitted(race, bb)
        assert sum(isinstance(o, str) for o in one_by_one.values()) == 1 and used_serial == 6 * bb   # the control
        assert len(ok) == 1 and used == used_serial                     # before: 6 sessions, 31 blocks
        assert [r["session"] for r in f.list_sessions(tenant=tenant)] == [f"s{i}" for i in ok]   # nothing left behind
        assert all(f.store.oplog_read(tenant, f"s{i}") == [] for i in at_once if i not in ok)
        f.close(tenant, f"s{ok[0]}")
        assert f.create_session(tenant, "again", PROMPTS[0])["state"] == "active"   # room again once it closed
    finally:
        f.shutdown()


@pytest.mark.slow
def test_forks_placed_at_once_never_overfill_a_nodes_kv_budget(ray_cluster: None, tmp_path: Path,
                                                               tenant: str) -> None:
    bb = make_kernel(SPEC).block_bytes
    (one_by_one, used_serial, _), race = _race(
        tmp_path, 8, lambda f: f.create_session(tenant, "p", PARENT),
        lambda f, i: _try(lambda: f.fork(tenant, "p", f"c{i}", share=True)))
    at_once, used, f = race
    try:
        ok = _admitted(race, bb)
        serial_ok = sum(isinstance(o, str) for o in one_by_one.values())
        assert 0 < serial_ok < N and used_serial <= 8 * bb                 # the control: the budget binds
        assert len(ok) == serial_ok and used == used_serial                # before: 6 forks
        assert sorted(r["session"] for r in f.list_sessions(tenant=tenant)) == sorted(["p", *(f"c{i}" for i in ok)])
        assert all(f.store.oplog_read(tenant, f"c{i}") == [] for i in at_once if i not in ok)   # nothing left behind
    finally:
        f.shutdown()
