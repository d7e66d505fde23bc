"""A detached fleet (the controller's on a cluster): a supervisor that Ray restarts takes its
node's live session actors back (they are detached and survived it) instead of reporting them lost."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from support.workers import SPEC

from workers.fleet import KernelFleet


def test_a_restarted_supervisor_finds_its_detached_sessions_again(ray_cluster: None, tmp_path: Path,
                                                                   tenant: str) -> None:
    f = KernelFleet(f"sqlite:///{tmp_path / 'detached.db'}", SPEC, detached=True, call_timeout_s=120.0)
    try:
        f.create_session(tenant, "s1", "You are a detached agent.")
        f.append(tenant, "s1", "Keep this in mind.")
        before = f.info(tenant, "s1")
        [stats] = f.node_stats()
        os.kill(stats["pid"], signal.SIGKILL)                    # Ray restarts it (max_restarts=3)
        deadline, after = time.monotonic() + 60, stats
        while after["pid"] == stats["pid"] and time.monotonic() < deadline:
            time.sleep(0.2)
            rows = f.node_stats()  # a node whose supervisor is restarting may be left out for a while
            after = rows[0] if rows else after
        assert after["pid"] != stats["pid"] and after["sessions"] == 1
        [row] = f.list_sessions(tenant=tenant)
        assert (row["state"], row["pid"], row["tokens"]) == ("active", before["pid"], before["tokens"])
        assert f.append(tenant, "s1", " Go on.").num_tokens > before["tokens"] and f.num_regenerations == 0
    finally:
        f.shutdown()                                             # kills the detached session actor too
