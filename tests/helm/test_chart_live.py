"""The rendered chart, run: what the pods would execute, executed here against real parts.

The controller starts from the Deployment's own args and the Secret's own tokens.json on a real
Redis and answers the kubelet's gRPC probe; the registration Job's script registers a real sim-vllm
with the operator token from the Secret; the HA values give one SERVING leader and a standby that
is alive (TCP: liveness passes) but NOT_SERVING (readiness fails); the proxy's args parse with the
proxy's own parser. Only addresses (pod DNS names -> loopback) and file paths are rewritten.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import grpc
import helm_python as helm
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvfleet"


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(CHART) as ch:
        manifests = ch.render(values, name="demo", namespace="kvfleet")
    return [d for p, t in sorted(manifests.items()) if not p.endswith("NOTES.txt") for d in yaml.safe_load_all(t) if d]


def find(objs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    (o,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return o


def secret_data(objs: list[dict[str, Any]]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in find(objs, "Secret", "-auth")["data"].items()}


def controller_config(objs: list[dict[str, Any]], tokens: Path, redis_url: str) -> Any:
    """The ControllerConfig `kvfleet controller` builds from the rendered args, with pod paths and
    cluster addresses swapped for this machine's."""
    from controller.main import config_from, parse_args

    args = find(objs, "Deployment", "-controller")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "controller"
    cfg = config_from(parse_args(args[1:], {}), {})
    assert cfg.listen == "0.0.0.0:50051" and cfg.tokens_file == "/etc/kvfleet/tokens/tokens.json"
    assert cfg.store_url == "redis://demo-kvfleet-redis:6379/0"
    return dataclasses.replace(cfg, listen="127.0.0.1:0", store_url=redis_url, tokens_file=str(tokens), ray_address=None)


async def health(address: str) -> int:
    """What the kubelet's `grpc:` probe asks: grpc.health.v1 Check for service ""."""
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return int(resp.status)


async def run_job(objs: list[dict[str, Any]], address: str, token: str) -> tuple[int, str]:
    """The Job's container: its script from the ConfigMap, its env with the Secret resolved."""
    job = find(objs, "Job")
    c = job["spec"]["template"]["spec"]["containers"][0]
    script = find(objs, "ConfigMap")["data"]["register_workers.py"]
    assert c["command"] == ["python", "/etc/kvfleet/job/register_workers.py"]
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    env.update(KVFLEET_CONTROLLER=address, KVFLEET_TOKEN=token, HOME=env["HOME"],
               PYTHONPATH=str(ROOT), PATH=os.environ.get("PATH", ""))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return int(proc.returncode or 0), out.decode()


async def test_controller_and_registration_job_run_as_rendered(tmp_path: Path, redis_url: str) -> None:
    from controller.metrics import Metrics
    from controller.server import build_server
    from fleet.app.testkit.sim_vllm.config import SimEngineConfig
    from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
    from fleet.sdk import AsyncFleetClient

    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64))).start()
    worker = {"name": "sim-0", "url": sim.url, "kvEvents": sim.kv_events, "replay": sim.replay, "model": "m"}
    # DP rank 2 behind an external load balancer (before: the schema refused dpRankStart, and the Job sent no ranks)
    r2 = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", block_size=16, num_blocks=64), dp_rank=2)).start()
    rank2 = {"name": "sim-r2", "url": r2.url, "kvEvents": r2.kv_events, "replay": r2.replay, "model": "m",
             "dpRankStart": 2}
    objs = render({"watcher": {"create": True, "vllmWorkers": [worker, rank2]}})
    data = secret_data(objs)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(data["tokens.json"])
    ctl = await build_server(controller_config(objs, tokens, redis_url), metrics=Metrics())
    try:
        assert await health(ctl.address) == health_pb2.HealthCheckResponse.SERVING
        rc, out = await run_job(objs, ctl.address, data["operator-token"])
        print(out)
        assert rc == 0 and f"registered sim-0: {sim.url}" in out
        rc, out = await run_job(objs, ctl.address, data["operator-token"])  # helm upgrade: same spec again
        assert rc == 0, out
        async with AsyncFleetClient(ctl.address, token=data["operator-token"]) as op:
            listed = [(w.name, w.url, w.dp_rank_start, [r.dp_rank for r in w.ranks]) for w in await op.workers()]
            assert sorted(listed) == [("sim-0", sim.url, 0, [0]), ("sim-r2", r2.url, 2, [2])]
            assert (await op.whoami()).tenant == "ops"
        # Control: the same Job with a token that is not in tokens.json is refused.
        rc, out = await run_job(objs, ctl.address, data["operator-token"][:-2] + "xx")
        print(out.strip().splitlines()[-1])
        assert rc != 0 and "invalid bearer token" in out
    finally:
        await ctl.stop(0)
        await sim.stop()
        await r2.stop()


async def test_ha_values_give_one_leader_and_a_live_standby(tmp_path: Path, redis_url: str) -> None:
    from controller.metrics import Metrics
    from controller.server import build_server

    objs = render({"controller": {"replicas": 2, "leaderElection": {"enabled": True}}})
    tokens = tmp_path / "tokens.json"
    tokens.write_text(secret_data(objs)["tokens.json"])
    cfg = dataclasses.replace(controller_config(objs, tokens, redis_url), leader_ttl_s=1.0)
    assert cfg.leader_election
    first = await build_server(cfg, metrics=Metrics())
    second = None
    try:
        for _ in range(100):
            if await health(first.address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.05)
        second = await build_server(cfg, metrics=Metrics())
        await asyncio.sleep(0.5)
        states = [await health(c.address) for c in (first, second)]
        print("leader, standby health:", states)
        assert states == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
        # The standby's port accepts TCP (the chart's liveness probe with leader election).
        host, port = second.address.rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        writer.close()
        # The leader goes (a rollout, a drain): the standby takes over and becomes Ready.
        await first.stop(0)
        first = None
        for _ in range(100):
            if await health(second.address) == health_pb2.HealthCheckResponse.SERVING:
                break
            await asyncio.sleep(0.1)
        assert await health(second.address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        for c in (first, second):
            if c is not None:
                await c.stop(0)


def test_proxy_args_parse_with_the_proxys_parser() -> None:
    from controller.proxy.main import config_from, parse_args

    objs = render({})
    c = find(objs, "Deployment", "-proxy")["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][0] == "proxy"
    env = {e["name"]: "kvf_x" for e in c["env"] if "valueFrom" in e}
    assert set(env) == {"KVFLEET_PROXY_TOKEN"}
    cfg = config_from(parse_args(c["args"][1:], env))
    assert (cfg.controller, cfg.listen, cfg.metrics_listen, cfg.token, cfg.token_passthrough) == (
        "demo-kvfleet-controller:50051", "0.0.0.0:8080", "0.0.0.0:9401", "kvf_x", True)
    ref = next(e for e in c["env"] if e["name"] == "KVFLEET_PROXY_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "demo-kvfleet-auth", "key": "proxy-token"}  # the reader token the chart mints
    assert json.loads(json.dumps(c["ports"])) == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                                                  {"name": "metrics", "containerPort": 9401, "protocol": "TCP"}]
