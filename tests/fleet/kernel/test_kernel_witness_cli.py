"""`kvfleet witness`: the live witnesses hold and print with their controls."""

from __future__ import annotations

import json

import pytest

from fleet.cli.witness import main


def test_witness_json_all_hold(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--no-hf"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["env"]["backend"] == "numpy" and out["env"]["threads"] == 1
    rows = {r["name"]: r for r in out["witnesses"]}
    exact = [r for r in rows.values() if r["claim"] == "== 0"]
    assert len(exact) >= 6 and all(r["value"] == 0.0 and r["control"] > 0 for r in exact)
    deep = next(r for r in rows.values() if r["name"].startswith("reposition divergence"))
    assert deep["value"] > 0 and "exact=False" in deep["note"]
    for r in out["witnesses"]:
        print(f"[witness] {r['name']}: {r['value']:.3e} control={r['control']}")


def test_witness_table_and_bad_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--no-hf", "--backend", "torch"]) == 0
    assert "evict-vs-never" in capsys.readouterr().out
    assert main(["--device", "cuda:0"]) == 2  # numpy runs on cpu only: a clear error, exit 2
    assert "cpu only" in capsys.readouterr().err
