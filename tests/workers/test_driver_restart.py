"""The process that drove the fleet dies (its supervisors and sessions with it); a new driver on the
same store lists every session and regenerates each one bit-identically on first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from support.workers import SPEC

from workers.fleet import KernelFleet

DRIVER = """
import json, sys, ray
from workers.fleet import KernelFleet
from workers.spec import KernelSpec
ray.init(address=sys.argv[1], namespace="kvfleet", log_to_driver=False)
f = KernelFleet(sys.argv[2], KernelSpec(block_size=16))
out = {}
for sid in ("s1", "s2"):
    f.create_session("acme", sid, "You are a careful agent.")
    f.append("acme", sid, f"task for {sid}")
    out[sid] = f.digest("acme", sid)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sessions_come_back_after_the_driver_dies(ray_cluster: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kv.db'}"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", DRIVER, ray.get_runtime_context().gcs_address, url],
                          capture_output=True, text=True, timeout=240, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = json.loads(proc.stdout.strip().splitlines()[-1])
    f = KernelFleet(url, SPEC)                                      # the "restarted controller"
    try:
        rows = f.list_sessions(fleet=True, tenant="acme")
        assert [(r["session"], r["state"]) for r in rows] == [("s1", "lost"), ("s2", "lost")]
        after = {sid: f.digest("acme", sid) for sid in ("s1", "s2")}
        print(f"driver restart: {f.num_regenerations} sessions regenerated; digests equal: {after == before}")
        assert after == before and f.num_regenerations == 2
        assert after["s1"] != after["s2"]                          # control: the digests do discriminate
        assert [r["state"] for r in f.list_sessions(tenant="acme")] == ["regenerated", "regenerated"]
    finally:
        f.shutdown()
