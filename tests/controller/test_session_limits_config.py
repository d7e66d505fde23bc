"""The per-tenant session limits reach the controller: flags, `kvfleet up`, and Helm values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.main import config_from, main, parse_args
from controller.quotas import SessionLimits, session_limits_from
from fleet.core.errors import InvalidArgument

CHART = Path(__file__).resolve().parents[2] / "helm" / "kvfleet"
FLAGS = ["--max-sessions-per-tenant", "8", "--max-kv-bytes-per-tenant", "1000000",
         "--session-idle-ttl", "90", "--session-concurrency-per-tenant", "2", "--max-history-tokens-per-tenant", "5000"]
WANT = SessionLimits(max_sessions_per_tenant=8, max_kv_bytes_per_tenant=1000000, idle_ttl_s=90.0, tenant_concurrency=2,
                     max_history_tokens_per_tenant=5000)


def test_flags_make_the_session_limits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleet.app.cli.up import parse as parse_up

    assert config_from(parse_args([], {}), {}).sessions == SessionLimits()
    assert config_from(parse_args(FLAGS, {}), {}).sessions == WANT
    assert session_limits_from(parse_up(FLAGS)) == WANT
    for flag, bad in (("--max-sessions-per-tenant", "-1"), ("--session-idle-ttl", "-5"),
                      ("--session-idle-ttl", "nan"), ("--session-idle-ttl", "inf"),
                      ("--session-concurrency-per-tenant", "0"), ("--max-history-tokens-per-tenant", "-1")):
        assert main([flag, bad, "--store", f"sqlite:///{tmp_path}/x.db", "--metrics-port", "-1"], {}) == 2
        assert flag in capsys.readouterr().err
    assert not (tmp_path / "x.db").exists()                         # refused before anything started
    with pytest.raises(InvalidArgument, match="--max-kv-bytes-per-tenant"):
        SessionLimits(max_kv_bytes_per_tenant=-1)


def _controller_args(values: dict[str, Any]) -> list[str]:
    helm = pytest.importorskip("helm_python")
    import yaml

    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name="demo", namespace="kvfleet")
    dep = next(d for p, t in out.items() if "controller-deployment" in p for d in yaml.safe_load_all(t) if d)
    return list(dep["spec"]["template"]["spec"]["containers"][0]["args"])


def test_helm_session_values_become_flags_the_controller_parses() -> None:
    names = {"--max-sessions-per-tenant", "--max-kv-bytes-per-tenant", "--session-idle-ttl",
             "--session-concurrency-per-tenant", "--max-history-tokens-per-tenant"}
    assert not names & set(_controller_args({}))                    # null values: the controller's defaults
    sessions = {"maxPerTenant": 8, "maxKvBytesPerTenant": 1000000, "idleTtlSeconds": 90,
                "concurrencyPerTenant": 2, "maxHistoryTokensPerTenant": 5000}
    args = _controller_args({"controller": {"sessions": sessions}})
    assert config_from(parse_args(args[1:], {}), {}).sessions == WANT
    big = _controller_args({"controller": {"sessions": {"maxKvBytesPerTenant": 17179869184}}})
    assert big[big.index("--max-kv-bytes-per-tenant") + 1] == "17179869184"   # not 1.7179869184e+10


def test_helm_schema_refuses_bad_session_values() -> None:
    import jsonschema

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["controller"]["properties"]["sessions"]
    jsonschema.validate({"maxPerTenant": 0, "idleTtlSeconds": 0, "maxKvBytesPerTenant": None}, schema)  # control
    for bad in ({"maxPerTenant": -1}, {"concurrencyPerTenant": 0}, {"idleTtlSeconds": -1}, {"maxPerTenant": 1.5},
                {"maxSessions": 3}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
