"""A Ray address where nothing answers fails at once, naming it (controller/ray_address.py).

NOTE: before, `kvfleet up --ray-address 127.0.0.1:1` hung in `ray.init` (Ctrl-C ignored), and each session
call of a controller started with it waited ~120 s, after which SIGTERM no longer ended the controller.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from controller.ray_address import check_reachable, gcs_host_port, unreachable
from controller.sessions import Sessions
from fleet.core.errors import InvalidArgument, Unavailable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_address_nothing_answers_names_the_flag() -> None:
    addr = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(InvalidArgument, match=rf"^--ray-address {addr}: no Ray head answers there \(connection refused\)"):
        check_reachable(addr)
    with socket.socket() as srv:  # control: something listening passes
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert unreachable(f"ray://127.0.0.1:{srv.getsockname()[1]}") is None
    assert [gcs_host_port(a) for a in ("auto", "", "[::1]:6379")] == [None, None, ("::1", 6379)]
    with pytest.raises(InvalidArgument, match="--ray-address"):
        gcs_host_port("10.0.0.2")


async def test_a_session_call_answers_unavailable_naming_the_ray_address() -> None:
    addr = f"127.0.0.1:{_closed_port()}"
    s = Sessions(SimpleNamespace(ray_address=addr))
    with pytest.raises(Unavailable, match=rf"Ray at {addr} \(--ray-address\) does not answer \(connection refused\)"):
        await asyncio.wait_for(s.get_fleet(), 20)
    assert s.fleet is None  # the next call tries again


STUCK_BUILD = """
import asyncio, threading, types
from controller.sessions import Sessions
s = Sessions(types.SimpleNamespace(ray_address=None))
s._build = lambda: threading.Event().wait(120)  # a ray.init that never returns
async def main():
    call = asyncio.ensure_future(s.get_fleet())
    await asyncio.sleep(0.2)
    call.cancel()  # the RPC is cancelled by the controller's stop
    s.close()
asyncio.run(main())
print("stopped", flush=True)
"""


def test_a_stuck_fleet_build_does_not_hold_the_exit() -> None:
    # before: the build ran on the admin pool, whose thread the interpreter joined at exit: a controller whose
    # first session call hung in ray.init never exited after SIGTERM
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-c", STUCK_BUILD], capture_output=True, text=True, timeout=30, env=env)
    assert (r.returncode, r.stdout.strip()) == (0, "stopped"), r.stderr


def test_up_with_a_ray_address_nothing_answers_exits_2_naming_it(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{_closed_port()}"
    cmd = [sys.executable, "-m", "fleet.app.cli.main", "up", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path),
           "--ray-address", addr]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "RAY_ADDRESS": ""})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == (f"kvfleet up: error: --ray-address {addr}: no Ray head answers there (connection "
                                "refused); give the address `ray start --head` printed, or leave the flag out for a local Ray")
