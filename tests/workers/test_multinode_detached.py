"""A detached fleet (the controller's on a cluster): its kernel host outlives the driver, and a host
that dies takes its sessions with it. Ray restarts it empty; the listing says `lost` (not a stale
`active`), `reconcile()` rebuilds every lost session from its op log at once (no call needed), each
bit-identical to what it was, and an idle (released) session stays idle."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from support.workers import SPEC

from workers.fleet import KernelFleet


@pytest.mark.slow
def test_a_restarted_host_loses_its_sessions_and_reconcile_rebuilds_them(ray_cluster: None, tmp_path: Path,
                                                                         tenant: str) -> None:
    f = KernelFleet(f"sqlite:///{tmp_path / 'detached.db'}", SPEC, detached=True, call_timeout_s=120.0)
    try:
        sids = ["s1", "s2", "s3"]
        for sid in sids:
            f.create_session(tenant, sid, "You are a detached agent.")
            f.append(tenant, sid, f"Keep {sid} in mind.")
        f.release_session(tenant, "s3")                          # idle: its kernel dropped, its log kept
        digests = {sid: f.digest(tenant, sid) for sid in sids[:2]}
        [stats] = f.node_stats()
        assert stats["sessions"] == 2
        os.kill(stats["pid"], signal.SIGKILL)                    # the host process dies; Ray restarts it empty
        deadline, after = time.monotonic() + 60, stats
        while after["pid"] == stats["pid"] and time.monotonic() < deadline:
            time.sleep(0.2)
            rows = f.node_stats()  # a node whose host is restarting may be left out for a while
            after = rows[0] if rows else after
        assert after["pid"] != stats["pid"] and after["sessions"] == 0
        states = {r["session"]: r["state"] for r in f.list_sessions(tenant=tenant)}
        assert states == {"s1": "lost", "s2": "lost", "s3": "idle"}
        assert f.reconcile() == 2 and f.num_regenerations == 2   # the idle one is not rebuilt
        rows = {r["session"]: r for r in f.list_sessions(tenant=tenant)}
        assert {s: rows[s]["state"] for s in sids} == {"s1": "regenerated", "s2": "regenerated", "s3": "idle"}
        assert all(rows[s]["epoch"] == 1 and rows[s]["pid"] == after["pid"] for s in sids[:2])
        assert {sid: f.digest(tenant, sid) for sid in sids[:2]} == digests
        assert f.num_regenerations == 2                          # the digests were answered, not rebuilt again
        assert f.reconcile() == 0                                # nothing left to rebuild (control)
    finally:
        f.shutdown()
