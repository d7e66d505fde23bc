"""`kvfleet up` as a real process (its own local Ray and embedded store), for the CLI tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

UP = [sys.executable, "-m", "fleet.app.cli.main", "up"]


def start_up(state_dir: Path, *extra: str, stderr: Path | None = None) -> tuple[subprocess.Popen[str], dict[str, object]]:
    """`kvfleet up --json` on port 0 with a 2-CPU local Ray; returns the process and its JSON line (the first line
    of stdout). `extra`: more flags (--sim-workers 1, --tenant acme, ...); `stderr`: a file for its stderr (to read
    while it runs; default: a pipe)."""
    cmd = [*UP, "--listen", "127.0.0.1:0", "--state-dir", str(state_dir), "--num-cpus", "2", *extra, "--json"]
    with open(stderr, "w") if stderr else contextlib.nullcontext(subprocess.PIPE) as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "RAY_ADDRESS": ""})
    deadline = time.monotonic() + 240
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("{"):
            return proc, json.loads(line)
        if proc.poll() is not None:
            break
    proc.kill()
    said = proc.stderr.read() if proc.stderr else stderr.read_text() if stderr else ""
    pytest.fail(f"kvfleet up did not come up: rc={proc.poll()} stderr={said}")


def stop_up(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    """Ctrl-C it; its exit code and the rest of its stdout and stderr."""
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, out, err
