"""The pure core imports no ray, grpc, redis or zmq (DESIGN §2): checked in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest

CORE = ["fleet.kernel", "fleet.radix", "fleet.lifecycle", "fleet.working_set", "fleet.quarantine"]
FORBIDDEN = ("ray", "grpc", "redis", "zmq")


@pytest.mark.parametrize("module", CORE)
def test_pure_core_imports_no_io_stack(module: str) -> None:
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulled in {out.stdout.strip()}"


def test_control_detects_a_forbidden_import() -> None:
    # Non-vacuous control: the same probe flags a module that does import one of them.
    code = "import importlib, sys\nimportlib.import_module('fleet.redis_server'); import redis\n" \
           f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "redis" in out.stdout
