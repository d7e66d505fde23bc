"""The chart's Ray cluster is closed (issue #31 item 5): token authentication from a Secret on the
head, every worker group and the controller's Ray client; the dashboard on 127.0.0.1 unless a value
asks otherwise; NetworkPolicies that admit only the controller to the head's GCS and client ports and
only Ray's own pods to the Ray pods. Rendered with Helm, checked field by field; the policies are
evaluated for who may reach which port, not just looked at. NOTE: the RayCluster used to set no
RAY_AUTH_MODE, its dashboard listened on 0.0.0.0, and no policy covered the Ray pods.
"""

from __future__ import annotations

import base64
from typing import Any

import kubernetes_validate
from support.netpol import Pod, admits
from test_chart import KUBE_VERSION, NAMESPACE, RELEASE, _docs, container, one

RAY_PORTS = (6379, 10001)


def _objs(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return _docs(chart.render(values or {}, name=RELEASE, namespace=NAMESPACE))


def _ray_containers(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rc = one(objs, "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return [*head, *(c for g in rc["spec"]["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])]


def _auth(c: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    env = {e["name"]: e for e in c.get("env", [])}
    mode = env.get("RAY_AUTH_MODE", {}).get("value")
    ref = env.get("RAY_AUTH_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
    return mode, ref


def _admits(policies: list[dict[str, Any]], target: dict[str, str], peer: dict[str, str], port: int) -> bool:
    """Whether `peer` (pod labels, same namespace) may reach `target` on TCP `port` under these policies."""
    return admits(policies, Pod(target, NAMESPACE), Pod(peer, NAMESPACE), port)


def _pod_labels(obj: dict[str, Any], path: str = "template") -> dict[str, str]:
    return dict(obj["spec"][path]["metadata"]["labels"])


def test_every_ray_container_and_the_controller_use_the_token_from_one_secret(chart: Any) -> None:
    objs = _objs(chart)
    ray = _ray_containers(objs)
    ctl = container(one(objs, "Deployment", "-controller"))
    refs = set()
    for c in [*ray, ctl]:
        mode, ref = _auth(c)
        assert mode == "token" and ref is not None, c["name"]
        refs.add((ref["name"], ref["key"]))
    [(name, key)] = refs
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name)
    token = base64.b64decode(secret["data"][key]).decode()
    assert len(token) >= 32 and token.isalnum()
    assert kubernetes_validate.validate(secret, KUBE_VERSION, strict=True)
    # another render draws another token (it is random, not a constant of the chart)
    other = next(o for o in _objs(chart) if o["kind"] == "Secret" and o["metadata"]["name"] == name)
    assert other["data"][key] != secret["data"][key]


def test_an_existing_secret_is_used_and_none_is_made(chart: Any) -> None:
    objs = _objs(chart, {"workers": {"rayAuth": {"existingSecret": "my-ray-token", "secretKey": "t"}}})
    assert {tuple(_auth(c)[1].values()) for c in _ray_containers(objs)} == {("my-ray-token", "t")}  # type: ignore[union-attr]
    assert not [o for o in objs if o["kind"] == "Secret" and "ray-token" in o["metadata"]["name"]]
    off = _objs(chart, {"workers": {"rayAuth": {"enabled": False}}})  # control: switched off, no auth env
    assert {_auth(c) for c in _ray_containers(off)} == {(None, None)}
    assert _auth(container(one(off, "Deployment", "-controller"))) == (None, None)


def test_the_dashboard_is_on_loopback_unless_asked(chart: Any) -> None:
    params = one(_objs(chart), "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]
    assert params["dashboard-host"] == "127.0.0.1"
    asked = {"workers": {"head": {"rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"}}}}
    assert one(_objs(chart, asked), "RayCluster")["spec"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_only_the_controller_reaches_the_ray_heads_gcs_and_client_ports(chart: Any) -> None:
    objs = _objs(chart, {"watcher": {"create": True, "vllmWorkers": [
        {"name": "w0", "url": "http://vllm-0:8000", "kvEvents": "tcp://vllm-0:5557", "model": "m"}]}})
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    for p in policies:
        assert kubernetes_validate.validate(p, KUBE_VERSION, strict=True)
    rc = one(objs, "RayCluster")
    head = dict(rc["spec"]["headGroupSpec"]["template"]["metadata"]["labels"])
    worker = dict(rc["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"])
    controller = _pod_labels(one(objs, "Deployment", "-controller"))
    proxy = _pod_labels(one(objs, "Deployment", "-proxy"))
    job = one(objs, "Job")["spec"]["template"]["metadata"]["labels"]
    stranger = {"app": "something-else"}
    for port in RAY_PORTS:
        assert _admits(policies, head, controller, port)
        assert _admits(policies, head, worker, port)  # Ray's own nodes reach their GCS
        for other in (proxy, job, stranger):
            assert not _admits(policies, head, other, port), (other, port)
    assert not _admits(policies, head, controller, 8265)  # nor the dashboard, even to the controller
    for other in (controller, proxy, job, stranger):
        assert not _admits(policies, worker, other, 12345), other
    assert _admits(policies, worker, head, 12345) and _admits(policies, worker, worker, 12345)
    # control: with networkPolicy off, nothing is closed (the evaluation is not vacuous)
    open_ = [o for o in _objs(chart, {"networkPolicy": {"enabled": False}}) if o["kind"] == "NetworkPolicy"]
    assert _admits(open_, head, stranger, 10001)
