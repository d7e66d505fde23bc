"""A call that fails on its kernel host after its op was logged (a recompute that raised mid-evict) leaves
the live state torn: the host never serves it again, the fleet rebuilds the session from its op log, and
the retry under the same op id is answered as a session that never failed (real Ray, real SQLite store)."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.core.errors import NotFound, Unavailable
from workers.fleet import KernelFleet

IDS = np.random.default_rng(3).integers(0, 256, 40).tolist()


def _three_pieces(kfleet: KernelFleet, tenant: str, sid: str) -> None:
    kfleet.create_session(tenant, sid, "system", tokens=IDS[:20])
    kfleet.append_output(tenant, sid, IDS[20:30], op_id="a1")     # piece 1: evicted
    kfleet.append_output(tenant, sid, IDS[30:40], op_id="a2")     # piece 2: its survivor, recomputed


def test_a_retry_after_a_failure_past_the_log_matches_a_session_that_never_failed(
        kfleet: KernelFleet, tenant: str) -> None:
    import ray
    import ray.cloudpickle
    import support.faults

    ray.cloudpickle.register_pickle_by_value(support.faults)  # the host's process cannot import tests/support

    _three_pieces(kfleet, tenant, "clean")
    clean = kfleet.evict(tenant, "clean", 1, "exact", op_id="e1")   # control: never failed
    _three_pieces(kfleet, tenant, "s1")
    with pytest.raises(NotFound):
        kfleet.evict(tenant, "s1", 7, "exact", op_id="e0")         # control: refused before the log
    assert kfleet.num_regenerations == 0                            # ... changes nothing
    host = kfleet.hosts[kfleet.registry.get(tenant, "s1").node]
    ray.get(host.__ray_call__.remote(support.faults.host_mlp_fails_once))
    with pytest.raises(Unavailable, match="failed after its op was logged.*retry with the same op_id"):
        kfleet.evict(tenant, "s1", 1, "exact", op_id="e1")
    r = kfleet.evict(tenant, "s1", 1, "exact", op_id="e1")         # the caller's retry: rebuilt, then answered
    assert (r.replayed, r.num_tokens) == (True, clean.num_tokens) == (True, 30)   # before: replayed at 20
    assert kfleet.digest(tenant, "s1") == kfleet.digest(tenant, "clean")
    assert kfleet.num_regenerations == 1
