"""The proxy pods stop gracefully: the shutdown delay and drain reach `kvfleet proxy`, whose own parser takes them,
and the pods' terminationGracePeriodSeconds covers both (before: 30 s, Kubernetes' default, with streams that may
run minutes, and no delay for the endpoint's removal to reach kube-proxy)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from test_chart import NAMESPACE, RELEASE, _docs, container, one

from controller.proxy.main import config_from, parse_args


def _proxy(chart: Any, values: dict[str, Any]) -> dict[str, Any]:
    return one(_docs(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "Deployment", "-proxy")


@pytest.mark.parametrize(("values", "delay", "drain", "grace"), [
    ({}, 5.0, 300.0, 315),  # the defaults: delay + drain + 10
    ({"proxy": {"shutdownDelaySeconds": 2.5, "shutdownDrainSeconds": 60.2}}, 2.5, 60.2, 73),
    ({"proxy": {"shutdownDrainSeconds": 0, "terminationGracePeriodSeconds": 5}}, 5.0, 0.0, 5),
    ({"proxy": {"terminationGracePeriodSeconds": 900}}, 5.0, 300.0, 900),
])
def test_shutdown_values_reach_the_proxy_and_the_grace_period_covers_them(
        chart: Any, values: dict[str, Any], delay: float, drain: float, grace: int) -> None:
    dep = _proxy(chart, values)
    cfg = config_from(parse_args(container(dep)["args"][1:], {}))
    assert (cfg.shutdown_delay_s, cfg.shutdown_drain_s) == (delay, drain)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace >= delay + drain


def test_a_grace_period_under_the_delay_and_drain_is_refused(chart: Any) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        chart.render({"proxy": {"terminationGracePeriodSeconds": 300}}, name=RELEASE, namespace=NAMESPACE)
    assert "proxy.terminationGracePeriodSeconds=300 is under proxy.shutdownDelaySeconds + proxy.shutdownDrainSeconds " \
           "(305)" in str(e.value)


@pytest.mark.parametrize(("values", "where"), [
    ({"proxy": {"shutdownDelaySeconds": -1}}, "/proxy/shutdownDelaySeconds"),
    ({"proxy": {"shutdownDrainSeconds": "5m"}}, "/proxy/shutdownDrainSeconds"),
    ({"proxy": {"terminationGracePeriodSeconds": 0}}, "/proxy/terminationGracePeriodSeconds"),
])
def test_schema_refuses_bad_shutdown_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert f"at '{where}'" in str(e.value)
