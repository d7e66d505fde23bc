"""Kernel specs per node group: pure resolution rules, and a real multi-node Ray where a group
mapped to CUDA on a node without a GPU gets nothing and each other group runs its own backend."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.workers import run_scenario

from fleet.core.errors import InvalidArgument
from workers.spec import GROUP_LABEL, HOST_GPUS, KernelSpec, node_group, parse_group

SPEC = KernelSpec(groups=(("fast", "torch", "cpu"), ("gpu", "torch", "cuda")))


def _node(group: str = "", gpus: float = 0.0) -> dict:
    labels = {GROUP_LABEL: group} if group else {}
    return {"NodeID": "n", "Alive": True, "Labels": labels, "Resources": {"CPU": 4.0, **({"GPU": gpus} if gpus else {})}}


def test_a_node_runs_its_groups_spec_and_never_cuda_without_a_gpu() -> None:
    assert node_group(_node("fast")) == "fast" and node_group(_node()) == ""
    assert (SPEC.for_node(_node()).backend, SPEC.for_node(_node()).device) == ("numpy", "cpu")
    assert (SPEC.for_node(_node("fast")).backend, SPEC.for_node(_node("fast")).device) == ("torch", "cpu")
    assert SPEC.for_node(_node("gpu")) is None                      # labelled gpu, but no GPU: nothing runs there
    gpu = SPEC.for_node(_node("gpu", gpus=2))
    assert (gpu.backend, gpu.device, gpu.host_gpus, gpu.groups) == ("torch", "cuda", HOST_GPUS, ())
    assert SPEC.for_node(_node("cpu")).host_gpus == 0.0             # a CPU group asks Ray for no GPU
    cuda_default = KernelSpec(backend="torch", device="cuda")
    assert cuda_default.for_node(_node()) is None and cuda_default.on_cpu().device == "cpu"
    assert cuda_default.on_cpu().backend == "numpy"


def test_specs_round_trip_and_bad_placements_are_refused() -> None:
    assert KernelSpec.from_dict(SPEC.to_dict()) == SPEC
    assert SPEC.to_dict()["groups"] == {"fast": {"backend": "torch", "device": "cpu"},
                                        "gpu": {"backend": "torch", "device": "cuda"}}
    assert KernelSpec.from_dict({"block_size": 16}).groups == ()   # a spec stored before groups existed
    for bad, msg in [({"backend": "numpy", "device": "cuda"}, "numpy backend runs on 'cpu' only"),
                     ({"backend": "jax"}, "unknown backend 'jax'"),
                     ({"device": "tpu"}, "device must be 'cpu' or 'cuda'"),
                     ({"backend": "torch", "device": "cuda:1"}, "only the GPU it assigned, as cuda:0"),
                     ({"groups": {"GPU!": {"backend": "torch", "device": "cuda"}}}, "must be a DNS label"),
                     ({"groups": {"gpu": {"backend": "numpy", "device": "cuda:0"}}}, "node group 'gpu'"),
                     ({"groups": {"gpu": {"backend": "torch", "devcie": "cuda"}}}, "unknown keys \\['devcie'\\]"),
                     ({"groups": [["gpu", "torch"]]}, "triples")]:
        with pytest.raises(InvalidArgument, match=msg):
            KernelSpec.from_dict(bad)
    assert parse_group("gpu=torch:cuda:0") == ("gpu", "torch", "cuda:0")
    for bad in ("gpu", "gpu=torch", "=torch:cuda", "gpu=numpy:cuda", "gpu=torch:cuda:1"):
        with pytest.raises(InvalidArgument, match="--kernel-group"):
            parse_group(bad)


@pytest.mark.slow
def test_node_groups_on_a_real_multi_node_ray(tmp_path: Path) -> None:
    r = run_scenario(Path(__file__).with_name("node_groups_scenario.py"), tmp_path, timeout_s=300)
    print("supervised groups:", r["supervised"], "| sessions (group, backend, device):", r["sessions"])
    assert r["supervised"] == ["cpu", "fast"]                    # the GPU-less `gpu` node builds nothing
    assert {g for g, _, _ in r["sessions"]} == {"cpu", "fast"} and len(r["sessions"]) == 4
    assert all((b, d) == ({"cpu": "numpy", "fast": "torch"}[g], "cpu") for g, b, d in r["sessions"])
    assert r["driver_backend"] == "numpy"
    # a fork from the torch group onto the numpy node replays (torch-made KV is not numpy's)
    assert r["cross_group_fork"] == {"adopted_tokens": 0, "moved_bytes": 0, "child": ["cpu", "numpy"],
                                     "same_tokens": True}
    # a CUDA default on GPU-less nodes is named as such (before: "no Ray node has the resources")
    assert r["cuda_everywhere"].startswith("Unavailable: no Ray node can run the kernel spec: 3 node(s) have no GPU")
