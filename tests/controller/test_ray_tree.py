"""A `kvfleet controller` that starts a local Ray owns its whole process tree (issue #31 item 4):
nothing of it survives the controller by more than a few seconds, on SIGTERM or SIGKILL.

A real controller process (auth off, its own Ray directory) creates a session, which starts its
local Ray; every process under it is recorded (pid and start time, so a reused pid is not taken
for a survivor); then the controller gets the signal. NOTE: before, Ray's DashboardAgent and
RuntimeEnvAgent outlived a SIGTERM by about a minute, and a SIGKILL left Ray's daemons running.

The four processes (a controller and a `kvfleet up` for each signal) are started at once, by one
module fixture, each in its own Ray directory: a local Ray's start is mostly waiting on its daemons,
so four in parallel take little longer than one. Each test still signals only its own process, once
every start has finished (no test's survivors are timed while other Rays are starting).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from support.short_dirs import short_tmpdir

ROOT = Path(__file__).resolve().parents[2]
SURVIVAL_S = 5.0  # "a few seconds"


def _controller(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    ray_dir = short_tmpdir("kvf-t-")
    env = dict(os.environ, RAY_TMPDIR=ray_dir, PYTHONUNBUFFERED="1", RAY_gcs_server_port_wait_time_s="120")
    for k in [k for k in env if k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_CLIENT"))]:
        del env[k]  # the test run's own Ray: never join it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fleet.app.cli.main",
            "controller",
            "--listen",
            "127.0.0.1:0",
            "--store",
            f"sqlite:///{tmp / 'kv.db'}",
            "--metrics-port",
            "-1",
        ],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "kvfleet controller listening on" in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, line.split("listening on ")[1].split(" ")[0]
    raise AssertionError("the controller did not start: " + "".join(seen))


def _up(tmp: Path) -> subprocess.Popen[str]:
    """`kvfleet up` (its local Ray starts before it announces itself), running once it has printed its JSON line."""
    ray_dir = short_tmpdir("kvf-u-")
    env = dict(os.environ, RAY_TMPDIR=ray_dir, PYTHONUNBUFFERED="1", RAY_gcs_server_port_wait_time_s="120")
    for k in [k for k in env if k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_CLIENT"))]:
        del env[k]
    proc = subprocess.Popen([sys.executable, "-m", "fleet.app.cli.main", "up", "--listen", "127.0.0.1:0", "--state-dir",
                             str(tmp / "state"), "--num-cpus", "1", "--json"],
                            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("{") and '"controller"' in line:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc
    raise AssertionError("kvfleet up did not start: " + "".join(seen))


def _tree(pid: int) -> dict[int, tuple[float, str]]:
    out = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            # the process name first: the command line's path is as long as the checkout's, so
            # a cut of it can lose the executable's name (it did in CI under a longer root)
            out[p.pid] = (p.create_time(), f"{p.name()}: {' '.join(p.cmdline())[-80:]}")
        except psutil.Error:
            pass
    return out


def _alive(tree: dict[int, tuple[float, str]]) -> dict[int, str]:
    out = {}
    for pid, (created, what) in tree.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                out[pid] = what
        except psutil.Error:
            pass
    return out


def _signal_and_wait(proc: subprocess.Popen[str], sig: signal.Signals, what: str,
                     start: Callable[[], None] = lambda: None) -> None:
    """`start()` (it starts the local Ray, if `proc` has not yet), record `proc`'s process tree, send `sig`,
    and assert that nothing of the tree is alive SURVIVAL_S later."""
    tree: dict[int, tuple[float, str]] = {}
    try:
        start()
        tree = _tree(proc.pid)
        names = " ".join(w for _, w in tree.values())
        assert "raylet" in names and "gcs_server" in names, names  # the tree is Ray's (not vacuous)
        proc.send_signal(sig)
        proc.wait(60)
        t0 = time.monotonic()
        left = _alive(tree)
        while left and time.monotonic() - t0 < SURVIVAL_S:
            time.sleep(0.1)
            left = _alive(tree)
        print(f"{what}: {len(tree)} processes; after {sig.name}, alive {SURVIVAL_S} s later: {left}")
        assert left == {}, f"{len(left)} of Ray's processes outlived {what} by {SURVIVAL_S} s: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid in _alive(tree):  # never leave them to the rest of the run
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _controller_with_ray(tmp: Path) -> subprocess.Popen[str]:
    """A controller whose local Ray runs: its first session starts it."""
    from fleet.sdk import FleetClient

    proc, address = _controller(tmp)
    try:
        with FleetClient(address) as c:
            c.create_session("s1", "You are a short-lived agent.")  # starts the local Ray
    except BaseException:
        _kill_tree(proc)
        raise
    return proc


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    """SIGKILL `proc` and every process under it (a start that failed, or one no test signalled)."""
    tree = _tree(proc.pid) if proc.poll() is None else {}
    proc.kill()
    proc.wait(30)
    for pid in _alive(tree):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


STARTS: dict[str, Callable[[Path], subprocess.Popen[str]]] = {"controller": _controller_with_ray, "up": _up}
KIND = {"test_nothing_of_a_local_ray_outlives_its_controller": "controller",
        "test_nothing_of_the_local_ray_outlives_kvfleet_up": "up"}


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str], Future[subprocess.Popen[str]]]]:
    """The process of every selected test of this module, (kind, signal name) -> its start, all started
    at once; returns when every start has ended (a failed start fails its own test, with its output)."""
    wanted = [(KIND[item.originalname], item.callspec.id) for item in request.session.items
              if item.module is request.module and item.originalname in KIND]
    with ThreadPoolExecutor(max(1, len(wanted))) as pool:
        starts = {key: pool.submit(STARTS[key[0]], tmp_path_factory.mktemp(f"{key[0]}-{key[1]}")) for key in wanted}
    yield starts
    for f in starts.values():  # never leave one to the rest of the run (its test did not run, or failed first)
        if f.exception() is None and f.result().poll() is None:
            _kill_tree(f.result())


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_nothing_of_a_local_ray_outlives_its_controller(
        started: dict[tuple[str, str], Future[subprocess.Popen[str]]], sig: signal.Signals) -> None:
    _signal_and_wait(started["controller", sig.name].result(), sig, "the controller")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_nothing_of_the_local_ray_outlives_kvfleet_up(
        started: dict[tuple[str, str], Future[subprocess.Popen[str]]], sig: signal.Signals) -> None:
    """The same for `kvfleet up`, which starts its local Ray at once. NOTE: before it owned its tree, a SIGKILL
    of `kvfleet up` left Ray's DashboardAgent and RuntimeEnvAgent running (the SIGTERM case passed)."""
    _signal_and_wait(started["up", sig.name].result(), sig, "kvfleet up")
