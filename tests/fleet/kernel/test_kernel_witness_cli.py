"""`kvfleet witness`: the live witnesses hold and print with their controls."""

from __future__ import annotations

import json
import sys

import pytest

from fleet.app.cli.witness import main


@pytest.mark.parametrize("threads", [1, 2])
def test_witness_json_all_hold(capsys: pytest.CaptureFixture[str], threads: int) -> None:
    assert main(["--json", "--no-hf", "--threads", str(threads)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["env"]["backend"] == "numpy" and out["env"]["threads"] == threads
    rows = {r["name"]: r for r in out["witnesses"]}
    exact = [r for r in rows.values() if r["claim"] == "== 0"]
    # every zero has a coarse control and a 1-ulp control that its comparison resolves
    assert len(exact) >= 8 and all(
        r["value"] == 0.0 and r["control"] > 0 and r["ulp_control"] > 0 for r in exact
    )
    assert {"holds"} == {r["status"] for r in out["witnesses"]}
    assert any(n.startswith("decode") for n in rows) and "reposition vs never-saw (1 layer)" in rows
    assert "report.exact=True" in rows["reposition vs never-saw (1 layer)"]["note"]
    deep = next(r for r in rows.values() if r["name"].startswith("reposition divergence"))
    assert deep["value"] > 0 and "exact=False" in deep["note"]
    for r in out["witnesses"]:
        print(
            f"[witness t={threads}] {r['name']}: {r['value']:.3e} control={r['control']} ulp={r['ulp_control']}"
        )


def test_witness_table_and_bad_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-hf", "--backend", "torch"]) == 0
    assert "evict-vs-never" in capsys.readouterr().out
    assert main(["--device", "cuda:0"]) == 2  # numpy runs on cpu only: a clear error, exit 2
    assert "cpu only" in capsys.readouterr().err


def test_hf_witness_without_transformers_is_not_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers missing: the HF row says "not run", is not ok, and the CLI says what to install."""
    from fleet.core.kernel.hf_check import hf_parity

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    (row,) = hf_parity()
    assert (row.ran, row.ok, row.status) == (False, False, "not run") and "kvfleet[hf]" in row.note
    assert main(["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    hf = [r for r in out["witnesses"] if r["name"].startswith("HF parity")]
    assert not out["ok"] and [r["status"] for r in hf] == ["not run"]
    assert all(r["status"] == "holds" for r in out["witnesses"] if not r["name"].startswith("HF"))
