"""A tool result held by a session is referenced in the store, so GC never collects it under a
live session; closing every session that logged it releases it (real Ray, real SQLite store)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from fleet.cas import open_store
from fleet.core.errors import NotFound
from fleet.core.oplog import AppendOp, to_dict
from workers.fleet import KernelFleet
from workers.placement import delete_log
from workers.session_kernel import SessionKernel
from workers.spec import KernelSpec, make_kernel


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


def test_a_blob_collected_before_its_op_is_logged_leaves_nothing_logged(tmp_path: Path) -> None:
    """The leader's GC may collect a blob whose lease ran out right after a session actor read it.
    Its write-ahead step must then refuse the op whole: before, the op was logged first and the
    reference failed after, leaving a log entry that no regeneration could ever fetch."""
    url = f"sqlite:///{tmp_path / 'refs.db'}"
    with open_store(url, lease_s=0.0) as store:
        kernel = make_kernel(KernelSpec(block_size=16))
        actor = SessionKernel("acme", "s1", kernel, None, store, None)  # type: ignore[arg-type]  # its store step only
        ref = store.put(b"tool output read just before GC ran", "acme")
        assert store.gc() == 1                                     # the leader's GC, at that instant
        op = AppendOp(1, "tool_result", "acme", ref=ref, num_tokens=3)
        with pytest.raises(NotFound):
            actor._write(op)
        assert store.oplog_read("acme", "s1") == []                # nothing half-written
        kept = store.put(b"a live tool output", "acme")
        actor._write(dataclasses.replace(op, ref=kept))
        assert actor.last_op_index == 0                            # control: a present blob is logged
        assert store.stat(kept, "acme").refs == 1 and store.gc() == 0


def test_a_close_gives_back_every_other_reference_when_one_is_already_at_zero(tmp_path: Path) -> None:
    """A log whose first tool result's blob has no reference left (data from an older release, or an earlier
    failure): deleting the log still gives back the references of the rest. Before, FailedPrecondition on the first
    ended the loop after the log was gone: the second blob kept its reference for good and was never collected."""
    url = f"sqlite:///{tmp_path / 'refs.db'}"
    with open_store(url, lease_s=0.0) as store:
        a, b = store.put(b"first tool output", "acme"), store.put(b"second tool output", "acme")
        ops = [AppendOp(0, "tool_result", "acme", ref=a, num_tokens=3),
               AppendOp(1, "tool_result", "acme", ref=b, num_tokens=3)]
        for op in ops:
            store.oplog_append("acme", "s1", to_dict(op))
        store.add_ref(b, "acme")                                   # a's reference is already gone
        delete_log(store, "acme", "s1", ops)
        assert store.oplog_read("acme", "s1") == []
        assert store.stat(b, "acme").refs == 0                     # before: 1, for good
        assert store.gc() == 2                                     # both collected
