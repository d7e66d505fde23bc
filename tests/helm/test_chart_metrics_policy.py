"""The controller's and the proxy's /metrics ports admit only the Prometheus scrapers (networkPolicy.metricsFrom);
their gRPC and HTTP ports stay open to every pod. The rendered policies are evaluated for who may reach which
port (support.netpol), not just looked at.

NOTE: before, no NetworkPolicy selected the controller's or the proxy's pods, so any pod of any namespace could
read their /metrics (every worker's name, every tenant's request counts, no token needed).
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from support.netpol import Pod, admits
from test_chart import KUBE_VERSION, NAMESPACE, RELEASE, _docs, container, one

PROM = Pod({"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus"}, "monitoring",
           {"kubernetes.io/metadata.name": "monitoring"})
STRANGER = Pod({"app": "something-else"}, NAMESPACE, {"kubernetes.io/metadata.name": NAMESPACE})
ELSEWHERE = Pod({"app": "tenant-app"}, "acme", {"kubernetes.io/metadata.name": "acme"})


def _render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return _docs(chart.render(values or {}, name=RELEASE, namespace=NAMESPACE))


def _pod(objs: list[dict[str, Any]], kind: str, suffix: str) -> Pod:
    tpl = one(objs, kind, suffix)["spec"]["template"]
    ports = {p["name"]: p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
    return Pod(dict(tpl["metadata"]["labels"]), NAMESPACE, {"kubernetes.io/metadata.name": NAMESPACE}, ports)


def _policies(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


def test_only_prometheus_reaches_the_metrics_ports_and_every_pod_the_api_ports(chart: Any) -> None:
    objs = _render(chart, {"watcher": {"create": True, "vllmWorkers": [
        {"name": "w0", "url": "http://vllm-0:8000", "kvEvents": "tcp://vllm-0:5557", "model": "m"}]}})
    pols = _policies(objs)
    for p in pols:
        assert kubernetes_validate.validate(p, KUBE_VERSION, strict=True)
    ctl, proxy = _pod(objs, "Deployment", "-controller"), _pod(objs, "Deployment", "-proxy")
    job = _pod(objs, "Job", "register-workers")
    for target, api in ((ctl, "grpc"), (proxy, "http")):
        metrics = target.ports["metrics"]
        assert admits(pols, target, PROM, metrics)
        for other in (STRANGER, ELSEWHERE, ctl, proxy, job):
            assert not admits(pols, target, other, metrics), (target.labels, other.labels)
            assert admits(pols, target, other, target.ports[api]), (target.labels, other.labels)
        assert not admits(pols, target, STRANGER, 12345)  # nor any port the pod does not serve
    # control: with networkPolicy off, the metrics ports are open again (the evaluation is not vacuous)
    off = _policies(_render(chart, {"networkPolicy": {"enabled": False}}))
    assert off == [] and admits(off, ctl, STRANGER, 9400) and admits(off, proxy, STRANGER, 9401)


def test_metrics_from_is_configurable_and_follows_the_ports(chart: Any) -> None:
    vmagent = Pod({"app": "vmagent"}, "monitoring", {"kubernetes.io/metadata.name": "monitoring"})
    objs = _render(chart, {
        "controller": {"metricsPort": 9500}, "proxy": {"metricsPort": 9501},
        "networkPolicy": {"enabled": True, "metricsFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
             "podSelector": {"matchLabels": {"app": "vmagent"}}}]}})
    pols = _policies(objs)
    ctl, proxy = _pod(objs, "Deployment", "-controller"), _pod(objs, "Deployment", "-proxy")
    for target, port in ((ctl, 9500), (proxy, 9501)):
        assert admits(pols, target, vmagent, port)
        assert not admits(pols, target, PROM, port)  # the default's scraper is no longer admitted
        assert not admits(pols, target, Pod({"app": "vmagent"}, "acme", {"kubernetes.io/metadata.name": "acme"}), port)
    none = _render(chart, {"networkPolicy": {"enabled": True, "metricsFrom": []}})
    pols = _policies(none)
    ctl, proxy = _pod(none, "Deployment", "-controller"), _pod(none, "Deployment", "-proxy")
    assert not admits(pols, ctl, PROM, 9400) and not admits(pols, proxy, PROM, 9401)
    assert admits(pols, ctl, STRANGER, 50051) and admits(pols, proxy, STRANGER, 8080)


def test_a_component_not_created_gets_no_policy(chart: Any) -> None:
    objs = _render(chart, {"proxy": {"create": False}})
    names = {p["metadata"]["name"] for p in _policies(objs)}
    assert f"{RELEASE}-kvfleet-controller" in names and f"{RELEASE}-kvfleet-proxy" not in names
    assert container(one(objs, "Deployment", "-controller"))["ports"][1]["name"] == "metrics"


@pytest.mark.parametrize("bad", [[{"pods": {}}], [{}], "prometheus", [{"podSelector": "app=prometheus"}]])
def test_schema_refuses_a_bad_metrics_peer(chart: Any, bad: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"networkPolicy": {"enabled": True, "metricsFrom": bad}})
    assert "/networkPolicy/metricsFrom" in str(e.value)
