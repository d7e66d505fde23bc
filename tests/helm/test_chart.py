"""The Helm chart, rendered and linted with Helm's own engine (the helm-python-sdk wheel bundles it).

Every rendered object validates against Kubernetes' schemas (kubernetes-validate, strict: unknown
fields are errors) for a pinned Kubernetes version; the RayCluster validates against KubeRay's
published CRD schema (kept beside this file), made strict the way `kubectl apply` is; bad values are
refused by values.schema.json with a message that names the key.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"
CRD = Path(__file__).with_name("kuberay-v1.7.0-rayclusters-crd.yaml")
KUBE_VERSION = "1.32.0"  # pinned: kubernetes-validate bundles 1.25 .. 1.37
RELEASE, NAMESPACE = "demo", "kvfleet"
CRD_KINDS = {"RayCluster", "ServiceMonitor"}  # kubernetes-validate has no schema for these

CPU_GROUP = {"name": "cpu", "replicas": 2, "minReplicas": 1, "maxReplicas": 4, "gpus": 0}
GPU_GROUP = {"name": "gpu", "replicas": 1, "minReplicas": 0, "maxReplicas": 2, "gpus": 2,
             "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"cpu": "16", "memory": "64Gi"}},
             "nodeSelector": {"nvidia.com/gpu.present": "true"}}
VLLM = [{"name": "vllm-0", "url": "http://vllm-0.llm:8000", "kvEvents": "tcp://vllm-0.llm:5557",
         "replay": "tcp://vllm-0.llm:5558", "model": "Qwen/Qwen3-8B"}]

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {"redis": {"create": False, "external": {"url": "redis://redis.shared.svc:6380/2"}}},
    "gpu-workers": {"image": {"variant": "cuda"}, "workers": {"groups": [CPU_GROUP, GPU_GROUP]}},
    "tls": {"tls": {"enabled": True, "secretName": "kvfleet-tls"}, "proxy": {"create": False},
            "watcher": {"create": True, "vllmWorkers": VLLM}},
    "ha": {"controller": {"replicas": 3, "leaderElection": {"enabled": True}}},
    "gpu-kernels": {"image": {"variant": "cuda"},
                    "controller": {"gcIntervalSeconds": 60, "fleetMetricsIntervalSeconds": 30},
                    "workers": {"kernel": {"backend": "numpy"},
                                "groups": [CPU_GROUP, dict(GPU_GROUP, kernel={"backend": "torch", "device": "cuda"})]}},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
                   "watcher": {"create": True, "vllmWorkers": VLLM},
                   "auth": {"tokens": [{"name": "acme-ci", "tenant": "acme", "role": "tenant", "sha256": "ab" * 32}]}},
}


def _docs(manifests: dict[str, str]) -> list[dict[str, Any]]:
    out = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        out += [d for d in yaml.safe_load_all(text) if d]
    return out


@pytest.fixture(scope="module")
def rendered(chart: Any) -> dict[str, dict[str, str]]:
    """Each value set rendered once: {set name: {template path: manifest}}."""
    return {k: chart.render(v, name=RELEASE, namespace=NAMESPACE) for k, v in VALUE_SETS.items()}


def objects(rendered: dict[str, dict[str, str]], name: str) -> list[dict[str, Any]]:
    return _docs(rendered[name])


def one(objs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


# ---- Kubernetes schemas -------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_object_validates_against_kubernetes(rendered: dict[str, dict[str, str]], name: str) -> None:
    objs = objects(rendered, name)
    kinds = sorted(o["kind"] for o in objs)
    print(name, kinds)
    checked = 0
    for o in objs:
        if o["kind"] in CRD_KINDS:
            continue  # validated against their CRD schemas below
        assert kubernetes_validate.validate(o, KUBE_VERSION, strict=True) == "1.32", o["metadata"]["name"]
        checked += 1
    assert checked >= 7 and {"Deployment", "Service", "Secret"} <= set(kinds)


def test_kubernetes_validation_is_not_vacuous(rendered: dict[str, dict[str, str]]) -> None:
    """Control: the same validator refuses a corrupted Deployment and has no schema for RayCluster."""
    dep = copy.deepcopy(one(objects(rendered, "default"), "Deployment", "-controller"))
    container(dep)["readinessProbe"]["grpc"]["port"] = "grpc"  # grpc probes take a number
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSION, strict=True)
    dep = copy.deepcopy(one(objects(rendered, "default"), "Deployment", "-controller"))
    dep["spec"]["replica"] = 2  # unknown field: strict refuses it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSION, strict=True)
    rc = one(objects(rendered, "default"), "RayCluster")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(rc, KUBE_VERSION, strict=True)


def _strict(schema: Any) -> Any:
    """A CRD schema with unknown fields refused (as `kubectl apply`'s strict field validation does)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def raycluster_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "RayCluster"
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    assert v1["served"] and v1["storage"]
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("name", VALUE_SETS)
def test_raycluster_validates_against_kuberay_crd(rendered: dict[str, dict[str, str]], name: str,
                                                  raycluster_validator: jsonschema.Draft7Validator) -> None:
    rc = one(objects(rendered, name), "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in raycluster_validator.iter_errors(rc)]
    assert errors == []
    # The pod templates inside are Kubernetes PodTemplateSpecs: validate them with Kubernetes' schema too.
    specs = [rc["spec"]["headGroupSpec"]] + rc["spec"]["workerGroupSpecs"]
    for g in specs:
        tmpl = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": g["template"]}
        kubernetes_validate.validate(tmpl, KUBE_VERSION, strict=True)


def test_raycluster_validation_is_not_vacuous(rendered: dict[str, dict[str, str]],
                                              raycluster_validator: jsonschema.Draft7Validator) -> None:
    """Control: KubeRay's schema refuses a non-string rayStartParam, a missing groupName, an unknown field."""
    rc = one(objects(rendered, "default"), "RayCluster")
    bad = [copy.deepcopy(rc) for _ in range(3)]
    bad[0]["spec"]["workerGroupSpecs"][0]["rayStartParams"] = {"num-cpus": 4}
    del bad[1]["spec"]["workerGroupSpecs"][0]["groupName"]
    bad[2]["spec"]["headGroupSpec"]["replicas"] = 1
    for b in bad:
        errors = list(raycluster_validator.iter_errors(b))
        print([e.message for e in errors])
        assert errors


SERVICE_MONITOR_SCHEMA = {  # monitoring.coreos.com/v1, the fields the chart uses (prometheus-operator API)
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string"},
                    "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                 r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}}}}}},
    },
}


def test_service_monitor(rendered: dict[str, dict[str, str]]) -> None:
    assert not [o for o in objects(rendered, "default") if o["kind"] == "ServiceMonitor"]
    objs = objects(rendered, "monitoring")
    for comp, port in (("controller", "metrics"), ("proxy", "metrics")):  # the proxy's: tests/helm/test_chart_proxy_metrics.py
        sm = one(objs, "ServiceMonitor", f"-{comp}")
        jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)
        assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        (svc,) = [o for o in objs if o["kind"] == "Service"
                  and _matches(sm["spec"]["selector"]["matchLabels"], o["metadata"]["labels"])]
        assert svc["metadata"]["name"].endswith(f"-{comp}")
        assert sm["spec"]["endpoints"] == [{"port": port, "path": "/metrics", "interval": "30s"}]
        assert port in {p["name"] for p in svc["spec"]["ports"]}
    # Control: the schema refuses an endpoint with a bad interval.
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SERVICE_MONITOR_SCHEMA)


