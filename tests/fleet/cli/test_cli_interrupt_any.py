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


def test_ctrl_c_while_a_commands_modules_load_is_one_line_and_130(tmp_path: Path) -> None:
    """The command's module is imported before it runs; a Ctrl-C there was outside the CLI's handler (a traceback)."""
    (tmp_path / "slow_command.py").write_text(
        "import sys, time\nprint('loading', flush=True)\ntime.sleep(60)\ndef main(argv):\n    return 0\n"
    )
    run = (
        "import sys; from fleet.app.cli import main as m; m.COMMANDS['slow'] = ('slow_command:main', '');"
        f" sys.path.insert(0, {str(tmp_path)!r}); sys.exit(m.main(['slow']))"
    )
    proc = subprocess.Popen([sys.executable, "-c", run], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "loading\n"  # inside the module's import
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert err.strip().splitlines() == ["kvfleet slow: interrupted"] and proc.returncode == 130, err[-2000:]
