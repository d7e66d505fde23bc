"""A tenant within its quota can never make another tenant's create or call wait (issue #29): one
tenant at its session quota, flooding its sessions with appends, on a 1-CPU node
(tests/workers/host_isolation_scenario.py). NOTE: on the code before kernel hosts this failed: the
flooding tenant got 20 sessions (Ray held 0.05 CPU for each session actor) and the other tenant's
create raised Unavailable after the 20 s call timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.workers import run_scenario


@pytest.mark.slow
def test_a_tenant_at_its_quota_on_a_one_cpu_node_never_blocks_another(tmp_path: Path) -> None:
    r = run_scenario(Path(__file__).with_name("host_isolation_scenario.py"), tmp_path)
    print(json.dumps(r, indent=1))
    assert r["flood_created"] == 64 and r["flood_create_errors"] == []     # the whole quota fits on 1 CPU
    assert r["flood_appends"] > 0 and r["flood_append_errors"] == 0       # control: the flood really ran
    assert [q["ok"] for q in r["quiet"]] == [True] * 6, r["quiet"]        # quiet's create and 5 appends
    # NOTE: loose on purpose (a shared 2-core machine): before, quiet's create waited the whole call
    # timeout (20 s) and failed; now it waits at most for flood's jobs already running on a lane thread.
    assert max(q["s"] for q in r["quiet"]) < 5.0, r["quiet"]
