"""--node-kv-bytes: the flag reaches the controller's session fleet, and a create that no node has
room for is RESOURCE_EXHAUSTED over gRPC with an actionable message (nothing is left behind)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import ControllerConfig
from controller.main import config_from, parse_args
from controller.server import build_server
from fleet.core.errors import ResourceExhausted
from fleet.sdk import AsyncFleetClient
from workers.placement import NODE_KV_BYTES
from workers.spec import KernelSpec, make_kernel


def test_the_flag_and_its_env_var_reach_the_config() -> None:
    assert config_from(parse_args([], {}), {}).node_kv_bytes == NODE_KV_BYTES
    assert config_from(parse_args(["--node-kv-bytes", "4096"], {}), {}).node_kv_bytes == 4096
    assert parse_args([], {"KVFLEET_NODE_KV_BYTES": "8192"}).node_kv_bytes == 8192
    for bad in (["--node-kv-bytes", "0"], ["--node-kv-bytes", "2GiB"]):
        with pytest.raises(SystemExit):
            parse_args(bad, {})


async def test_a_full_node_refuses_the_next_session_with_resource_exhausted(ray_cluster: None, tmp_path: Path) -> None:
    block = make_kernel(KernelSpec()).block_bytes          # the controller's default spec
    ctl = await build_server(ControllerConfig(listen="127.0.0.1:0", store_url=f"sqlite:///{tmp_path / 'kv.db'}",
                                              node_kv_bytes=4 * block))
    c = AsyncFleetClient(ctl.address)
    try:
        await c.create_session("b1", "You are a budget agent; answer in one line.")
        with pytest.raises(ResourceExhausted, match="no node has room.*--node-kv-bytes"):
            await c.create_session("b2", "Another agent, with another prompt entirely.")
        assert [r.session_id for r in await c.sessions()] == ["b1"]
    finally:
        await c.close()
        await ctl.stop(grace=1)
