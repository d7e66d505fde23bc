"""`kvfleet up`'s output and its refusals, on a real `kvfleet up` process.

--json: stdout is the one JSON line and nothing else (before, Ray's worker-death lines, in colour, followed it on
stdout)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
from support.kvfleet_up import start_up, stop_up

DIED = "A worker died or was killed"


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
