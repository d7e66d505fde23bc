"""Ctrl-C in a command that has no Ctrl-C handling of its own (`kvfleet witness`, or any command while its modules
load) ends it with one line and exit 130, as a shell reports a command SIGINT ended. Before, `kvfleet witness`
interrupted printed Python's whole KeyboardInterrupt traceback, deep in torch or transformers (found by review)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def _loaded(pid: int, name: str) -> bool:
    """Whether process `pid` has mapped a shared object whose path holds `name`."""
    try:
        return name in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_during_the_witness_is_one_line_and_130() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "fleet.app.cli.main", "witness"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _loaded(proc.pid, "_multiarray_umath") and time.monotonic() < deadline:  # the kernel is loading
            time.sleep(0.05)
        assert proc.poll() is None, "the witness ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    print(f"rc {proc.returncode}, stderr {err[-2000:]!r}")
    assert "Traceback" not in err and proc.returncode == 130  # before: the traceback, and rc -2
    assert err.strip().splitlines() == ["kvfleet witness: interrupted"]
