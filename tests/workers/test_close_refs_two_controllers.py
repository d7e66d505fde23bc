"""Two controllers closing one session at once (a leader change: the old leader's close still running, the client's
retry on the new one) give its blob references back once (real Ray, two fleets on one real SQLite store)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from support.workers import SPEC

from workers.fleet import KernelFleet

LATER = 10 * 365 * 86400.0  # every lease has long run out


def _deletes_after_both_read(store: Any, both: threading.Barrier) -> None:
    """The store's op log deletes wait until the other controller's close has read the log too (the overlap)."""
    delete = store.oplog_delete

    def late(*args: Any) -> Any:
        both.wait(timeout=60)
        return delete(*args)

    store.oplog_delete = late


def test_two_controllers_closing_one_session_give_its_references_back_once(
        kfleet: KernelFleet, tmp_path: Path, tenant: str) -> None:
    # before: both closes read the child's log, both deleted it and both gave back its references: the blob the
    # parent still logged stood at 0 references, and GC collected it under the parent
    other = KernelFleet(kfleet.store_url, SPEC, call_timeout_s=120.0)   # the other controller: the same hosts
    try:
        store = kfleet.store
        ref = store.put(b'{"weather": "sunny, 21C"}', tenant)
        kfleet.create_session(tenant, "a", "You are agent zero.")
        kfleet.add_tool_result(tenant, "a", ref)
        kfleet.fork(tenant, "a", "b")
        assert store.stat(ref, tenant).refs == 2
        both = threading.Barrier(2)
        for f in (kfleet, other):
            _deletes_after_both_read(f.store, both)
        errors: list[BaseException] = []

        def close(f: KernelFleet) -> None:
            try:
                f.close(tenant, "b")
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=close, args=(f,)) for f in (kfleet, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        for f in (kfleet, other):
            del f.store.oplog_delete                                 # the store's own again
        assert store.stat(ref, tenant).refs == 1                     # before: 0
        assert store.gc(now=time.time() + LATER) == 0                # before: 1 (collected under the parent)
        kfleet.release_session(tenant, "a")
        assert len(kfleet.pieces(tenant, "a")) == 2                  # rebuilt from its log (before: NotFound)
    finally:
        other.release()
