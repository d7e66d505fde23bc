"""One tenant at its session quota on a 1-CPU node must not make another tenant wait (issue #29).

    python tests/workers/host_isolation_scenario.py OUT.json

Its own local Ray with one CPU (as `kvfleet up --num-cpus 1`). Tenant `flood` creates the controller's
default quota of sessions (64, controller/quotas.py) and then keeps four threads appending to them;
meanwhile tenant `quiet` creates a session and appends to it. The result records whether each of
quiet's calls succeeded and how long it took, and how many of flood's creates and appends succeeded.
Before kernel hosts every session was a Ray actor reserving 0.05 CPU: a 1-CPU node held 20, so
flood's 21st create and quiet's create waited for a CPU until the call timeout. Run in its own
process: one Ray per process, and this one must have exactly one CPU.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import ray  # noqa: E402
from support.workers import scenario_result  # noqa: E402

from workers.fleet import KernelFleet  # noqa: E402
from workers.placement import RAY_NAMESPACE  # noqa: E402

QUOTA = 64  # the controller's default --max-sessions-per-tenant
CALL_TIMEOUT_S = 20.0


def _timed(fn: Any) -> tuple[bool, float, str]:
    t0 = time.perf_counter()
    try:
        fn()
        return True, time.perf_counter() - t0, ""
    except Exception as e:  # noqa: BLE001 - the failure is the result
        return False, time.perf_counter() - t0, f"{type(e).__name__}: {str(e)[:200]}"


def scenario(tmp: Path) -> dict[str, Any]:
    f = KernelFleet(f"sqlite:///{tmp / 'iso.db'}", {"block_size": 16}, call_timeout_s=CALL_TIMEOUT_S)
    try:
        created = [_timed(lambda i=i: f.create_session("flood", f"f{i}", f"You are flood agent {i}."))
                   for i in range(QUOTA)]
        ok = [i for i, (good, _, _) in enumerate(created) if good]
        stop, appends = threading.Event(), [0, 0]

        def flood(k: int) -> None:
            while not stop.is_set() and ok:
                sid = f"f{ok[(k + appends[0]) % len(ok)]}"
                good, _, _ = _timed(lambda sid=sid: f.append("flood", sid, " tool output line. " * 60))
                appends[0 if good else 1] += 1

        threads = [threading.Thread(target=flood, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # flood's appends are running
        quiet = [("create", *_timed(lambda: f.create_session("quiet", "q1", "You are a quiet agent.")))]
        for i in range(5):
            quiet.append(("append", *_timed(lambda i=i: f.append("quiet", "q1", f" turn {i}."))))
        stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT_S + 5)
        return {"flood_created": len(ok), "flood_create_errors": sorted({e for _, _, e in created if e}),
                "flood_appends": appends[0], "flood_append_errors": appends[1],
                "quiet": [{"call": c, "ok": good, "s": round(s, 4), "error": e} for c, good, s, e in quiet]}
    finally:
        f.shutdown()


def main(out: Path) -> None:
    ray.init(num_cpus=1, namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        scenario_result(out, scenario)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
