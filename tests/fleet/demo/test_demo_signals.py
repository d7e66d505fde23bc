"""`kvfleet demo` stopped by SIGTERM or SIGINT mid-run leaves nothing behind: no temporary directory, no
process (its local Ray's agents and workers, a vllm-router child).

A real `kvfleet demo` process (3 agents x 8 turns, its own TMPDIR, so its temporary directory and Ray's are
its own) is signalled once its session fleet runs; every process it started carries an environment marker
(found in /proc/PID/environ, so a re-parented one is found too). NOTE: before, a SIGTERM ended it at once
(exit 143) and left its kvfleet-demo-* directory (the SQLite store, its WAL, tokens.json) and four Ray
processes (DashboardAgent, RuntimeEnvAgent, two workers), the last gone 64 s later; SIGTERMed during the
vllm-router replay, the vllm-router child ran on for good.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fleet.app.demo.peers import vllm_router_binary

ROOT = Path(__file__).resolve().parents[3]
SURVIVAL_S = 5.0  # what may outlive the demo's exit, at most (Ray's watchdog: its grace plus a tick)
START_S = 240.0  # a local Ray and the session fleet on a loaded 2-core machine


Seen = dict[tuple[int, int], str]  # (pid, start time) -> command line


def _started(pid: int) -> int | None:
    """The process's start time (clock ticks after boot; a reused pid has another), None when it is gone or a
    zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _marked(mark: str) -> Seen:
    """Live processes whose environment carries KVF_TEST_MARK=mark."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if f"KVF_TEST_MARK={mark}".encode() not in Path(f"/proc/{d}/environ").read_bytes():
                continue
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if (started := _started(int(d))) is not None:
            out[int(d), started] = cmd
    return out


def _router_child(parent: int) -> Seen:
    """`parent`'s vllm-router child (found by its parent: it renames itself, and its environment may go with it)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):
                continue
            if int(stat[1]) == parent and "vllm" in cmd and (started := _started(int(d))) is not None:
                out[int(d), started] = cmd
    return out


def _alive(seen: Seen, mark: str) -> Seen:
    """Of `seen`, those still running (the same pid and start time), and any process marked `mark` now.
    NOTE: vllm-router renames itself (setproctitle), which can overwrite its environment: it is followed by pid."""
    return {**{k: c for k, c in seen.items() if _started(k[0]) == k[1]}, **_marked(mark)}


def _until(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + START_S
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {what} (exit {proc.poll()}): {out.read_text()[-2000:]}")
        time.sleep(0.1)


def _stop_demo(sig: signal.Signals, peers: bool, tmp_path: Path) -> tuple[int, list[str], Seen, Seen]:
    """Run a short demo, send `sig` once its session fleet runs (with `peers`: once vllm-router runs); its exit
    status, what is left in its TMPDIR, the processes it had then and those left SURVIVAL_S after it exited."""
    tmp = Path(tempfile.mkdtemp(prefix="kvf-d-"))  # short: Ray's socket paths must fit 107 bytes
    mark = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(tmp), KVF_TEST_MARK=mark, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for k in [k for k in env if k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_CLIENT", "RAY_TMPDIR"))]:
        del env[k]  # the test run's own Ray: never join it
    cmd = [sys.executable, "-m", "fleet.app.cli.main", "demo", "--agents", "3", "--turns", "8", "--workers", "3",
           "--quiet", "--json", *([] if peers else ["--no-peers"])]
    out = tmp_path / "out.txt"
    with out.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    running: Seen = {}
    try:
        if peers:  # at once: its replay of this short trace takes about a second
            _until("vllm-router", lambda: bool(_router_child(proc.pid)), proc, out)
        else:
            _until("session fleet", lambda: any("KernelHost" in c for c in _marked(mark).values()), proc, out)
            time.sleep(1.0)  # mid-run
        running = {**_marked(mark), **_router_child(proc.pid)}
        proc.send_signal(sig)
        rc = proc.wait(120)
        deadline = time.monotonic() + SURVIVAL_S
        while (left := _alive(running, mark)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return rc, sorted(p.name for p in tmp.iterdir() if p.name != "ray"), running, left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid, _ in _alive(running, mark):  # never leave them to the rest of the run
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_a_signalled_demo_leaves_no_directory_and_no_process(tmp_path: Path) -> None:
    """SIGTERM and SIGINT, each to a demo of its own, run at the same time (two demos: the suite's time)."""
    sigs = (signal.SIGTERM, signal.SIGINT)
    for sig in sigs:
        (tmp_path / sig.name).mkdir()
    with ThreadPoolExecutor(len(sigs)) as pool:
        runs = dict(zip(sigs, pool.map(lambda sig: _stop_demo(sig, peers=False, tmp_path=tmp_path / sig.name), sigs),
                        strict=True))
    for sig, (rc, files, running, left) in runs.items():
        print(f"{sig.name}: exit {rc}; {len(running)} processes while running; left: {left}; TMPDIR: {files}")
        assert any("raylet" in c for c in running.values()), running  # a local Ray ran (the check is not vacuous)
        assert left == {}
        assert files == []  # kvfleet-demo-*: the store, its WAL and tokens.json
        assert rc == 128 + sig  # stopped by the signal, cleanly (not -15: killed by it; not -11: a segfault)


@pytest.mark.slow
@pytest.mark.skipif(vllm_router_binary() is None, reason="vllm-router is not installed (./dev.sh bench fleet_routing)")
def test_a_demo_signalled_during_the_vllm_router_replay_stops_vllm_router(tmp_path: Path) -> None:
    rc, files, running, left = _stop_demo(signal.SIGTERM, peers=True, tmp_path=tmp_path)
    print(f"exit {rc}; running: {sorted(c[:40] for c in running.values())}; left: {left}; TMPDIR: {files}")
    assert any("vllm" in c for c in running.values())  # it ran when the signal came (not vacuous)
    assert left == {}
    assert rc == 128 + signal.SIGTERM and files == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_to_die_with_its_parent_dies_with_a_sigkilled_parent(tmp_path: Path) -> None:
    """dies_with_parent() covers what no finally block can: the demo SIGKILLed (the parent here is not a group
    leader, so no process group reaches the child either). The control, without it, outlives its parent."""
    pids = {}
    for armed in (True, False):
        script = ("import subprocess, sys, time\nfrom fleet.app.children import dies_with_parent\n"
                  f"c = subprocess.Popen(['sleep', '300'], preexec_fn=dies_with_parent() if {armed} else None)\n"
                  "print(c.pid, flush=True)\ntime.sleep(300)\n")
        parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                                  stdout=subprocess.PIPE, text=True)
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        pids[armed] = child
    try:
        time.sleep(0.5)
        alive = {armed: _started(pid) is not None for armed, pid in pids.items()}
        assert alive == {True: False, False: True}
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
