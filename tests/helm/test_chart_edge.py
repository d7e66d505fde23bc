"""The chart's gRPC edge values: the controller's limits reach its flags; TLS and mutual TLS reach the
controller, the proxy and the watcher job (which see only the CA of the server's Secret, never its key)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from support.extras import require_encoder
from test_chart import KUBE_VERSION, NAMESPACE, RELEASE, VLLM, _docs, container, one

from controller.edge import EDGE_FLAGS
from controller.main import parse_args

LIMITS = {"maxRouteTokens": 65536, "uploadsPerTenant": 4, "uploads": 32, "uploadBytesPerTenant": 1 << 27,
          "uploadBytes": 1 << 29, "blobBytesPerTenant": 0, "verdictsPerTenant": 1000,
          "uploadIdleTimeoutSeconds": 12.5, "grpcMaxReceiveBytes": 8 << 20,
          "grpcMaxConcurrentStreams": 50, "grpcMaxConcurrentRpcs": 500, "grpcKeepaliveSeconds": 30,
          "grpcMinPingIntervalSeconds": 5, "uploadMinRate": 4096, "uploadTenantShare": 0.25, "getsPerTenant": 3,
          "gets": 24, "getBytesPerTenant": 1 << 23, "getBytes": 1 << 26, "getIdleTimeoutSeconds": 7.5}
MTLS = {"tls": {"enabled": True, "secretName": "kvfleet-tls", "clientCa": True, "clientSecretName": "kvfleet-client"},
        "watcher": {"create": True, "vllmWorkers": VLLM}}


def _objs(chart: Any, values: dict[str, Any]) -> list[dict[str, Any]]:
    return _docs(chart.render(values, name=RELEASE, namespace=NAMESPACE))


def test_limits_reach_the_controller_flags(chart: Any) -> None:
    args = container(one(_objs(chart, {"controller": {"limits": LIMITS}}), "Deployment", "-controller"))["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args) if a.startswith("--") and i + 1 < len(args)}
    print(args)
    assert flag["--max-route-tokens"] == "65536" and flag["--max-upload-bytes-per-tenant"] == str(1 << 27)
    assert flag["--upload-idle-timeout"] == "12.5" and flag["--grpc-min-ping-interval"] == "5"
    assert flag["--max-blob-bytes-per-tenant"] == "0"  # 0 (no quota) is a value, not "unset"
    assert flag["--max-verdicts-per-tenant"] == "1000"
    assert flag["--upload-min-rate"] == "4096" and flag["--upload-tenant-share"] == "0.25"
    assert (flag["--max-gets-per-tenant"], flag["--max-gets"], flag["--max-get-bytes-per-tenant"], flag["--max-get-bytes"],
            flag["--get-idle-timeout"]) == ("3", "24", str(1 << 23), str(1 << 26), "7.5")
    assert set(EDGE_FLAGS) <= set(flag)  # every edge flag has a value
    # the controller's own parser takes them all
    cli = parse_args(args[1:], {})
    assert (cli.edge_max_route_tokens, cli.edge_idle_s, cli.edge_max_concurrent_streams) == (65536, 12.5, 50)
    assert cli.edge_max_blob_bytes_per_tenant == 0
    # control: the default values pass none of them
    args = container(one(_objs(chart, {}), "Deployment", "-controller"))["args"]
    assert not set(EDGE_FLAGS) & set(args)


def test_schema_refuses_a_bad_limit(chart: Any) -> None:
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"controller": {"limits": {"uploads": 0}}})
    assert "at '/controller/limits/uploads': minimum: got 0, want 1" in str(e.value)
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"controller": {"limits": {"blobBytesPerTenant": -1}}})
    assert "at '/controller/limits/blobBytesPerTenant': minimum: got -1, want 0" in str(e.value)
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema({"tls": {"clientCa": True, "clientSecretName": "c"}})
    assert "at '/tls/enabled'" in str(e.value)


def test_mutual_tls_reaches_controller_proxy_and_watcher(chart: Any) -> None:
    objs = _objs(chart, MTLS)
    ctl = container(one(objs, "Deployment", "-controller"))["args"]
    assert ctl[ctl.index("--tls-client-ca") + 1] == "/etc/kvfleet/tls/ca.crt"
    proxy_dep = one(objs, "Deployment", "-proxy")
    p = container(proxy_dep)
    flag = {a: p["args"][i + 1] for i, a in enumerate(p["args"]) if a.startswith("--tls")}
    assert flag == {"--tls-ca": "/etc/kvfleet/tls/ca.crt", "--tls-cert": "/etc/kvfleet/tls-client/tls.crt",
                    "--tls-key": "/etc/kvfleet/tls-client/tls.key"}
    vols = {v["name"]: v for v in proxy_dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["tls-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]  # never the server's key
    assert vols["tls-client"]["secret"]["secretName"] == "kvfleet-client"
    job = container(one(objs, "Job"))
    env = {e["name"]: e.get("value") for e in job["env"]}
    assert env["KVFLEET_TLS_CLIENT_CERT"] == "/etc/kvfleet/tls-client/tls.crt" and env["KVFLEET_CA"].endswith("ca.crt")
    for o in objs:
        if o["kind"] in ("Deployment", "Job", "Secret", "Service"):
            assert kubernetes_validate.validate(o, KUBE_VERSION, strict=True) == "1.32", o["metadata"]["name"]
    # the proxy's flags are ones `kvfleet proxy` has
    from controller.proxy.main import config_from
    from controller.proxy.main import parse_args as proxy_args

    cfg = config_from(proxy_args(p["args"][1:], {}))
    assert cfg.tls_client_key == "/etc/kvfleet/tls-client/tls.key"
    # control: server-only TLS gives the proxy the CA and no client certificate
    plain = container(one(_objs(chart, {"tls": {"enabled": True, "secretName": "kvfleet-tls"}}), "Deployment", "-proxy"))
    assert "--tls-ca" in plain["args"] and "--tls-cert" not in plain["args"]


def test_notes_give_tls_flags_the_cli_has(chart: Any) -> None:
    import shlex

    from fleet.app.cli.session import parse as session_parse
    from fleet.app.cli.worker import parse as worker_parse

    notes = chart.render(MTLS, name=RELEASE, namespace=NAMESPACE)["kvfleet/templates/NOTES.txt"]
    commands = [shlex.split(line.strip()) for line in notes.splitlines() if line.strip().startswith("kvfleet ")
                and line.split()[1] in ("session", "worker")]
    assert len(commands) == 2
    for cmd in commands:
        args = (session_parse if cmd[1] == "session" else worker_parse)(cmd[2:])
        assert (args.tls_ca, args.tls_cert, args.tls_key) == ("ca.crt", "client.crt", "client.key")


def _secret_data(objs: list[dict[str, Any]]) -> dict[str, str]:
    import base64

    return {k: base64.b64decode(v).decode() for k, v in one(objs, "Secret", "-auth")["data"].items()}


def _proxy_token_ref(objs: list[dict[str, Any]]) -> dict[str, str]:
    env = {e["name"]: e for e in container(one(objs, "Deployment", "-proxy"))["env"]}
    return dict(env["KVFLEET_PROXY_TOKEN"]["valueFrom"]["secretKeyRef"])


def test_the_proxy_gets_a_reader_token_of_its_own(chart: Any, tmp_path: Any) -> None:
    """By default the chart mints the proxy a reader token (it only lists workers), not the operator's."""
    import hashlib
    import json

    from controller.auth import Role, TokenBook

    objs = _objs(chart, {})
    data = _secret_data(objs)
    token = data["proxy-token"]
    assert token.startswith("kvf_") and token != data["operator-token"] and token not in data["tokens.json"]
    entry = json.loads(data["tokens.json"])["tokens"][1]
    assert entry == {"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": "ops", "role": "reader",
                     "name": "helm-proxy-reader"}
    (tmp_path / "tokens.json").write_text(data["tokens.json"])
    ident = TokenBook(tmp_path / "tokens.json").lookup(token)
    assert ident is not None and ident.role is Role.READER  # the controller reads it as a reader
    assert _proxy_token_ref(objs) == {"name": f"{RELEASE}-kvfleet-auth", "key": "proxy-token"}
    # without a bootstrap operator the proxy still has its token (before: a render error)
    objs = _objs(chart, {"auth": {"bootstrapOperator": False,
                                  "tokens": [{"name": "a", "tenant": "a", "role": "tenant", "sha256": "ab" * 32}]}})
    assert set(_secret_data(objs)) == {"tokens.json", "proxy-token"}
    assert _proxy_token_ref(objs)["key"] == "proxy-token"


