"""Backend and device as a deployment choice: `kvfleet controller` / `up` flags write them into the
store's kernel spec (never the model), and `session ls --fleet` shows where each session runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.controller import start_controller

from controller.kernel_placement import (
    KERNEL_SPEC_KEY,
    kernel_overrides_from,
    kernel_spec_of,
    set_kernel_placement,
)
from controller.main import config_from, parse_args
from fleet.app.cli.session import render_sessions
from fleet.app.cli.up import parse as parse_up
from fleet.cas import open_store
from fleet.core.errors import InvalidArgument
from fleet.sdk import NO_RETRY, AsyncFleetClient
from workers.spec import KernelSpec, make_kernel


def test_flags_become_placement_overrides() -> None:
    args = parse_args(["--kernel-backend", "numpy", "--kernel-group", "gpu=torch:cuda",
                       "--kernel-group", "fast=torch:cpu"], {})
    assert config_from(args, {}).kernel == {"backend": "numpy", "groups": {
        "gpu": {"backend": "torch", "device": "cuda"}, "fast": {"backend": "torch", "device": "cpu"}}}
    assert config_from(parse_args([], {}), {}).kernel == {}
    assert kernel_overrides_from(parse_args(["--kernel-device", "cuda"], {})) == {"device": "cuda",
                                                                                   "backend": "torch"}
    up = parse_up(["--kernel-group", "gpu=torch:cuda"])
    assert kernel_overrides_from(up) == {"groups": {"gpu": {"backend": "torch", "device": "cuda"}}}
    for bad, msg in [(["--kernel-backend", "numpy", "--kernel-device", "cuda"], "numpy backend runs on 'cpu' only"),
                     (["--kernel-group", "gpu:torch"], "GROUP=BACKEND:DEVICE"),
                     (["--kernel-group", "a=torch:cpu", "--kernel-group", "a=numpy:cpu"], "names a group twice"),
                     (["--kernel-device", "tpu"], "device must be"),
                     (["--kernel-device", "cuda:1"], "Ray shows each kernel host only the GPU it assigned")]:
        with pytest.raises(InvalidArgument, match=msg):
            kernel_overrides_from(parse_args(bad, {}))


def test_placement_changes_where_not_what(tmp_path: Path) -> None:
    with open_store(f"sqlite:///{tmp_path / 'k.db'}") as store:
        store.kv_put(*KERNEL_SPEC_KEY, json.dumps({"block_size": 16, "seed": 7, "config": {"n_layers": 3}}).encode())
        out = set_kernel_placement(store, {"backend": "torch", "groups": {"gpu": {"backend": "torch",
                                                                                  "device": "cuda"}}})
        stored = json.loads(store.kv_get(*KERNEL_SPEC_KEY))
        assert stored == out and (stored["seed"], stored["config"], stored["block_size"]) == (7, {"n_layers": 3}, 16)
        assert (stored["backend"], stored["groups"]) == ("torch", {"gpu": {"backend": "torch", "device": "cuda"}})
        assert set_kernel_placement(store, {"backend": "numpy"})["device"] == "cpu"
        before = store.kv_get(*KERNEL_SPEC_KEY)
        for bad in ({"seed": 1}, {"device": "cuda"}):   # the model is not a deployment choice; numpy has no CUDA
            with pytest.raises(InvalidArgument):
                set_kernel_placement(store, bad)
        assert store.kv_get(*KERNEL_SPEC_KEY) == before  # a refused change writes nothing


def test_a_spec_stored_with_the_removed_extra_field_still_loads(tmp_path: Path) -> None:
    """KernelSpec.extra (never read) was removed; specs stored with it (to_dict wrote "extra": {})
    load as before, and the next placement change drops it from the store."""
    from workers.spec import KernelSpec

    old = {**KernelSpec(seed=7).to_dict(), "extra": {}}
    assert KernelSpec.from_dict(old) == KernelSpec(seed=7) and "extra" not in KernelSpec(seed=7).to_dict()
    with open_store(f"sqlite:///{tmp_path / 'k.db'}") as store:
        store.kv_put(*KERNEL_SPEC_KEY, json.dumps(old).encode())
        out = set_kernel_placement(store, {"backend": "torch"})
        assert "extra" not in out and json.loads(store.kv_get(*KERNEL_SPEC_KEY)) == out and out["seed"] == 7


async def test_session_rows_show_backend_and_device(ray_cluster: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    ctl = await start_controller(url, None, kernel={"backend": "torch", "device": "cpu"}, fleet_metrics_interval_s=0)
    try:
        async with AsyncFleetClient(ctl.address, retry=NO_RETRY) as c:
            await c.create_session("t1", "You are a torch-backed agent.")
            rows = await c.sessions(fleet=True)
        print("rows:", [(r.session_id, r.backend, r.device) for r in rows])
        assert [(r.session_id, r.backend, r.device) for r in rows] == [("t1", "torch", "cpu")]
        with open_store(url) as store:  # the kernel whose KV the session holds: a rebuild is exact only on its like
            model_id = make_kernel(KernelSpec.from_dict(kernel_spec_of(store))).model_id
        assert [(r.model_id, r.rebuilt_from_model_id) for r in rows] == [(model_id, "")]
        table = render_sessions(rows)
        assert [c.header for c in table.columns][3] == "kernel" and [str(x) for x in table.columns[3]._cells] == ["torch/cpu"]
    finally:
        await ctl.stop(0)
