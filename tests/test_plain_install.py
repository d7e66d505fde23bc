"""A plain install (no extras) runs everything: no module of the runtime package imports torch, transformers or
peft when it is imported, and the detector's default is what is installed. scripts/plain_install_check.sh
(run by `./dev.sh test`) proves the whole of it in a venv without those packages; these are the cheap parts
that run in any venv."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fleet.core.quarantine import detector_config
from fleet.core.quarantine.detector_config import (
    DEFAULT_LAYERS,
    LAYERS,
    DetectorConfig,
    default_layers,
    layers_report,
    parse_detector,
)

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft")
# modules that exist to use torch (loaded only when asked for: `--kernel-backend torch`, the HF witness)
TORCH_ONLY = {"fleet.core.kernel.ops_torch"}

WALK = """
import importlib, json, pkgutil, sys
heavy, skip, pkgs = sys.argv[1].split(","), set(sys.argv[2].split(",")), sys.argv[3].split(",")
out = {}
for pkg in pkgs:
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        if info.name in skip:
            continue
        importlib.import_module(info.name)
        loaded = [h for h in heavy if h in sys.modules]
        if loaded:
            out[info.name] = loaded
            break
print(json.dumps({"first_heavy_import": out, "modules": len([m for m in sys.modules if m.split(".")[0] in
      ("fleet", "controller", "workers")])}))
"""


def _walk(skip: set[str], pkgs: str = "fleet,controller,workers") -> dict:
    out = subprocess.run([sys.executable, "-c", WALK, ",".join(HEAVY), ",".join(sorted(skip)) or "-", pkgs],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_runtime_module_imports_torch_transformers_or_peft_at_import() -> None:
    """Every module of fleet, controller and workers is imported (as the CLI, the controller and the demo would
    import them); none of them loads torch, transformers or peft. Control: the torch backend does."""
    got = _walk(TORCH_ONLY)
    print(got)
    assert got["first_heavy_import"] == {} and got["modules"] > 100
    control = _walk(set(), "fleet.core.kernel")  # the same walk over the kernel, its torch backend included
    assert control["first_heavy_import"] == {"fleet.core.kernel.ops_torch": ["torch"]}


def test_peft_is_no_runtime_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = project["dependencies"] + [r for k, v in project["optional-dependencies"].items() if k != "dev" for r in v]
    assert not [r for r in runtime if r.lower().startswith("peft")]
    sources = [p for d in ("fleet", "controller", "workers") for p in (ROOT / d).rglob("*.py")]
    assert not [p for p in sources if "import peft" in p.read_text() or "from peft" in p.read_text()]
    assert any("from transformers" in p.read_text() for p in sources)  # control: the scan sees imports


def test_default_layers_are_those_installed_and_the_start_line_names_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the encoder's packages the default drops it (a plain install starts) and the controller's start
    line names the command that adds it; with them, the default is DEFAULT_LAYERS. Named layers are checked
    by parse_layers (tests/controller/servicers/test_quarantine_service.py)."""
    monkeypatch.setattr(detector_config, "missing_modules", lambda: ["torch", "transformers"])
    plain = default_layers()
    assert "encoder" not in plain and set(plain) == set(DEFAULT_LAYERS) - {"encoder"}
    assert DetectorConfig().layers == plain
    line = layers_report(plain, named=False)
    print(line)
    assert line.startswith(f"detector layers: {','.join(plain)} (default)")
    assert "not installed: encoder (pip install 'kvfleet[encoder]' adds it)" in line
    for spec in ("encoder", "rules,encoder:0.9"):  # named (--detector-layers, a tenant's spec): an error with the fix
        with pytest.raises(ValueError, match=r"needs torch, transformers \(pip install 'kvfleet\[encoder\]'\)"):
            parse_detector(spec)
    monkeypatch.setattr(detector_config, "missing_modules", lambda: [])  # control: everything installed
    assert default_layers() == tuple(n for n in LAYERS if n in DEFAULT_LAYERS) and DetectorConfig().layers == default_layers()
    line = layers_report(("rules",), named=True)
    print(line)
    assert "not installed" not in line and "(--detector-layers)" in line
    assert line.endswith(f"installed, not enabled: {','.join(n for n in LAYERS if n != 'rules')} "
                         f"(--detector-layers {','.join(LAYERS)})")
