"""fleet/, controller/ and workers/ type-check under mypy --strict (CONTRIBUTING §9; config in pyproject)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_strict_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success" in out.stdout and "source files" in out.stdout  # it really checked files