@pytest.mark.parametrize(("values", "ref"), [
    ({"proxy": {"create": False}}, None),
    ({"proxy": {"tokenSecret": {"name": "mine"}}}, {"name": "mine", "key": "operator-token"}),
    ({"proxy": {"tokenSecret": {"name": "mine", "key": "t"}}}, {"name": "mine", "key": "t"}),
    ({"proxy": {"tokenSecret": {"key": "operator-token"}}}, {"name": f"{RELEASE}-kvfleet-auth", "key": "operator-token"}),
])
def test_no_reader_token_is_minted_when_the_proxy_has_another(chart: Any, values: dict[str, Any],
                                                              ref: dict[str, str] | None) -> None:
    objs = _objs(chart, values)
    assert "proxy-token" not in _secret_data(objs)
    assert "helm-proxy-reader" not in _secret_data(objs)["tokens.json"]
    if ref is not None:
        assert _proxy_token_ref(objs) == ref


def test_detector_layers_reach_the_controller_flag(chart: Any) -> None:
    """controller.detectorLayers becomes --detector-layers, which the controller's parser takes; null, the
    flag is absent (the controller's default, which the chart keeps: the encoder is opt-in, issue #28); a list
    with an unknown layer fails the schema; the image can run every layer, so naming the encoder works there."""
    from controller.main import config_from

    args = container(one(_objs(chart, {"controller": {"detectorLayers": "rules,learned"}}), "Deployment",
                         "-controller"))["args"]
    assert args[args.index("--detector-layers") + 1] == "rules,learned"
    assert config_from(parse_args(args[1:], {}), {}).detector_layers == ("rules", "learned")
    default = container(one(_objs(chart, {}), "Deployment", "-controller"))["args"]
    assert "--detector-layers" not in default  # the chart's default: the controller's default layers
    full = container(one(_objs(chart, {"controller": {"detectorLayers": "rules,learned,encoder"}}), "Deployment",
                         "-controller"))["args"]
    assert full[full.index("--detector-layers") + 1] == "rules,learned,encoder"  # control: opting in renders it
    with pytest.raises(Exception, match="detectorLayers|pattern"):
        _objs(chart, {"controller": {"detectorLayers": "rules,bert"}})


