"""The layer diagram holds: import-linter's contracts ([tool.importlinter] in pyproject.toml) are all kept.

Invariant: no module imports a module of a higher layer (docs/architecture.md, "Layers"), and the pure
core imports no I/O stack. The control tests copy the three packages into a temporary directory, add one
upward import at a time, and check that the contract meant to catch it reports it broken, so the check
cannot pass vacuously (e.g. by analysing nothing).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fleet", "workers", "controller")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the tree under root (its pyproject.toml), in a fresh interpreter."""
    code = (
        "import sys\n"
        "from importlinter.cli import lint_imports\n"
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))\n"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "COLUMNS": "240"})


def test_layer_contracts_are_kept() -> None:
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout, out.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three packages and pyproject.toml, copied (sources only)."""
    root = tmp_path_factory.mktemp("layers")
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


# (module that gains the import, the upward import, the contract that must catch it)
LAYERS = "layers: applications and test support > controller"
UPWARD = [
    ("fleet/core/context.py", "import controller.router", LAYERS),
    ("fleet/core/radix/__init__.py", "import fleet.cas", LAYERS),
    ("fleet/cas/base.py", "import fleet.sdk", LAYERS),
    ("fleet/sdk/types.py", "import workers.spec", LAYERS),
    ("workers/spec.py", "import controller.router", LAYERS),
    ("controller/router.py", "import fleet.app.testkit.sim_vllm.wire", LAYERS),
    ("controller/server.py", "import fleet.app.demo.workload", LAYERS),
    ("fleet/core/working_set.py", "import redis", "the pure core imports no I/O stack"),
]


@pytest.mark.parametrize(("module", "statement", "contract"), UPWARD, ids=[u[0] for u in UPWARD])
def test_control_an_upward_import_breaks_its_contract(tree_copy: Path, module: str, statement: str,
                                                       contract: str) -> None:
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + f"\n{statement}  # deliberate upward import\n")
    try:
        out = lint_imports(tree_copy)
    finally:
        path.write_text(original)
    assert out.returncode != 0, out.stdout
    broken = [line for line in out.stdout.splitlines() if line.endswith(" BROKEN")]
    assert any(line.startswith(contract) for line in broken), out.stdout


def test_control_the_unchanged_copy_is_kept(tree_copy: Path) -> None:
    # The copy passes before any edit, so each control above fails only because of its one import.
    out = lint_imports(tree_copy)
    assert out.returncode == 0, out.stdout + out.stderr


def test_control_an_unplaced_fleet_module_is_refused(tree_copy: Path) -> None:
    path = tree_copy / "fleet" / "newcomer.py"
    path.write_text('"""A module nobody placed in a layer."""\n')
    try:
        out = lint_imports(tree_copy)
    finally:
        path.unlink()
    assert out.returncode != 0, out.stdout
    assert "fleet.newcomer" in out.stdout + out.stderr, out.stdout + out.stderr