# ---- Helm lint ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", VALUE_SETS)
def test_strict_lint_has_no_errors(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


def test_lint_reports_bad_values() -> None:
    report = helm.lint(CHART, {"controller": {"replicas": 2}}, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert any("/controller/leaderElection/enabled" in e for e in report["errors"]), report


# ---- what the objects say -----------------------------------------------------------------------

def test_controller_runs_the_documented_command(rendered: dict[str, dict[str, str]]) -> None:
    c = container(one(objects(rendered, "default"), "Deployment", "-controller"))
    assert c["args"] == ["controller", "--listen", "0.0.0.0:50051", "--metrics-port", "9400",
                         "--store", "redis://demo-kvfleet-redis:6379/0",
                         "--tokens-file", "/etc/kvfleet/tokens/tokens.json",
                         "--ray-address", "ray://demo-kvfleet-workers-head-svc:10001"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": 50051}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50051, "metrics": 9400}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_fair_priority_reaches_the_proxy(chart: Any) -> None:
    c = container(one(_docs(chart.render({"proxy": {"fairPriority": True}}, name=RELEASE, namespace=NAMESPACE)),
                      "Deployment", "-proxy"))
    assert c["args"][-1] == "--fair-priority"


def test_routing_and_reset_drain_values_reach_the_controller(chart: Any) -> None:
    values = {"controller": {"routing": {"queueWeight": 0.25, "resetDrainTimeoutSeconds": 2.5}}}
    c = container(one(_docs(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "Deployment", "-controller"))
    args = c["args"]
    assert args[args.index("--reset-drain-timeout") + 1] == "2.5"
    assert args[args.index("--route-queue-weight") + 1] == "0.25"


def test_proxy_points_at_the_controller_and_probes_health(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered, "default")
    c = container(one(objs, "Deployment", "-proxy"))
    ctrl_svc = one(objs, "Service", "-controller")
    grpc_port = next(p["port"] for p in ctrl_svc["spec"]["ports"] if p["name"] == "grpc")
    assert c["args"] == ["proxy", "--controller", f"{ctrl_svc['metadata']['name']}:{grpc_port}", "--listen", "0.0.0.0:8080",
                         "--metrics-listen", "0.0.0.0:9401",
                         "--quarantine-policy", "placeholder", "--tool-media", "pass", "--client-header-timeout", "30",
                         "--client-body-timeout", "60", "--max-first-byte-wait", "600",
                         "--max-inflight-bytes-per-tenant", "67108864", "--max-inflight-bytes", "134217728",
                         "--shutdown-delay", "5", "--shutdown-drain", "300"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}  # 503 while it cannot see the fleet
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "proxy"


def test_redis_statefulset_has_aof_and_a_pvc(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered, "default")
    sts = one(objs, "StatefulSet", "-redis")
    args = container(sts)["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--dir") + 1] == "/data"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in container(sts)["volumeMounts"]
    svc = one(objs, "Service", "-redis")
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    assert ":" in container(sts)["image"] and not container(sts)["image"].endswith(":latest")


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _pod_labels(objs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Labels of every pod template the release creates (Deployments, StatefulSet, Job, Ray groups)."""
    pods = {}
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            pods[o["metadata"]["name"]] = o["spec"]["template"]["metadata"]["labels"]
        if o["kind"] == "RayCluster":
            pods["ray-head"] = o["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
            for g in o["spec"]["workerGroupSpecs"]:
                pods[f"ray-{g['groupName']}"] = g["template"]["metadata"]["labels"]
    return pods


@pytest.mark.parametrize("name", ["default", "monitoring"])
def test_network_policy_admits_only_kvfleet_pods_to_redis(rendered: dict[str, dict[str, str]], name: str) -> None:
    objs = objects(rendered, name)
    np_ = one(objs, "NetworkPolicy", "-redis")
    sts = one(objs, "StatefulSet", "-redis")
    assert _matches(np_["spec"]["podSelector"]["matchLabels"], sts["spec"]["template"]["metadata"]["labels"])
    assert np_["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np_["spec"]["ingress"]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector / ipBlock: this namespace's pods only
    pods = _pod_labels(objs)
    admitted = {p for p, labels in pods.items() if _matches(peer["podSelector"]["matchLabels"], labels)}
    print(name, "admitted:", sorted(admitted))
    assert admitted == set(pods) and len(pods) >= 5
    # Control: a pod of another release (same chart) is not admitted.
    other = dict(pods["ray-head"], **{"app.kubernetes.io/instance": "other"})
    assert not _matches(peer["podSelector"]["matchLabels"], other)
    # KubeRay labels Ray pods app.kubernetes.io/name=kuberay and may select on it: the chart leaves it alone,
    # and the policy does not need it.
    assert "app.kubernetes.io/name" not in pods["ray-head"] and "app.kubernetes.io/name" not in peer["podSelector"]["matchLabels"]
    assert _matches(peer["podSelector"]["matchLabels"], dict(pods["ray-cpu"], **{"app.kubernetes.io/name": "kuberay"}))


def test_auth_secret_holds_a_working_operator_token(rendered: dict[str, dict[str, str]]) -> None:
    from controller.auth import Role, TokenBook

    secret = one(objects(rendered, "default"), "Secret", "-auth")
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    token = data["operator-token"]
    doc = json.loads(data["tokens.json"])
    assert token.startswith("kvf_") and len(token) == 47
    assert doc["tokens"][0] == {"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": "ops",
                                "role": "operator", "name": "helm-bootstrap-operator"}
    assert [t["name"] for t in doc["tokens"]] == ["helm-bootstrap-operator", "helm-proxy-reader"]  # test_chart_edge
    assert token not in data["tokens.json"]  # only its digest
    # The controller's own TokenBook reads the file the chart writes.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokens.json"
        path.write_text(data["tokens.json"])
        book = TokenBook(path)
        ident = book.lookup(token)
        assert ident is not None and ident.role is Role.OPERATOR and ident.tenant == "ops"
        assert book.lookup(token[:-1] + ("A" if token[-1] != "A" else "B")) is None  # control
    # The controller mounts only tokens.json, never the plaintext operator token.
    ctrl = one(objects(rendered, "default"), "Deployment", "-controller")
    vol = next(v for v in ctrl["spec"]["template"]["spec"]["volumes"] if v["name"] == "tokens")
    assert vol["secret"] == {"secretName": secret["metadata"]["name"], "items": [{"key": "tokens.json", "path": "tokens.json"}]}


def test_extra_tokens_by_digest(rendered: dict[str, dict[str, str]]) -> None:
    secret = one(objects(rendered, "monitoring"), "Secret", "-auth")
    doc = json.loads(base64.b64decode(secret["data"]["tokens.json"]))
    assert [t["name"] for t in doc["tokens"]] == ["helm-bootstrap-operator", "helm-proxy-reader", "acme-ci"]
    assert doc["tokens"][2] == {"sha256": "ab" * 32, "tenant": "acme", "role": "tenant", "name": "acme-ci"}


def test_existing_secret_is_used_and_none_created(chart: Any) -> None:
    objs = _docs(chart.render({"auth": {"existingSecret": "my-tokens"}}, name=RELEASE, namespace=NAMESPACE))
    assert not [o for o in objs if o["kind"] == "Secret" and not o["metadata"]["name"].endswith("-ray-token")]
    ctrl = one(objs, "Deployment", "-controller")
    vol = next(v for v in ctrl["spec"]["template"]["spec"]["volumes"] if v["name"] == "tokens")
    assert vol["secret"]["secretName"] == "my-tokens"
    proxy_env = {e["name"]: e for e in container(one(objs, "Deployment", "-proxy"))["env"]}
    assert proxy_env["KVFLEET_PROXY_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-tokens", "key": "operator-token"}


def test_external_redis(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered, "external-redis")
    assert not [o for o in objs if o["kind"] == "StatefulSet" or o["metadata"]["name"].endswith("-redis")]
    ctrl = container(one(objs, "Deployment", "-controller"))
    assert "--store" not in ctrl["args"]  # read as KVFLEET_STORE from a Secret: tests/helm/test_chart_redis_secret.py
    (env,) = [e for e in ctrl["env"] if e["name"] == "KVFLEET_STORE"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "demo-kvfleet-redis-url", "key": "url"}
    secret = one(objs, "Secret", "-redis-url")
    assert base64.b64decode(secret["data"]["url"]).decode() == "redis://redis.shared.svc:6380/2"


def test_gpu_worker_group(rendered: dict[str, dict[str, str]]) -> None:
    rc = one(objects(rendered, "gpu-workers"), "RayCluster")
    cpu, gpu = rc["spec"]["workerGroupSpecs"]
    gc = gpu["template"]["spec"]["containers"][0]
    assert gpu["groupName"] == "gpu" and gc["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert gc["resources"]["requests"] == {"cpu": "8", "memory": "32Gi"}
    assert gpu["rayStartParams"] == {"num-gpus": "2"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["template"]["spec"]["tolerations"]
    assert gpu["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gc["image"] == "kvfleet:0.1.0-cuda"
    # The CPU group asks for no GPU and inherits workers.resources.
    cc = cpu["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cc["resources"]["limits"] and "tolerations" not in cpu["template"]["spec"]
    assert cc["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
    assert rc["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_tls(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered, "tls")
    c = container(one(objs, "Deployment", "-controller"))
    args = c["args"]
    assert args[args.index("--tls-cert") + 1] == "/etc/kvfleet/tls/tls.crt"
    assert args[args.index("--tls-key") + 1] == "/etc/kvfleet/tls/tls.key"
    assert {"name": "tls", "mountPath": "/etc/kvfleet/tls", "readOnly": True} in c["volumeMounts"]
    vols = one(objs, "Deployment", "-controller")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "kvfleet-tls"}} in vols
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # kubelet's grpc probe has no TLS
        assert c[probe]["tcpSocket"] == {"port": "grpc"} and "grpc" not in c[probe]
    job = container(one(objs, "Job"))
    assert {"name": "KVFLEET_TLS", "value": "1"} in job["env"]


def test_several_controllers_with_leader_election(rendered: dict[str, dict[str, str]]) -> None:
    dep = one(objects(rendered, "ha"), "Deployment", "-controller")
    c = container(dep)
    assert dep["spec"]["replicas"] == 3 and c["args"][-1] == "--leader-election"
    assert c["readinessProbe"]["grpc"] == {"port": 50051}  # only the leader is SERVING
    assert c["livenessProbe"]["tcpSocket"] == {"port": "grpc"}  # a standby is alive, not serving
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 3
    single = one(objects(rendered, "default"), "Deployment", "-controller")
    assert single["spec"]["strategy"] == {"type": "Recreate"}  # never two unelected controllers at once


def test_worker_registration_job(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered, "monitoring")
    job, cm = one(objs, "Job"), one(objs, "ConfigMap")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    env = {e["name"]: e for e in container(job)["env"]}
    assert json.loads(env["KVFLEET_WORKERS"]["value"]) == VLLM
    assert env["KVFLEET_CONTROLLER"]["value"] == "demo-kvfleet-controller:50051"
    assert env["KVFLEET_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "demo-kvfleet-auth", "key": "operator-token"}
    script = cm["data"]["register_workers.py"]
    assert script == (CHART / "files" / "register_workers.py").read_text()
    compile(script, "register_workers.py", "exec")
    assert not [o for o in objects(rendered, "default") if o["kind"] in ("Job", "ConfigMap")]


def test_images_are_pinned_and_pods_run_as_non_root(rendered: dict[str, dict[str, str]]) -> None:
    for name in VALUE_SETS:
        objs = objects(rendered, name)
        for pod, spec in _pod_specs(objs):
            assert spec["securityContext"]["runAsNonRoot"] is True, pod
            assert spec["automountServiceAccountToken"] is False, pod
            for c in spec["containers"]:
                repo, _, tag = c["image"].rpartition(":")
                assert repo and tag and tag != "latest", c["image"]
                assert c["securityContext"]["allowPrivilegeEscalation"] is False


def _pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            out.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
        if o["kind"] == "RayCluster":
            out.append(("ray-head", o["spec"]["headGroupSpec"]["template"]["spec"]))
            out += [(g["groupName"], g["template"]["spec"]) for g in o["spec"]["workerGroupSpecs"]]
    return out


def test_notes_tell_how_to_list_the_fleet(rendered: dict[str, dict[str, str]]) -> None:
    notes = rendered["default"]["kvfleet/templates/NOTES.txt"]
    assert "kubectl -n kvfleet port-forward svc/demo-kvfleet-controller 50051:50051" in notes
    assert "get secret demo-kvfleet-auth -o jsonpath='{.data.operator-token}' | base64 -d" in notes
    assert 'kvfleet session ls --fleet --controller 127.0.0.1:50051 --token "$KVFLEET_TOKEN"' in notes


# ---- bad values ---------------------------------------------------------------------------------

BAD_VALUES = [
    ({"controller": {"replicas": 2}}, "at '/controller/leaderElection/enabled'"),
    ({"controller": {"replicas": 0}}, "at '/controller/replicas': minimum: got 0, want 1"),
    ({"controller": {"resources": {"requests": {"cpu": "-1"}}}}, "at '/controller/resources/requests/cpu'"),
    ({"proxy": {"resources": {"limits": {"memory": -5}}}}, "at '/proxy/resources/limits/memory'"),
    ({"controller": {"replica": 2}}, "at '/controller': additional properties 'replica' not allowed"),
    ({"redis": {"create": False, "external": {"url": "http://redis:6379"}}},
     "at '/redis/external/url': 'http://redis:6379' does not match pattern"),
    ({"redis": {"create": False}}, "at '/redis/external/url': minLength: got 0, want 1"),
    ({"tls": {"enabled": True}, "proxy": {"create": False}}, "at '/tls/secretName': minLength: got 0, want 1"),
    ({"tls": {"enabled": True, "secretName": "t", "clientCa": True}}, "at '/tls/clientSecretName': minLength: got 0, want 1"),
    ({"image": {"tag": "latest"}}, "at '/image/tag'"),
    ({"controller": {"routing": {"resetDrainTimeoutSeconds": -1}}}, "at '/controller/routing/resetDrainTimeoutSeconds'"),
    ({"workers": {"head": {"rayStartParams": {"num-cpus": 0}}}}, "at '/workers/head/rayStartParams/num-cpus'"),
    ({"auth": {"tokens": [{"name": "x", "tenant": "t", "role": "admin", "sha256": "ab" * 32}]}},
     "at '/auth/tokens/0/role'"),
    ({"watcher": {"vllmWorkers": [{"name": "v", "url": "http://v:8000", "kvEvents": "v:5557", "model": "m"}]}},
     "at '/watcher/vllmWorkers/0/kvEvents'"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m.split("'")[1] for _, m in BAD_VALUES])
def test_schema_refuses_bad_values(chart: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    print(str(e.value).strip())
    assert message in str(e.value)
    with pytest.raises(helm.HelmValuesError, match="values don't meet the specifications"):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(("values", "message"), [
    ({"controller": {"replicas": 2}},
     "controller.replicas=2 needs controller.leaderElection.enabled=true"),
    ({"redis": {"create": False}}, "redis.create=false needs redis.external.url"),
    ({"redis": {"external": {"url": "redis://r:6379/0"}}}, "redis.external.url is set but redis.create=true"),
    ({"workers": {"groups": [GPU_GROUP]}}, "workers.groups[gpu] asks for 2 GPU(s) but image.variant=cpu"),
    ({"workers": {"groups": [dict(CPU_GROUP, minReplicas=5)]}}, "workers.groups[cpu]: minReplicas=5 > maxReplicas=4"),
    ({"auth": {"bootstrapOperator": False}}, "no tokens: set auth.bootstrapOperator=true"),
    ({"tls": {"enabled": True, "secretName": "t", "clientCa": True}}, "tls.clientCa=true needs tls.clientSecretName"),
    ({"auth": {"bootstrapOperator": False, "tokens": [{"name": "a", "tenant": "a", "role": "operator", "sha256": "ab" * 32}]},
      "watcher": {"create": True, "vllmWorkers": VLLM}},
     "watcher.create=true needs an operator token: set watcher.tokenSecret.name"),
    ({"auth": {"bootstrapOperator": False, "tokens": [{"name": "a", "tenant": "a", "role": "operator", "sha256": "ab" * 32}]},
      "proxy": {"tokenSecret": {"key": "operator-token"}}},
     "proxy.create=true needs an operator token: set proxy.tokenSecret.name"),
])
def test_templates_refuse_bad_combinations_even_without_the_schema(
        chart: Any, chart_without_schema: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        chart_without_schema.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(e.value)
    # Control: the same chart without the schema renders the default values.
    assert chart_without_schema.render(None, name=RELEASE, namespace=NAMESPACE)


def test_external_redis_url_without_create_false_says_what_to_set(chart: Any) -> None:
    # NOTE: the schema refused this first, with "at '/redis/external/url': maxLength: got 16, want 0" (found by review)
    values = {"redis": {"external": {"url": "redis://r:6379/0"}}}
    chart.validate_schema(values)
    with pytest.raises(helm.HelmRenderError) as e:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    print(str(e.value).strip())
    assert "set redis.create=false to use your own Redis" in str(e.value) and "maxLength" not in str(e.value)
    # Control: with redis.create=false the same URL renders.
    assert chart.render({"redis": {"create": False, "external": {"url": "redis://r:6379/0"}}}, name=RELEASE,
                        namespace=NAMESPACE)


MIB = 1 << 20


@pytest.mark.parametrize(("per_tenant", "total", "extra"), [
    (64 * MIB, 128 * MIB, []),  # the defaults
    (8 * MIB, 16 * MIB, []),  # both at the edge
    (8 * MIB, 16 * MIB - 1, []),  # half of the total under 8 MiB
    (8 * MIB, 8 * MIB, []),  # the reviewer's: maxInflightBytes 8 MiB
    (8 * MIB - 1, 128 * MIB, []),  # one tenant's budget under 8 MiB
    (1 * MIB, 2 * MIB, ["--max-body-bytes", str(MIB)]),  # a smaller body limit through extraArgs
    (1 * MIB, 2 * MIB, [f"--max-body-bytes={MIB + 1}"]),
    (64 * MIB, 128 * MIB, ["--max-body-bytes", str(64 * MIB + 1)]),
], ids=["defaults", "edge", "total-1", "total-8MiB", "tenant-1", "extra-body", "extra-body=", "extra-body-big"])
def test_templates_refuse_the_body_budgets_the_proxy_refuses(
        chart: Any, per_tenant: int, total: int, extra: list[str]) -> None:
    """The chart refuses a proxy.maxInflightBytes / maxInflightBytesPerTenant the proxy would refuse to start with
    (against its --max-body-bytes, 8 MiB unless proxy.extraArgs sets it), and renders every one it accepts."""
    from controller.proxy.main import config_from, parse_args
    from fleet.core.errors import InvalidArgument

    values = {"proxy": {"maxInflightBytesPerTenant": per_tenant, "maxInflightBytes": total, "extraArgs": extra}}
    flags = ["--max-inflight-bytes-per-tenant", str(per_tenant), "--max-inflight-bytes", str(total), *extra]
    try:
        config_from(parse_args(flags, {}))
        proxy_starts = True
    except InvalidArgument:
        proxy_starts = False
    if proxy_starts:
        args = container(one(_docs(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "Deployment", "-proxy"))["args"]
        config_from(parse_args(args[1:], {}))  # the rendered flags start the proxy
        return
    with pytest.raises(helm.HelmRenderError) as e:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    print(str(e.value).strip())
    assert "the proxy would refuse to start" in str(e.value)
    body = parse_args(flags, {}).max_body_bytes
    assert (f"proxy.maxInflightBytesPerTenant={per_tenant}" in str(e.value)) == (per_tenant < body)
    assert (f"proxy.maxInflightBytes={total}" in str(e.value)) == (per_tenant >= body)  # one value at a time


def test_reader_tokens_reach_the_tokens_file(chart: Any) -> None:
    """docs/deploy.md and docs/api.md tell users to mint a reader token for the proxy: the chart takes one by digest."""
    from controller.auth import Role, TokenBook

    token = "kvf_" + "r" * 43
    reader = {"name": "proxy", "tenant": "ops", "role": "reader", "sha256": hashlib.sha256(token.encode()).hexdigest()}
    values = {"auth": {"tokens": [reader]}}
    chart.validate_schema(values)
    secret = one(_docs(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "Secret", "-auth")
    data = base64.b64decode(secret["data"]["tokens.json"]).decode()
    assert json.loads(data)["tokens"][-1] == {"sha256": reader["sha256"], "tenant": "ops", "role": "reader", "name": "proxy"}
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tokens.json"
        path.write_text(data)
        ident = TokenBook(path).lookup(token)
        assert ident is not None and ident.role is Role.READER


# ---- the chart README ---------------------------------------------------------------------------

def _leaves(node: Any, path: str = "") -> list[str]:
    if isinstance(node, dict) and node:
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list) and node and isinstance(node[0], dict):
        return _leaves(node[0], f"{path}[]")
    return [path]


def test_readme_values_table_is_current_and_complete() -> None:
    import support.helm_values as values_table  # tests/support/helm_values.py

    text = (CHART / "values.yaml").read_text()
    readme = (CHART / "README.md").read_text()
    section = readme[readme.index(values_table.BEGIN) + len(values_table.BEGIN):readme.index(values_table.END)]
    assert section.strip() == values_table.table(text), "run: .venv/bin/python tests/support/helm_values.py"
    documented = [k for k, _ in values_table.documented_keys(text)]
    undocumented = [leaf for leaf in _leaves(yaml.safe_load(text))
                    if not any(leaf == k or leaf.startswith(k + ".") or leaf.startswith(k + "[]") for k in documented)]
    assert undocumented == []
    assert len(documented) >= 60
    # Every top-level block of the schema is a block of values.yaml and vice versa.
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]) - {"global"} == set(yaml.safe_load(text))


def test_each_component_block_has_create_name_resources() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for comp in ("controller", "proxy", "workers", "redis", "watcher"):
        assert {"create", "name", "resources"} <= set(values[comp]), comp


def test_docs_name_the_objects_a_release_called_kvfleet_creates(chart: Any) -> None:
    """docs/deploy.md's commands use release `kvfleet` in namespace `kvfleet`: those names must exist."""
    import re

    objs = _docs(chart.render({}, name="kvfleet", namespace="kvfleet"))
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    doc = (ROOT / "docs" / "deploy.md").read_text()
    kinds = {"svc": "Service", "secret": "Secret", "deploy": "Deployment"}
    used = set(re.findall(r"\b(svc|deploy)/(kvfleet-[a-z-]+)", doc)) | set(re.findall(r"get (secret) (kvfleet-[a-z-]+)", doc))
    print(sorted(used))
    assert {("svc", "kvfleet-controller"), ("svc", "kvfleet-proxy"), ("secret", "kvfleet-auth")} <= used
    for kind, name in used:
        assert (kinds[kind], name) in names, (kind, name)
    assert "kvfleet-controller.kvfleet.svc:50051" in doc


def test_chart_packages_and_the_package_renders(tmp_path: Path) -> None:
    tgz = helm.package(CHART, destination=tmp_path)
    assert Path(tgz).name == "kvfleet-0.1.0.tgz"
    with helm.Chart.load(tgz) as packed:
        assert packed.schema == json.loads((CHART / "values.schema.json").read_text())
        assert "files/register_workers.py" in {f["name"] for f in packed.files}
        kinds = sorted(o["kind"] for o in _docs(packed.render({}, name=RELEASE, namespace=NAMESPACE)))
    print(kinds)
    assert kinds == ["Deployment", "Deployment", *["NetworkPolicy"] * 5, "PodDisruptionBudget",
                     "RayCluster", "Secret", "Secret", "Service", "Service", "Service", "ServiceAccount", "StatefulSet"]


def test_values_files_in_the_docs_are_valid(chart: Any) -> None:
    """Every `# NAME-values.yaml` block in docs/deploy.md passes the schema and renders."""
    import re

    doc = (ROOT / "docs" / "deploy.md").read_text()
    blocks = re.findall(r"```yaml\n# ([a-z-]+-values\.yaml)\n(.*?)```", doc, re.S)
    assert {name for name, _ in blocks} >= {"small-values.yaml", "gpu-values.yaml", "workers-values.yaml"}
    for name, body in blocks:
        values = yaml.safe_load(body)
        chart.validate_schema(values)
        objs = _docs(chart.render(values, name="kvfleet", namespace="kvfleet"))
        print(name, len(objs), "objects")
        for o in objs:
            if o["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(o, KUBE_VERSION, strict=True)


def test_set_flags_in_the_docs_are_valid(chart: Any) -> None:
    """Every `--set` combination shown in docs/deploy.md and the chart README passes the schema and renders."""
    import re

    checked = 0
    for path in (ROOT / "docs" / "deploy.md", CHART / "README.md"):
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            sets = re.findall(r"--set ([\w.\[\]-]+=[^\s`'\"]+)", line.split(" # ")[0])
            if not sets:
                continue
            values = helm.parse_set_string(",".join(s.replace("…", "x") for s in sets))
            chart.validate_schema(values)
            chart.render(values, name="kvfleet", namespace="kvfleet")
            checked += 1
    print(checked, "command lines")
    assert checked >= 8


def test_longest_release_name_gives_valid_names(chart: Any) -> None:
    release = "r" * 53  # Helm's longest release name
    helm.validate_release_name(release)
    objs = _docs(chart.render({"watcher": {"create": True, "vllmWorkers": VLLM}}, name=release, namespace=NAMESPACE))
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    print(sorted({n for _, n in names}, key=len)[-3:])
    assert len(names) == len(objs) and all(len(n) <= 63 for _, n in names)
    # A StatefulSet's controller-revision-hash label is its name + 11 characters (labels: <= 63).
    assert all(len(n) <= 52 for k, n in names if k in ("StatefulSet", "Deployment", "Job", "RayCluster", "Service"))
    for o in objs:
        if o["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(o, KUBE_VERSION, strict=True)


def test_notes_commands_use_flags_the_cli_has(rendered: dict[str, dict[str, str]]) -> None:
    import re
    import shlex
    import subprocess
    import sys

    from fleet.app.cli.main import COMMANDS

    notes = rendered["default"]["kvfleet/templates/NOTES.txt"]
    commands = [shlex.split(line.strip()) for line in notes.splitlines()
                if line.strip().startswith("kvfleet ") and line.split()[1] in COMMANDS]
    assert {tuple(c[:3]) for c in commands} >= {("kvfleet", "session", "ls"), ("kvfleet", "worker", "ls")}
    for cmd in commands:
        if cmd[1] == "controller":
            continue  # --mint-token: checked against controller.main's parser below
        out = subprocess.run([sys.executable, "-m", "fleet.app.cli.main", *cmd[1:3], "--help"], capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        for flag in [w for w in cmd[3:] if w.startswith("--")]:
            assert re.search(rf"{flag}\b", out.stdout), f"`{' '.join(cmd[:3])}` has no {flag}"
        assert not re.search(r"--no-such-flag\b", out.stdout)  # control
    from controller.main import parse_args

    (mint,) = [c for c in commands if c[1] == "controller"]
    a = parse_args(mint[2:], {})
    assert (a.mint_token, a.role, a.tokens_file) == ("TENANT", "tenant", "./tokens.json")
    assert "--tls" not in notes and "--tls-ca ca.crt" in rendered["tls"]["kvfleet/templates/NOTES.txt"]


# ---- kernel specs per node group, store GC, fleet metrics (docs/kernel_specs.md, docs/metrics.md) ----

def test_kernel_specs_per_group_reach_the_controller_and_label_the_pods(rendered: dict[str, dict[str, str]]) -> None:
    objs = objects(rendered, "gpu-kernels")
    args = container(one(objs, "Deployment", "-controller"))["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    assert flag["--kernel-backend"] == "numpy" and "--kernel-device" not in flag
    assert [args[i + 1] for i, a in enumerate(args) if a == "--kernel-group"] == ["gpu=torch:cuda"]  # cpu: the default
    assert (flag["--gc-interval"], flag["--fleet-metrics-interval"]) == ("60", "30")
    groups = one(objs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert {g["groupName"]: g["labels"] for g in groups} == {"cpu": {"kvfleet.dev/group": "cpu"},
                                                             "gpu": {"kvfleet.dev/group": "gpu"}}
    default = container(one(objects(rendered, "default"), "Deployment", "-controller"))["args"]
    assert not [a for a in default if a.startswith(("--kernel", "--gc-", "--fleet-metrics"))]


@pytest.mark.parametrize(("values", "message"), [
    ({"workers": {"groups": [dict(CPU_GROUP, kernel={"backend": "torch", "device": "cuda"})]}},
     "workers.groups[cpu].kernel.device=cuda needs gpus > 0"),
    ({"image": {"variant": "cuda"}, "workers": {"kernel": {"backend": "torch", "device": "cuda"},
                                                "groups": [CPU_GROUP, GPU_GROUP]}},
     "workers.groups[cpu] has no GPU (gpus: 0) but runs the default kernel, workers.kernel.device=cuda"),
    ({"image": {"variant": "cuda"}, "workers": {"groups": [dict(GPU_GROUP, kernel={"backend": "numpy", "device": "cuda:1"})]}},
     "the numpy backend runs on cpu only"),
])
def test_a_cuda_kernel_without_a_gpu_is_refused(chart_without_schema: Any, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmRenderError) as e:
        chart_without_schema.render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(e.value)


def test_a_cuda_default_renders_when_gpu_less_groups_say_cpu(chart_without_schema: Any) -> None:
    """Control for the case above: the same CUDA default, the CPU group given its own kernel."""
    out = chart_without_schema.render({"image": {"variant": "cuda"}, "workers": {
        "kernel": {"backend": "torch", "device": "cuda"},
        "groups": [dict(CPU_GROUP, kernel={"backend": "numpy", "device": "cpu"}), GPU_GROUP]}},
        name=RELEASE, namespace=NAMESPACE)
    args = container(one(objects({"x": out}, "x"), "Deployment", "-controller"))["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--kernel-group"] == ["cpu=numpy:cpu"]


@pytest.mark.parametrize(("values", "where"), [
    ({"workers": {"kernel": {"backend": "jax"}}}, "/workers/kernel/backend"),
    ({"workers": {"kernel": {"device": "tpu"}}}, "/workers/kernel/device"),
    ({"workers": {"kernel": {"backend": "torch", "device": "cuda:1"}}}, "/workers/kernel/device"),
    ({"workers": {"groups": [dict(CPU_GROUP, kernel={"device": "gpu0"})]}}, "/workers/groups/0/kernel/device"),
    ({"controller": {"gcIntervalSeconds": -1}}, "/controller/gcIntervalSeconds"),
    ({"controller": {"fleetMetricsIntervalSeconds": -5}}, "/controller/fleetMetricsIntervalSeconds"),
])
def test_schema_refuses_bad_kernel_gc_and_metrics_values(chart: Any, values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert f"at '{where}'" in str(e.value)