def test_the_schema_takes_every_detector_layer(chart: Any) -> None:
    """Each layer the controller knows passes the chart's schema, alone and in a tenant's spec (a layer
    added to fleet/core/quarantine/detector_config.py's LAYERS must be added to values.schema.json's patterns)."""
    from fleet.core.quarantine.detector_config import LAYERS

    for name in LAYERS:
        _objs(chart, {"controller": {"detectorLayers": name, "detectorTenants": {"acme": f"{name}:0.5"}}})


def test_detector_tenants_reach_the_controller_flag(chart: Any) -> None:
    """controller.detectorTenants becomes one --detector-tenant per tenant, which the controller's parser takes;
    a spec with an unknown layer fails the schema."""
    from controller.main import config_from

    # NOTE: bravo's per-member encoder thresholds (docs/quarantine.md) failed the schema's pattern (review finding)
    values = {"controller": {"detectorTenants": {"acme": "rules,learned:0.99", "bravo": "rules,encoder:0.97/0.98"}}}
    args = container(one(_objs(chart, values), "Deployment", "-controller"))["args"]
    given = [args[i + 1] for i, a in enumerate(args) if a == "--detector-tenant"]
    assert sorted(given) == ["acme=rules,learned:0.99", "bravo=rules,encoder:0.97/0.98"]
    tenants = dict(config_from(parse_args(args[1:], {}), {}).detector_tenants)
    assert (tenants["acme"].layers, tenants["acme"].learned_threshold) == (("rules", "learned"), 0.99)
    assert tenants["bravo"].encoder_threshold == (0.97, 0.98)
    assert "--detector-tenant" not in container(one(_objs(chart, {}), "Deployment", "-controller"))["args"]
    with pytest.raises(Exception, match="detectorTenants|pattern"):
        _objs(chart, {"controller": {"detectorTenants": {"acme": "rules,bert"}}})


