"""Where the kernel runs, chosen at deployment: the --kernel-* flags of `kvfleet controller` / `up`.

    kvfleet controller --kernel-backend numpy --kernel-group gpu=torch:cuda

The fleet's kernel spec lives in the store (`controller/kernel_spec`), so every controller on a
store runs the same model. These flags change only *where* it runs (backend, device, per node
group; docs/kernel_specs.md), never the model itself, and are written to the store when the
controller starts, before the fleet is built. Sessions regenerated on another backend replay the
same op log there (bit-exactness holds within one backend, DESIGN §4).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from fleet.core.errors import InvalidArgument
from workers.spec import KernelSpec, check_placement, parse_group

KERNEL_SPEC_KEY = ("controller", "kernel_spec")
DEFAULT_SPEC: dict[str, Any] = {"block_size": 16}  # what the sessions servicer writes when none is stored


def kernel_spec_of(store: Any, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fleet's kernel spec from the store; `default` (or DEFAULT_SPEC, the synthetic tiny
    model) is written there the first time, so every later controller on this store runs the same kernel."""
    raw = store.kv_get(*KERNEL_SPEC_KEY)
    if raw is None:
        store.kv_put(*KERNEL_SPEC_KEY, json.dumps(default or DEFAULT_SPEC).encode())
        raw = store.kv_get(*KERNEL_SPEC_KEY)
    return dict(json.loads(raw))


def write_back_spec(store: Any, spec: dict[str, Any]) -> bool:
    """After the store lost its data: write back the spec this controller holds (the one its --kernel-* flags wrote,
    or its fleet was built with), unless another controller wrote one first; True: written. NOTE: the spec went with
    the data, and the first session call wrote the default (the synthetic tiny model, numpy) in its place: a
    controller started later built its fleet with another model and placement than the live hosts ran."""
    return bool(store.kv_swap(*KERNEL_SPEC_KEY, None, json.dumps(spec, sort_keys=True).encode()))


def add_kernel_flags(p: argparse.ArgumentParser) -> None:
    """--kernel-backend, --kernel-device, --kernel-group (shared by `kvfleet controller` and `up`)."""
    p.add_argument("--kernel-backend", default=None, choices=("numpy", "torch"),
                   help="backend of the session kernels on nodes of no listed group (default: the store's, numpy)")
    p.add_argument("--kernel-device", default=None,
                   help="their device: cpu or cuda (cuda needs --kernel-backend torch; Ray assigns each actor its GPU)")
    p.add_argument("--kernel-group", action="append", default=None, metavar="GROUP=BACKEND:DEVICE",
                   help="backend and device on Ray nodes labelled kvfleet.dev/group=GROUP, e.g. gpu=torch:cuda "
                        "(repeatable; replaces the stored groups)")


def kernel_overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as kernel-spec fields; raises InvalidArgument (naming the flag) on a bad one."""
    out: dict[str, Any] = {}
    if args.kernel_backend is not None:
        out["backend"] = args.kernel_backend
    if args.kernel_device is not None:
        out["device"] = args.kernel_device
    if out:
        backend, device = out.get("backend", "numpy"), out.get("device", "cpu")
        if "device" in out and "backend" not in out and device != "cpu":
            backend = "torch"  # --kernel-device cuda alone means the torch backend
            out["backend"] = backend
        check_placement("--kernel-backend/--kernel-device", backend, device)
    if args.kernel_group is not None:
        groups = [parse_group(g) for g in args.kernel_group]
        out["groups"] = {g: {"backend": b, "device": d} for g, b, d in groups}
        if len(out["groups"]) != len(groups):
            raise InvalidArgument(f"--kernel-group names a group twice: {args.kernel_group}")
    return out


def set_kernel_placement(store: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """Write backend/device/groups into the store's kernel spec (the model stays); returns the spec."""
    if not overrides:
        raw = store.kv_get(*KERNEL_SPEC_KEY)
        return dict(json.loads(raw)) if raw else dict(DEFAULT_SPEC)
    unknown = set(overrides) - {"backend", "device", "groups"}
    if unknown:
        raise InvalidArgument(f"only backend, device and groups are deployment choices, not {sorted(unknown)}")
    raw = store.kv_get(*KERNEL_SPEC_KEY)
    current = dict(json.loads(raw)) if raw else dict(DEFAULT_SPEC)
    if "backend" in overrides and "device" not in overrides and overrides["backend"] == "numpy":
        current["device"] = "cpu"  # numpy runs on the CPU only
    spec = KernelSpec.from_dict({**current, **overrides})  # validates the result as a whole
    d = spec.to_dict()
    out = {k: v for k, v in d.items() if k in current or k in overrides}  # keep the stored dict's shape
    store.kv_put(*KERNEL_SPEC_KEY, json.dumps(out, sort_keys=True).encode())
    return out
