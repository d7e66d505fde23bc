"""`kvfleet up`'s output and its refusals, on a real `kvfleet up` process.

--json: stdout is the one JSON line and nothing else (before, Ray's worker-death lines, in colour, followed it on
stdout). A taken --listen port or an unreachable Redis is refused before Ray starts, leaving the state dir untouched
(before: after about 10 s of Ray, exit 2, with tokens.json and the SQLite store left in the state dir)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from support.kvfleet_up import UP, start_up, stop_up

DIED = "A worker died or was killed"


@pytest.mark.slow
def test_up_json_keeps_stdout_for_its_json_line(tmp_path: Path) -> None:
    log = tmp_path / "up.err"
    proc, info = start_up(tmp_path / "state", stderr=log)
    try:
        assert info["controller"] and info["operator_token"]
        # the fleet's kernel host (start_stack builds it), a Ray worker of up's own local Ray: killed, Ray's driver
        # prints the death
        [host] = [p for p in psutil.Process(proc.pid).children(recursive=True)
                  if p.cmdline()[:1] == ["ray::KernelHost"]]
        host.kill()
        deadline = time.monotonic() + 30
        while DIED not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        rc, rest, _ = stop_up(proc)
    err = log.read_text()
    print(f"stdout after the JSON line: {rest!r}\nstderr: {err[-600:]!r}")
    assert rest == ""  # before: "\x1b[33m(raylet)\x1b[0m A worker died or was killed ...", and "kvfleet up: stopping"
    assert DIED in err and "kvfleet up: stopping" in err  # the control: Ray did print it, and up its status
    assert rc == 0


def _refused(state: Path, *flags: str) -> tuple[int, str]:
    done = subprocess.run([*UP, "--state-dir", str(state), "--num-cpus", "2", *flags], capture_output=True,
                          text=True, timeout=240)
    return done.returncode, done.stderr


def test_a_taken_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, err = _refused(tmp_path / "state", "--listen", f"127.0.0.1:{port}")
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "--listen" in err, err
    assert "Ray" not in err  # before: Ray's start-up lines, then the refusal
    assert not (tmp_path / "state").exists()  # before: tokens.json, tokens.json.lock and kvfleet.db in it


def test_an_unreachable_redis_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, err = _refused(tmp_path / "state", "--listen", "127.0.0.1:0", "--store", f"redis://127.0.0.1:{port}/0")
    assert rc == 2 and f"--store: redis at 127.0.0.1:{port} unreachable" in err, err  # the flag named, as README.md says
    assert "Ray" not in err and not (tmp_path / "state").exists()  # before: both, after about 10 s


def test_the_checks_pass_a_free_port_and_a_live_redis(redis_url: str) -> None:
    # the controls: what the refusals above refuse is what they check, not every start
    from fleet.app.cli.up_checks import check_can_start, port_taken

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert port_taken(f"127.0.0.1:{port}") is not None  # bound (not even listening) is taken
    assert port_taken(f"127.0.0.1:{port}") is None and port_taken("127.0.0.1:0") is None
    check_can_start(f"127.0.0.1:{port}", redis_url)
    check_can_start("127.0.0.1:0", None)