def test_the_encoder_gate_reaches_the_controller_flag(chart: Any) -> None:
    """controller.detectorEncoderGate becomes --detector-encoder-gate (absent when null), which the controller's
    parser takes with the encoder named; a tenant's spec can carry gate:TAU; out of [0, 1] fails the schema."""
    require_encoder()
    from controller.main import config_from

    values = {"controller": {"detectorLayers": "rules,learned,encoder", "detectorEncoderGate": 0.918,
                             "detectorTenants": {"acme": "rules,learned,encoder,gate:0.5"}}}
    args = container(one(_objs(chart, values), "Deployment", "-controller"))["args"]
    assert args[args.index("--detector-encoder-gate") + 1] == "0.918"
    cfg = config_from(parse_args(args[1:], {}), {})
    assert cfg.detector_encoder_gate == 0.918 and dict(cfg.detector_tenants)["acme"].encoder_gate == 0.5
    assert "--detector-encoder-gate" not in container(one(_objs(chart, {}), "Deployment", "-controller"))["args"]
    with pytest.raises(Exception, match="detectorEncoderGate|maximum"):
        _objs(chart, {"controller": {"detectorEncoderGate": 1.5}})


def test_tool_media_policy_reaches_the_proxy_flag(chart: Any) -> None:
    """proxy.quarantine.media becomes --tool-media, which the proxy's parser takes; an unknown one fails the schema."""
    from controller.proxy.main import config_from
    from controller.proxy.main import parse_args as proxy_args

    args = container(one(_objs(chart, {"proxy": {"quarantine": {"media": "withhold"}}}), "Deployment", "-proxy"))["args"]
    assert args[args.index("--tool-media") + 1] == "withhold"
    assert config_from(proxy_args(args[1:], {})).tool_media == "withhold"
    with pytest.raises(Exception, match="media|enum"):
        _objs(chart, {"proxy": {"quarantine": {"media": "drop"}}})


def test_the_encoder_window_gate_reaches_the_controller_flag(chart: Any) -> None:
    """controller.detectorEncoderMaxFragmentation becomes --detector-encoder-max-fragmentation (absent when null); a
    tenant's spec can carry frag:PHI; 0 or above 1 fails the schema."""
    require_encoder()
    from controller.main import config_from

    values = {"controller": {"detectorLayers": "rules,learned,encoder", "detectorEncoderMaxFragmentation": 0.2,
                             "detectorTenants": {"acme": "rules,learned,encoder,frag:0.3"}}}
    args = container(one(_objs(chart, values), "Deployment", "-controller"))["args"]
    assert args[args.index("--detector-encoder-max-fragmentation") + 1] == "0.2"
    cfg = config_from(parse_args(args[1:], {}), {})
    assert cfg.detector_encoder_max_fragmentation == 0.2
    assert dict(cfg.detector_tenants)["acme"].encoder_max_fragmentation == 0.3
    assert "--detector-encoder-max-fragmentation" not in container(one(_objs(chart, {}), "Deployment", "-controller"))["args"]
    for bad in (0, 1.5):
        with pytest.raises(Exception, match="detectorEncoderMaxFragmentation|maximum|exclusiveMinimum"):
            _objs(chart, {"controller": {"detectorEncoderMaxFragmentation": bad}})
