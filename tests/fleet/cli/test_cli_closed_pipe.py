"""`kvfleet ... | head`: a reader that stops early ends the command quietly (exit 1), never with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

CLI = [sys.executable, "-m", "fleet.app.cli.main"]
SIM = ["sim-vllm", "--port", "0", "--kv-events-port", "0", "--replay-port", "-1"]


def _into_a_closed_pipe(argv: list[str]) -> tuple[int, str]:
    # NOTE: the reader is gone before the command writes (its end is closed first), so every write fails: no race
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([*CLI, *argv], stdout=w, stderr=subprocess.PIPE, timeout=120, check=False)
    finally:
        os.close(w)
    print(argv, p.returncode, p.stderr.decode()[-300:])
    return p.returncode, p.stderr.decode()


def test_output_into_a_closed_pipe_ends_without_a_traceback() -> None:
    rc, err = _into_a_closed_pipe(SIM)  # its first line is its endpoints, flushed at once (`kvfleet sim-vllm | head -1`)
    assert "Traceback" not in err and "BrokenPipeError" not in err  # before: sim_vllm/main.py's print, a traceback
    assert rc == 1


def test_control_help_into_a_closed_pipe_and_an_open_one() -> None:
    # argparse's help ignores a failed write of its own; whether the closed pipe meets that write or the flush at the
    # end (then exit 1) depends on how stdout is buffered: either way quietly
    rc, err = _into_a_closed_pipe(["proxy", "--help"])
    assert rc in (0, 1) and err == ""
    p = subprocess.run([*CLI, "sim-vllm", "--help"], capture_output=True, timeout=120, check=False)
    assert p.returncode == 0 and b"--kv-events-port" in p.stdout and not p.stderr  # an open pipe gets all of it
