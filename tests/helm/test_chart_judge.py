"""controller.judge.* (the quarantine detector's judge lanes) reach the controller's --judge-* flags, which its
parser takes; unset, the controller's defaults stand; a bad value fails the schema."""

from __future__ import annotations

from typing import Any

import pytest
from test_chart import NAMESPACE, RELEASE, _docs, container, one

from controller.judge_lanes import JudgeLimits
from controller.main import config_from, parse_args


def _args(chart: Any, values: dict[str, Any]) -> list[str]:
    objs = _docs(chart.render(values, name=RELEASE, namespace=NAMESPACE))
    return list(container(one(objs, "Deployment", "-controller"))["args"])


def test_judge_values_reach_the_controller_flags(chart: Any) -> None:
    args = _args(chart, {"controller": {"judge": {"threads": 3, "inflightPerTenant": 2, "cpuPerTenant": 0}}})
    flag = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--judge-")}
    assert flag == {"--judge-threads": "3", "--judge-inflight-per-tenant": "2", "--judge-cpu-per-tenant": "0"}
    assert config_from(parse_args(args[1:], {}), {}).judge == JudgeLimits(
        threads=3, tenant_inflight=2, tenant_cpu=0
    )
    assert not any(a.startswith("--judge-") for a in _args(chart, {}))  # control: unset, no flag
    with pytest.raises(Exception, match="threads|minimum"):
        _args(chart, {"controller": {"judge": {"threads": 0}}})
