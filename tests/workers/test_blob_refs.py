"""A tool result held by a session is referenced in the store, so GC never collects it under a
live session; closing every session that logged it releases it (real Ray, real SQLite store)."""

from __future__ import annotations

import time

from fleet.errors import NotFound
from workers.fleet import KernelFleet


def test_sessions_reference_their_tool_results_until_closed(kfleet: KernelFleet, tenant: str) -> None:
    store = kfleet.store
    ref = store.put(b'{"weather": "sunny, 21C"}', tenant)
    kept = store.put(b"an unrelated blob nobody references", tenant)
    kfleet.create_session(tenant, "a", "You are agent zero.")
    kfleet.add_tool_result(tenant, "a", ref)
    assert store.stat(ref, tenant).refs == 1
    kfleet.fork(tenant, "a", "b")                                  # the branch logs it too
    assert store.stat(ref, tenant).refs == 2
    later = time.time() + 10 * 365 * 86400                          # every lease has long run out
    assert store.gc(now=later) == 1                                # control: the unreferenced blob goes
    try:
        store.stat(kept, tenant)
        raise AssertionError("the unreferenced blob survived GC")
    except NotFound:
        pass
    assert store.get(ref, tenant).startswith(b'{"weather"')         # the referenced one stays
    kfleet.close(tenant, "a")
    assert store.stat(ref, tenant).refs == 1 and store.gc(now=later) == 0
    kfleet.close(tenant, "b")
    assert store.stat(ref, tenant).refs == 0 and store.gc(now=later) == 1
