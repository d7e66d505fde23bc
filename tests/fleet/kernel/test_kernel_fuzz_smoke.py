"""scripts/fuzz_kernel.py, the seeded differential checker of the exactness contract, runs short on both backends
and flags nothing, so the script cannot rot unnoticed; its own docstring says what it checks. Control: a kernel whose
evictions all claim `exact=True` (a reposition on a deep model included, which leaves survivors that attended to
the span) is flagged, so a passing run is not one that checks nothing."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from fleet.core.kernel.session import Session

ROOT = Path(__file__).resolve().parents[3]


def _fuzzer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fuzz_kernel", ROOT / "scripts" / "fuzz_kernel.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # (its dataclasses look their module up)
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_short_fuzz_run_flags_nothing(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip(backend)
    rc = _fuzzer().main(["--seed", "5", "--ops", "80", "--context-ops", "60", "--backend", backend])
    out = capsys.readouterr().out
    assert rc == 0 and "FINDING" not in out, out[-3000:]


def test_a_kernel_that_overclaims_exactness_is_flagged(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    evict = Session.evict
    monkeypatch.setattr(Session, "evict", lambda self, *a, **kw: dataclasses.replace(evict(self, *a, **kw), exact=True))
    rc = _fuzzer().main(["--seed", "5", "--ops", "80", "--context-ops", "0", "--config", "mqa-3layer"])
    assert rc == 1 and "FINDING" in capsys.readouterr().out
