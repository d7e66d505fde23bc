"""Sessions per node: kernel hosts against one process per session, side by side (`python bench/fleet_density.py`).

Each design runs in a fresh child process with its own local Ray of 2 CPUs (as `kvfleet up` on this
machine) and the controller's default kernel (the demo's synthetic model, numpy, block 16), SQLite
store; sessions are created one after another by one driver thread (as an SDK user would), then each
gets one append:

    hosts    this tree: one kernel host per node holds every session (workers/host.py)
    actors   the tree before kernel hosts (`--baseline-rev`, a git worktree): one Ray actor per session;
             run with as many sessions as fit (`--baseline-sessions`, default 32: Ray reserves
             0.05 CPU per session actor, so 2 CPUs hold 40, and each costs ~100 MiB)

Memory is the whole node: the summed resident (RSS) and proportional (PSS: shared pages split between
the processes sharing them) memory of the driver and every process under it (Ray's GCS, raylet,
workers), before the first session and after the last append; KV is the sessions' own bytes.

Then a host is SIGKILLed mid-traffic (hosts only): 4 threads append to `--kill-sessions` sessions of
one fleet and, call for call, to a control fleet (another store, so another host) that is never
killed. After the kill every call still answers (each lost session is rebuilt from its op log on its
next call); `reconcile()` right after the kill rebuilds the rest, timed. Then every session's digest
and token count must equal its control's. Writes its section of docs/benchmarks.md (`bench:fleet-density`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"block_size": 16}
T = "bench"


def _pcts(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"p50_ms": statistics.median(xs) * 1e3, "p99_ms": xs[int(0.99 * (len(xs) - 1))] * 1e3}


def node_memory() -> dict[str, int]:
    """RSS and PSS summed over this process and every process under it (the local Ray's too)."""
    import psutil

    me = psutil.Process()
    rss = pss = 0
    procs = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            m = p.memory_full_info()
            rss, pss, procs = rss + m.rss, pss + m.pss, procs + 1
        except psutil.Error:
            pass
    return {"rss": rss, "pss": pss, "processes": procs}


def child_density(n: int) -> dict[str, Any]:
    """Create `n` sessions and append once to each, in a fresh local Ray of 2 CPUs; timings and memory."""
    import ray

    from workers.fleet import KernelFleet

    ray.init(num_cpus=2, namespace="kvfleet", include_dashboard=False, log_to_driver=False)
    tmp = tempfile.mkdtemp(prefix="kvf-density-")
    f = KernelFleet(f"sqlite:///{tmp}/d.db", SPEC, call_timeout_s=120.0)
    try:
        f.create_session(T, "warmup", "You are the warm-up agent.")  # the host (or first actor) starts
        f.close(T, "warmup")
        time.sleep(1.0)
        before = node_memory()
        creates, appends, errors = [], [], []
        for i in range(n):
            t0 = time.perf_counter()
            try:
                f.create_session(T, f"s{i}", f"You are agent {i} of the fleet; review pull request {i * 7}.")
                creates.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - counted: the design's limit
                errors.append(f"create s{i}: {type(e).__name__}: {str(e)[:160]}")
                break
        made = len(creates)
        for i in range(made):
            t0 = time.perf_counter()
            f.append(T, f"s{i}", f"Turn 1: look at file {i}.py and say what is wrong with it.")
            appends.append(time.perf_counter() - t0)
        time.sleep(1.0)
        after = node_memory()
        rows = f.list_sessions(tenant=T)
        kv = sum(int(r.get("bytes_alone", 0)) + int(r.get("bytes_shared", 0)) for r in rows)
        return {"sessions": made, "errors": errors, "create": _pcts(creates), "append": _pcts(appends),
                "before": before, "after": after, "kv_bytes": kv,
                "pids": len({r.get("pid") for r in rows if r.get("pid")})}
    finally:
        f.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def child_kill(n: int) -> dict[str, Any]:
    """A host SIGKILLed mid-traffic, against a control fleet that never loses its host."""
    import ray

    from workers.fleet import KernelFleet

    ray.init(num_cpus=2, namespace="kvfleet", include_dashboard=False, log_to_driver=False)
    tmp = tempfile.mkdtemp(prefix="kvf-kill-")
    f = KernelFleet(f"sqlite:///{tmp}/k.db", SPEC, call_timeout_s=120.0)
    ctl = KernelFleet(f"sqlite:///{tmp}/c.db", SPEC, call_timeout_s=120.0)
    try:
        sids = [f"s{i}" for i in range(n)]
        for sid in sids:
            for x in (f, ctl):
                x.create_session(T, sid, f"You are {sid}, a long-running agent.")
        [pid] = [s["pid"] for s in f.node_stats()]
        stop, acked, errors = threading.Event(), [0], []

        def traffic(k: int) -> None:
            i = k
            while not stop.is_set():
                sid, text = sids[i % n], f" observation {i}: the test suite passed."
                try:
                    r = f.append(T, sid, text, op_id=f"op-{i}")   # acknowledged: it must be readable after
                    ctl.append(T, sid, text, op_id=f"op-{i}")
                    acked[0] += 1
                    assert r.num_tokens > 0
                except Exception as e:  # noqa: BLE001 - a call that fails is what this checks for
                    errors.append(f"{type(e).__name__}: {str(e)[:160]}")
                i += 4

        threads = [threading.Thread(target=traffic, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        time.sleep(3.0)
        acked_at_kill = acked[0]
        os.kill(pid, signal.SIGKILL)
        t_kill = time.perf_counter()
        rebuilt = f.reconcile()          # the rest of the lost sessions, proactively, while traffic goes on
        reconcile_s = time.perf_counter() - t_kill
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(180)
        same = sum(f.digest(T, s) == ctl.digest(T, s) and f.tokens(T, s) == ctl.tokens(T, s) for s in sids)
        control = f.digest(T, sids[0]) != ctl.digest(T, sids[1])   # not vacuous: different sessions differ
        return {"sessions": n, "acked": acked[0], "acked_before_kill": acked_at_kill, "errors": errors,
                "rebuilt_by_reconcile": rebuilt, "regenerations": f.num_regenerations, "reconcile_s": reconcile_s,
                "bit_identical": same, "control_differs": control}
    finally:
        f.shutdown()
        ctl.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def run_child(root: Path, mode: str, n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvf-density-out-") as d:
        out = Path(d) / "result.json"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}, "PYTHONPATH": str(root)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--root", str(root), "--n", str(n),
               "--out", str(out)]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not out.exists() or not out.read_text():
            raise RuntimeError(f"{mode} child in {root} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return dict(json.loads(out.read_text()))


def baseline_rev() -> str:
    """The last commit with one Ray actor per session (workers/session_actor.py still in its tree)."""
    gone = subprocess.run(["git", "log", "-n1", "--format=%H", "--no-renames", "--diff-filter=D", "--",
                           "workers/session_actor.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    parent = subprocess.run(["git", "rev-parse", "--short", gone.stdout.strip() + "^"], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    return parent.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--baseline-sessions", type=int, default=32)
    ap.add_argument("--kill-sessions", type=int, default=200)
    ap.add_argument("--baseline-rev", default="", help="git revision of the per-session-actor design "
                    "(default: the parent of the commit that removed workers/session_actor.py)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--root", default="", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, args.root)
        result = child_density(args.n) if args.child == "density" else child_kill(args.n)
        Path(args.out).write_text(json.dumps(result))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    from benchdoc import write_section
    from worktree import worktree

    rev = args.baseline_rev or baseline_rev()
    with worktree(rev) as wt:
        res = {"actors": run_child(wt, "density", args.baseline_sessions),
               f"hosts ({args.baseline_sessions})": run_child(ROOT, "density", args.baseline_sessions),
               "hosts": run_child(ROOT, "density", args.sessions)}
    kill = run_child(ROOT, "kill", args.kill_sessions)
    body = report(res, kill, rev)
    print(body)
    print(json.dumps({"density": res, "kill": kill}, indent=1))
    write_section("fleet-density", body)
    return 0


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def report(res: dict[str, dict[str, Any]], kill: dict[str, Any], rev: str) -> str:
    rows = []
    for name, r in res.items():
        added = r["after"]["pss"] - r["before"]["pss"]
        n = max(r["sessions"], 1)
        rows.append(f"| {name} | {r['sessions']:,} | {r['create']['p50_ms']:.1f} / {r['create']['p99_ms']:.1f} | "
                    f"{r['append']['p50_ms']:.1f} / {r['append']['p99_ms']:.1f} | {r['after']['processes']} | "
                    f"{_mib(r['after']['rss'])} / {_mib(r['after']['pss'])} | {_mib(added / n * 2**10)} KiB | "
                    f"{_mib(r['kv_bytes'])} |")
    hosts, actors, same_n = res["hosts"], res["actors"], res[f"hosts ({res['actors']['sessions']})"]
    budget = 2 * 2**30 + hosts["kv_bytes"]
    ratios = (f"At the same {actors['sessions']} sessions, hosts against actors: create p50 "
              f"{actors['create']['p50_ms'] / same_n['create']['p50_ms']:.0f}x faster, append p50 "
              f"{actors['append']['p50_ms'] / same_n['append']['p50_ms']:.1f}x faster, node PSS "
              f"{actors['after']['pss'] / same_n['after']['pss']:.1f}x smaller.")
    return f"""
## Sessions per node: kernel hosts (`python bench/fleet_density.py`)

One run on this 2-core machine (shared with other jobs, so compare the rows, not absolute figures).
Each row is a fresh child process with its own local Ray of 2 CPUs, the controller's default kernel
(the demo's synthetic model, numpy, block 16) and a SQLite store; sessions are created one after
another by one driver thread, then appended to once each. `actors` is the design before kernel hosts
(`{rev}`: one Ray actor per session), run with as many sessions as its CPU reservations allow; the
`hosts` rows are this tree. Node memory is summed over the driver and every process under it (Ray's
GCS and raylet, the workers); PSS splits shared pages between the processes sharing them.

| design | sessions | create ms p50 / p99 | append ms p50 / p99 | processes | node MiB RSS / PSS | PSS added per session | sessions' KV MiB |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Target (issue #29): 1,000 sessions, create p50 ≤ 50 ms, append p50 no worse than the actor design,
node memory ≤ 2 GiB + the sessions' KV ({_mib(budget)} MiB here). {ratios} At 1,000: measured {hosts['create']['p50_ms']:.1f} ms,
{hosts['append']['p50_ms']:.1f} ms against {res['actors']['append']['p50_ms']:.1f} ms, and {_mib(hosts['after']['pss'])} MiB PSS
({_mib(hosts['after']['rss'])} MiB RSS).

**A host SIGKILLed mid-traffic.** {kill['sessions']} sessions on one host, 4 threads appending to them and,
call for call, to a control fleet whose host is never killed. The host was killed after
{kill['acked_before_kill']:,} acknowledged appends; `reconcile()` rebuilt {kill['rebuilt_by_reconcile']} sessions
from their op logs in {kill['reconcile_s']:.2f} s ({kill['regenerations']} rebuilds in all, counting calls that
arrived first), while traffic went on; {len(kill['errors'])} calls failed. After {kill['acked']:,} acknowledged
appends, {kill['bit_identical']} of {kill['sessions']} sessions have the control's exact digest and tokens
(control: two different sessions' digests differ: {kill['control_differs']}).
"""


if __name__ == "__main__":
    sys.exit(main())
