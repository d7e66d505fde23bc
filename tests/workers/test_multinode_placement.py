"""Placement rules (pure) and the per-node KV budget on the shared single-node Ray.

The multi-node behaviour itself is in test_multinode.py (its own cluster, in a child process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
from support.workers import SPEC

from fleet.core.errors import ResourceExhausted
from workers.fleet import KernelFleet
from workers.placement import (
    NodeOffer,
    choose_node,
    eligible_nodes,
    host_ids,
    node_hosts,
    node_of,
    node_resources,
)
from workers.spec import make_kernel

HEAD = {"NodeID": "head", "Alive": True, "Resources": {"memory": 1e9, "node:__internal_head__": 1.0}}
CPU = {"NodeID": "cpu", "Alive": True, "Resources": {"CPU": 2.0}}
ACCEL = {"NodeID": "acc", "Alive": True, "Resources": {"CPU": 1.0, "accel": 1.0}}
DEAD = {"NodeID": "dead", "Alive": False, "Resources": {"CPU": 8.0}}


def test_only_alive_nodes_with_the_node_resources_are_eligible() -> None:
    nodes = [HEAD, CPU, ACCEL, DEAD]
    assert eligible_nodes(nodes, node_resources()) == ["acc", "cpu"]            # no 0-CPU head, no dead
    assert eligible_nodes(nodes, node_resources({"accel": 0.01})) == ["acc"]


def test_a_cuda_node_gets_one_host_per_gpu_and_a_cpu_node_one() -> None:
    """One kernel host per device (issue #29): each asks Ray for one GPU and owns it."""
    assert node_hosts("n1", {"CPU": 16.0, "GPU": 4.0}, needs_gpu=True) == {
        "n1": 4.0, "n1:gpu1": 4.0, "n1:gpu2": 4.0, "n1:gpu3": 4.0}
    assert node_hosts("n1", {"CPU": 16.0, "GPU": 4.0}, needs_gpu=False) == {"n1": 16.0}   # a CPU kernel: one
    assert node_hosts("n2", {"CPU": 2.0}, needs_gpu=False) == {"n2": 2.0}
    assert [node_of(h) for h in host_ids("n1", 3)] == ["n1"] * 3 and node_of("n1") == "n1"


def test_a_full_host_takes_no_session() -> None:
    """The session budget (--node-max-sessions) gates placement beside the KV budget."""
    offers = [NodeOffer("a", 64, 2, 10_000, max_sessions=2), NodeOffer("b", 0, 5, 10_000, max_sessions=8)]
    assert choose_node(offers, 10, 1) == "b"                    # a is warmer but holds its most sessions
    with pytest.raises(ResourceExhausted, match="--node-max-sessions"):
        choose_node([NodeOffer("a", 0, 2, 10_000, max_sessions=2)], 10, 1)


def test_choice_prefers_warm_then_idle_among_nodes_with_room() -> None:
    offers = [NodeOffer("a", 32, 5, 10_000), NodeOffer("b", 0, 0, 20_000), NodeOffer("c", 64, 0, 0)]
    assert choose_node(offers, 40, 100) == "a"                 # c is warmer but its budget is spent
    assert choose_node(offers, 132, 100) == "a"                # a holds 32 warm: 100 tokens of its own fit
    assert choose_node(offers, 133, 100) == "b"
    assert choose_node(offers, 200, 100) == "b"
    with pytest.raises(ResourceExhausted, match="no node has room.*--node-kv-bytes"):
        choose_node(offers, 201, 100)
    with pytest.raises(ResourceExhausted):
        choose_node([], 0, 0)


def test_a_full_fleet_refuses_a_session_with_resource_exhausted_and_leaves_nothing(
        ray_cluster: None, tmp_path: Path, tenant: str) -> None:
    url = f"sqlite:///{tmp_path / 'full.db'}"
    f = KernelFleet(url, SPEC, node_kv_bytes=4 * make_kernel(SPEC).block_bytes)
    try:
        prompt = "You are a budget agent; answer in one line."          # 44 tokens: 3 private blocks + 2 cached
        f.create_session(tenant, "b1", prompt)
        [stats] = f.node_stats()
        assert stats["kv_used_bytes"] == 5 * make_kernel(SPEC).block_bytes > stats["kv_budget_bytes"]
        with pytest.raises(ResourceExhausted, match="no node has room") as e:
            f.create_session(tenant, "b2", prompt)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert f.registry.get(tenant, "b2") is None and f.store.oplog_read(tenant, "b2") == []
        [node] = f.hosts
        assert [r["session"] for r in ray.get(f.hosts[node].rows.remote(tenant))] == ["b1"]  # no kernel for b2
        f.close(tenant, "b1")                                           # room again (the cached blocks stay)
        assert f.create_session(tenant, "b3", prompt)["adopted_tokens"] == 32
    finally:
        f.shutdown()


def test_a_full_host_takes_no_fork_and_refuses_one_that_names_it(ray_cluster: None, tmp_path: Path,
                                                                 tenant: str) -> None:
    """--node-max-sessions holds for forks too. NOTE: before, a fork went to its parent's node while its KV budget
    had bytes left, and the host took it: with a budget of 2 sessions, 6 forks were accepted (8 on the host)."""
    f = KernelFleet(f"sqlite:///{tmp_path / 'max.db'}", SPEC, node_max_sessions=2)
    try:
        f.create_session(tenant, "a", "first session prompt")
        f.create_session(tenant, "b", "second session prompt")
        [node] = f.hosts
        with pytest.raises(ResourceExhausted, match="--node-max-sessions"):
            f.fork(tenant, "a", "f0")                                  # placement: no node has room
        with pytest.raises(ResourceExhausted, match="--node-max-sessions"):
            f.fork(tenant, "a", "f1", node=node)                       # named: the host refuses it
        with pytest.raises(ResourceExhausted, match="--node-max-sessions"):
            f.nodes.call(node, "create_session", tenant, "c", f.tokenizer.encode("third"), "op-c")
        [stats] = f.node_stats()
        assert (stats["sessions"], stats["max_sessions"]) == (2, 2)
        assert [r["session"] for r in f.list_sessions(tenant=tenant)] == ["a", "b"]   # nothing left behind
        assert f.store.oplog_read(tenant, "f0") == f.store.oplog_read(tenant, "f1") == []
        f.close(tenant, "b")                                           # control: room again, the fork goes there
        assert f.fork(tenant, "a", "f2")["node"] == node
    finally:
        f.shutdown()
