"""GPU check of the kernel fleet's node groups: a CUDA group really runs on the GPU (a short script).

    python bench/gpu_fleet_check.py              # a machine with a CUDA device
    python bench/gpu_fleet_check.py --dry-run    # no GPU: the same wiring with the group on torch/cpu

Starts a local Ray node labelled kvfleet.dev/group=gpu with the machine's GPUs, runs a fleet whose
spec is numpy by default and torch/CUDA on `gpu`, creates `--sessions` sessions (16), appends and
generates, and prints where each ran (backend, device, its kernel host's pid) and the torch/CUDA
session's logits against a numpy session's on the same tokens (bound 1e-4, docs/kernel.md).
Exits 0 when every session ran torch on `cuda` within the bound, in one kernel host process per GPU
(one CUDA context each, the weights once per GPU); 2 when there is no GPU (and no --dry-run). Takes well under a minute once Ray is up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="no GPU: map the group to torch/cpu")
    ap.add_argument("--sessions", type=int, default=16, help="sessions on the GPU node's one kernel host")
    a = ap.parse_args()
    import numpy as np
    import ray
    import torch

    from workers.fleet import KernelFleet
    from workers.placement import RAY_NAMESPACE
    from workers.spec import GROUP_LABEL, KernelSpec

    gpus = torch.cuda.device_count()
    if not gpus and not a.dry_run:
        print("gpu_fleet_check: torch sees no CUDA device; run it on a GPU machine (or --dry-run)", file=sys.stderr)
        return 2
    device = "cpu" if a.dry_run else "cuda"
    ray.init(address="local", num_cpus=4, num_gpus=0 if a.dry_run else gpus, labels={GROUP_LABEL: "gpu"},
             namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)
    spec = KernelSpec(block_size=16, groups=(("gpu", "torch", device),))
    with tempfile.TemporaryDirectory() as d:
        fleet = KernelFleet(f"sqlite:///{d}/gpu.db", spec, node_refresh_s=0.0)
        try:
            for i in range(max(2, a.sessions)):
                fleet.create_session("acme", f"g{i}", "You are a GPU-backed agent. Answer briefly.")
            r = fleet.append("acme", "g0", " What runs where?")
            fleet.generate("acme", "g1", 8)
            rows = fleet.list_sessions(fleet=True)
            tokens = fleet.tokens("acme", "g0")
            stats = fleet.node_stats()
        finally:
            fleet.shutdown()
    ref = KernelSpec(block_size=16).on_cpu()
    from workers.spec import make_kernel

    want = make_kernel(ref).session().append(tokens)
    delta = float(np.max(np.abs(np.asarray(r.logits, dtype=np.float64) - np.asarray(want, dtype=np.float64))))
    for row in rows:
        print(f"  {row['session']}: node {row['node'][:8]} backend={row.get('backend')} device={row.get('device')} "
              f"host pid={row.get('pid')} tokens={row.get('tokens')} state={row.get('state')}")
    for s in stats:
        print(f"  host {s['host']}: {s['sessions']} sessions, resident {s['resident_bytes'] / 2**20:.0f} MiB, "
              f"{s['session_bytes'] / 2**10:.0f} KiB per session")
    print(f"  torch/{device} vs numpy logits on {len(tokens)} tokens: max|Δ|={delta:.3e} (bound 1e-4)")
    ok = all((row.get("backend"), str(row.get("device", "")).split(":")[0]) == ("torch", device) for row in rows)
    ok = ok and delta <= 1e-4 and len({row.get("pid") for row in rows}) == (1 if a.dry_run else gpus)
    print(f"gpu_fleet_check: {'ok' if ok else 'FAILED'} ({'dry run, no GPU' if a.dry_run else f'{gpus} GPU(s)'})")
    ray.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
