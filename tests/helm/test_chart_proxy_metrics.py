"""The proxy pods serve /metrics on a port of their own (proxy.metricsPort, --metrics-listen), the Service names it
`metrics` and the ServiceMonitor scrapes it; the tenant-facing HTTP port answers /metrics 404.

NOTE: before, the chart ran the proxy with /metrics on its HTTP port (the one tenants reach) and the ServiceMonitor
scraped `http`: every tenant could read every worker's name and per-worker request counts with no token, while GET
/v1/workers refused tenants. The rendered args are parsed with the proxy's own parser.
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from test_chart import NAMESPACE, RELEASE, _docs, _matches, container, one

from controller.proxy.main import config_from, parse_args


def _render(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    return _docs(chart.render(values, name=RELEASE, namespace=NAMESPACE))


@pytest.mark.parametrize(("values", "port"), [({}, 9401), ({"proxy": {"metricsPort": 9500}}, 9500)])
def test_metrics_port_reaches_the_proxy_service_and_servicemonitor(chart: Any, values: dict[str, Any],
                                                                   port: int) -> None:
    objs = _render(chart, {**values, "serviceMonitor": {"enabled": True}})
    dep = one(objs, "Deployment", "-proxy")
    c = container(dep)
    cfg = config_from(parse_args(c["args"][1:], {}))
    assert (cfg.listen, cfg.metrics_listen) == ("0.0.0.0:8080", f"0.0.0.0:{port}")
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8080, "metrics": port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] == "http"  # /health and /ready stay on the HTTP port
    svc = one(objs, "Service", "-proxy")
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "http": (8080, "http"), "metrics": (port, "metrics")}
    sm = one(objs, "ServiceMonitor", "-proxy")
    assert _matches(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


def test_the_http_port_as_metrics_port_is_refused(chart: Any, chart_without_schema: Any) -> None:
    for ch in (chart, chart_without_schema):
        with pytest.raises(helm.HelmRenderError) as e:
            ch.render({"proxy": {"metricsPort": 8080}}, name=RELEASE, namespace=NAMESPACE)
        assert "proxy.metricsPort=8080 is proxy.port: give the proxy's /metrics a port of its own" in str(e.value)
    assert _render(chart, {"proxy": {"create": False, "metricsPort": 8080}})  # no proxy: nothing to refuse


@pytest.mark.parametrize("bad", [0, 70000, "9401"])
def test_schema_refuses_a_bad_metrics_port(chart: Any, bad: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"proxy": {"metricsPort": bad}})
    assert "at '/proxy/metricsPort'" in str(e.value)
