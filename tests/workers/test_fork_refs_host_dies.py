"""A fork whose host dies after writing the child's log, and that the fleet runs again on the restarted host, takes
its blob references once (real Ray: the host process exits in the fork's prefill; real SQLite store)."""

from __future__ import annotations

import time

import pytest

from workers.fleet import KernelFleet

LATER = 10 * 365 * 86400.0  # every lease has long run out


@pytest.mark.slow
def test_a_fork_run_again_after_its_host_died_takes_its_references_once(kfleet: KernelFleet, tenant: str) -> None:
    # before: the first run wrote the child's log with a reference per tool result, the host died in the child's
    # prefill, and the run again on the restarted host took them once more: 3 references for 2 logs, so the blob
    # outlived both sessions (never collected)
    import ray
    import ray.cloudpickle
    import support.faults

    ray.cloudpickle.register_pickle_by_value(support.faults)  # the host's process cannot import tests/support
    store = kfleet.store
    ref = store.put(b'{"weather": "sunny, 21C"}', tenant)
    kfleet.create_session(tenant, "a", "You are agent zero.")
    kfleet.add_tool_result(tenant, "a", ref)
    host = kfleet.hosts[kfleet.registry.get(tenant, "a").node]
    ray.get(host.__ray_call__.remote(support.faults.host_exits_in_next_mlp))   # dies in the child's prefill
    kfleet.fork(tenant, "a", "b")                                   # the fleet runs it again on the new host
    assert store.stat(ref, tenant).refs == 2                        # before: 3
    assert kfleet.tokens(tenant, "b") == kfleet.tokens(tenant, "a")
    kfleet.close(tenant, "a")
    kfleet.close(tenant, "b")
    assert store.stat(ref, tenant).refs == 0                        # before: 1
    assert store.gc(now=time.time() + LATER) == 1                   # before: 0, the blob kept for good
