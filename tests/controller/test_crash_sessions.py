"""Crashes, not graceful stops, for sessions: SIGKILL the `kvfleet controller` process (and the
local Ray it started) in the middle of appends; a new controller on the same Redis must read
every acknowledged write, and regenerate each session bit-identically from its op-log (issue #13,
crash tests).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from support.short_dirs import short_tmpdir

from fleet.core.errors import KvfleetError
from fleet.sdk import NO_RETRY, FleetClient

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are a careful agent."


class Controller:
    """`kvfleet controller` processes on one store, each with its own local Ray under `tmp`."""

    def __init__(self, store: str) -> None:
        self.store = store
        self.tmp = ""  # the Ray dir of the current start
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self) -> None:
        # a fresh Ray directory per start: a restarted controller must start a new Ray, never find the
        # killed one's address file in the old directory and wait on its dead GCS
        self.tmp = short_tmpdir("kvf-c-")
        # NOTE: on a loaded machine Ray's GCS can take longer than Ray's default 30 s to bind its port
        env = dict(os.environ, RAY_TMPDIR=self.tmp, PYTHONUNBUFFERED="1", RAY_gcs_server_port_wait_time_s="120")
        # NOTE: the test run's own ray.init() exported RAY_ADDRESS and its auth settings
        # (RAY_AUTH_MODE, ...); inherited, they make this controller join or authenticate against the
        # run's cluster instead of starting its own, and its calls hang
        for k in [k for k in env if k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_CLIENT"))]:
            del env[k]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.app.cli.main", "controller", "--listen", "127.0.0.1:0", "--store", self.store,
             "--metrics-port", "-1"], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            if "kvfleet controller listening on" in line:
                self.address = line.split("listening on ")[1].split(" ")[0]
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # keep the pipe drained
                return
        raise AssertionError("the controller did not start: " + "".join(seen))

    def kill_hosts(self) -> int:
        """SIGKILL every KernelHost process under this controller (its Ray's workers); how many."""
        assert self.proc is not None
        n = 0
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "KernelHost" in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGKILL)
                    n += 1
            except psutil.Error:
                pass
        return n

    def sigkill(self) -> None:
        """SIGKILL the controller, then every process it left under its Ray directory (by pid)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        for p in psutil.process_iter(["pid", "cmdline"]):
            if self.tmp in " ".join(p.info["cmdline"] or ()):
                try:
                    p.kill()
                except psutil.Error:
                    pass


@pytest.fixture
def controller(redis_url: str) -> Iterator[Controller]:
    c = Controller(redis_url)
    yield c
    if c.proc is not None and c.proc.poll() is None:
        c.sigkill()


# NOTE: this test used to hang 1 run in 3 in the full suite: the restarted controller's first session call
# starts a local Ray from inside the running gRPC server, and gRPC's fork handlers crashed the forked child
# before it could exec Ray's GCS server, so ray.init waited out its 30 s start. fleet/__init__.py turns
# those handlers off (GRPC_ENABLE_FORK_SUPPORT=false); no retry or xfail hides a slow first call any more.
@pytest.mark.slow
def test_sigkill_mid_appends_keeps_every_acknowledged_write(controller: Controller) -> None:
    controller.start()
    texts = [f"turn {i}: look up order {1000 + i}" for i in range(40)]
    acked: list[int] = []  # num_tokens after each acknowledged append, in order
    failed: list[str] = []
    with FleetClient(controller.address, retry=NO_RETRY, timeout=180) as c:
        if not c.sessions(fleet=False):
            c.create_session("s1", SYSTEM)
        c.append("s1", texts[0])
        acked.append(c.get_session("s1").row.num_tokens)

        def writer() -> None:
            for t in texts[1:]:
                try:
                    acked.append(c.append("s1", t).num_tokens)
                except KvfleetError as e:  # the controller died: this append was not acknowledged
                    failed.append(type(e).__name__)
                    return

        w = threading.Thread(target=writer)
        w.start()
        deadline = time.monotonic() + 120
        while len(acked) < 4 and time.monotonic() < deadline and w.is_alive():
            time.sleep(0.01)
        controller.sigkill()
        w.join(60)
    assert len(acked) >= 4 and failed, (acked, failed)  # killed mid-traffic, not after it
    controller.start()
    with FleetClient(controller.address, retry=NO_RETRY, timeout=180) as c:
        st = c.get_session("s1", include_tokens=True)  # regenerated on a new Ray
        n_applied = len(acked) + (1 if st.row.num_tokens > acked[-1] else 0)  # the one in flight may be logged
        print(f"acknowledged {len(acked)} appends ({acked[-1]} tokens); after the crash {st.row.num_tokens} tokens")
        assert st.row.num_tokens >= acked[-1]  # every acknowledged append is there
        # bit-identical: the same ops applied to a fresh session give the same digest and tokens
        c.create_session("ref", SYSTEM)
        for t in texts[:n_applied]:
            c.append("ref", t)
        ref = c.get_session("ref", include_tokens=True)
        assert (st.digest, st.token_ids) == (ref.digest, ref.token_ids)
        # and the session goes on
        assert c.append("s1", "after the crash").num_tokens > st.row.num_tokens
        # SIGKILL the kernel host's process: the next call regenerates its sessions from their op logs
        before = c.get_session("s1", include_tokens=True)
        killed = controller.kill_hosts()
        assert killed == 1, killed  # s1 and ref live in the one host process of the controller's Ray
        after = c.get_session("s1", include_tokens=True)
        assert (after.digest, after.token_ids) == (before.digest, before.token_ids)
        c.append("ref", "after the crash")
        assert c.get_session("ref").digest == after.digest
