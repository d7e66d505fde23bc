"""Which kernel a worker builds: a small, serialisable spec, resolved per node group.

The model (kind, config, seed, path, block_size) is the same on every node, so any node can
regenerate any session from its op log. Where it runs (backend, device, threads) is a deployment
choice per *node group*: a Ray node's group is its `kvfleet.dev/group` label (the chart sets it
from each KubeRay worker group's name; `ray start --labels kvfleet.dev/group=gpu` by hand).

    spec = KernelSpec(backend="numpy", groups=(("gpu", "torch", "cuda"),))
    spec.for_node(row)      # ray.nodes() row -> the node's spec, or None when the node cannot run it

Invariant: a node without a GPU never builds a CUDA kernel (`for_node` answers None: it gets no
kernel host and no session), and the kernel host of a CUDA spec asks Ray for a whole GPU
(`host_gpus`): it owns the device, one CUDA context for all its sessions (Ray hides the devices from
an actor that asks for none).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fleet.core.errors import InvalidArgument
from fleet.core.kernel import BACKENDS, ByteTokenizer, Kernel, ModelConfig
from fleet.core.kernel.hf_tokenizer import HFTokenizer

GROUP_LABEL = "kvfleet.dev/group"
HOST_GPUS = 1.0  # a CUDA kernel host owns its GPU: one context, the weights once, every session on it
_GROUP_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DEVICE_RE = re.compile(r"cpu|cuda(:0)?")  # Ray shows a kernel host only its own GPU, as cuda:0


@dataclass(frozen=True, slots=True)
class KernelSpec:
    """A synthetic (seeded) or pretrained kernel; every process that builds it gets the same model.

    Attributes:
        kind: "synthetic" (ModelConfig.tiny(**config), seeded weights) or "pretrained" (`path`).
        config: ModelConfig.tiny overrides (synthetic only).
    """

    kind: str = "synthetic"
    config: tuple[tuple[str, Any], ...] = ()
    seed: int = 0
    path: str = ""
    backend: str = "numpy"
    device: str = "cpu"
    block_size: int = 16
    tile_size: int = 32
    threads: int = 1
    groups: tuple[tuple[str, str, str], ...] = ()  # (node group, backend, device) overrides

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "pretrained"):
            raise InvalidArgument(f"kernel kind must be 'synthetic' or 'pretrained', got {self.kind!r}")
        if self.kind == "pretrained" and not self.path:
            raise InvalidArgument("a pretrained kernel spec needs a checkpoint path")
        check_placement("the kernel", self.backend, self.device)
        for group, backend, device in self.groups:
            if not isinstance(group, str) or not _GROUP_RE.fullmatch(group):
                raise InvalidArgument(f"node group {group!r} must be a DNS label (a-z, 0-9, '-'), e.g. 'gpu'")
            check_placement(f"node group {group!r}", backend, device)
        if len({g for g, _, _ in self.groups}) != len(self.groups):
            raise InvalidArgument(f"a node group is named twice in {[g for g, _, _ in self.groups]}")

    @property
    def needs_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def host_gpus(self) -> float:
        """The GPUs the kernel host of this spec asks Ray for (0 on CPU)."""
        return HOST_GPUS if self.needs_gpu else 0.0

    def on_cpu(self) -> KernelSpec:
        """The same model on numpy/CPU: what a CPU-only process (the controller: its tokenizer
        and the block geometry) builds."""
        return dataclasses.replace(self, backend="numpy", device="cpu", groups=())

    def for_group(self, group: str) -> KernelSpec:
        """The spec a node of `group` runs (the default's backend/device unless overridden)."""
        for g, backend, device in self.groups:
            if g == group:
                return dataclasses.replace(self, backend=backend, device=device, groups=())
        return dataclasses.replace(self, groups=())

    def for_node(self, node: dict[str, Any]) -> KernelSpec | None:
        """The spec of a `ray.nodes()` row, or None when that node has no GPU for a CUDA spec."""
        spec = self.for_group(node_group(node))
        if spec.needs_gpu and float(node.get("Resources", {}).get("GPU", 0.0)) < 1.0:
            return None
        return spec

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = dict(self.config)
        d["groups"] = {g: {"backend": b, "device": dev} for g, b, dev in self.groups}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | KernelSpec) -> KernelSpec:
        if isinstance(d, KernelSpec):
            return d
        d = dict(d)
        d.pop("extra", None)  # NOTE: compat: specs stored before it was removed carry an unused, empty `extra`
        d["config"] = tuple(sorted(dict(d.get("config") or {}).items()))
        d["groups"] = _groups(d.get("groups") or {})
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise InvalidArgument(f"unknown kernel spec fields: {sorted(unknown)}")
        return cls(**d)


def _groups(raw: Any) -> tuple[tuple[str, str, str], ...]:
    """{group: {backend, device}} (or already a tuple of triples) -> sorted triples."""
    if isinstance(raw, tuple | list):
        if not all(isinstance(t, tuple | list) and len(t) == 3 and all(isinstance(x, str) for x in t) for t in raw):
            raise InvalidArgument(f"kernel spec groups must be (group, backend, device) triples, got {raw!r}")
        return tuple(sorted((str(t[0]), str(t[1]), str(t[2])) for t in raw))
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise InvalidArgument(f"kernel spec groups must map a group to {{backend, device}}, got {raw!r}")
    for g, v in raw.items():  # a misspelt key would silently run the group on numpy/CPU
        if set(v) - {"backend", "device"}:
            raise InvalidArgument(f"node group {g!r}: unknown keys {sorted(set(v) - {'backend', 'device'})}; "
                                  "a group sets only backend and device")
    return tuple(sorted((g, str(v.get("backend", "numpy")), str(v.get("device", "cpu"))) for g, v in raw.items()))


def check_placement(what: str, backend: str, device: str) -> None:
    """Refuse a backend/device pair no kernel can run (before any actor tries)."""
    if backend not in BACKENDS:
        raise InvalidArgument(f"{what}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
        hint = (" (Ray shows each kernel host only the GPU it assigned, as cuda:0; choose GPUs with "
                "node groups and Ray's GPU resources, not a device index)" if str(device).startswith("cuda:") else "")
        raise InvalidArgument(f"{what}: device must be 'cpu' or 'cuda', got {device!r}{hint}")
    if backend == "numpy" and device != "cpu":
        raise InvalidArgument(f"{what}: the numpy backend runs on 'cpu' only (got {device!r}); use torch for CUDA")


def node_group(node: dict[str, Any]) -> str:
    """A `ray.nodes()` row's node group: its `kvfleet.dev/group` label ('' when unlabelled)."""
    return str((node.get("Labels") or {}).get(GROUP_LABEL, ""))


def parse_group(text: str) -> tuple[str, str, str]:
    """`GROUP=BACKEND:DEVICE` (the --kernel-group flag), e.g. `gpu=torch:cuda`."""
    group, sep, rest = text.partition("=")
    backend, sep2, device = rest.partition(":")
    if not (sep and sep2 and group and backend and device):
        raise InvalidArgument(f"--kernel-group {text!r}: expected GROUP=BACKEND:DEVICE, e.g. gpu=torch:cuda")
    check_placement(f"--kernel-group {group!r}", backend, device)
    return group, backend, device


def model_config(spec: KernelSpec) -> ModelConfig:
    """The spec's model geometry without its weights (a pretrained checkpoint's config.json only)."""
    if spec.kind == "pretrained":
        import json
        from pathlib import Path

        try:
            return ModelConfig.from_hf(json.loads((Path(spec.path) / "config.json").read_text()))
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"{spec.path}: no readable config.json ({e})") from e
    return ModelConfig.tiny(**dict(spec.config))


@lru_cache(maxsize=4)
def make_kernel(spec: KernelSpec) -> Kernel:
    """Build (once per process) the kernel a spec names."""
    kw = dict(block_size=spec.block_size, tile_size=spec.tile_size, threads=spec.threads)
    if spec.kind == "pretrained":
        return Kernel.from_pretrained(spec.path, backend=spec.backend, device=spec.device, **kw)
    cfg = ModelConfig.tiny(**dict(spec.config))
    return Kernel.synthetic(cfg, seed=spec.seed, backend=spec.backend, device=spec.device, **kw)


def pin_threads(kernel: Kernel) -> None:
    """Pin the process's BLAS (numpy) or intra-op (torch) threads to the kernel's count for good.

    NOTE: a host runs many sessions' ops on several threads at once; each op pins the count for its
    duration and restores it after (`ops.limit`). Were the process's count different, one op's restore
    could change the count under another op mid-matmul (threadpoolctl and torch set it per process).
    Pinned once here, every set and restore writes the same value."""
    if kernel.backend == "numpy":
        from threadpoolctl import threadpool_limits

        threadpool_limits(limits=kernel.threads, user_api="blas")
    else:
        import torch

        torch.set_num_threads(kernel.threads)
        torch.backends.cuda.matmul.allow_tf32 = False  # what every op sets (fp32 means fp32)


def make_tokenizer(kernel: Kernel) -> ByteTokenizer | HFTokenizer:
    """The kernel's tokenizer: a pretrained checkpoint's own (tokenizer.json + chat template, from
    its directory, local files only), the byte tokenizer for the synthetic model."""
    if kernel.checkpoint:
        return _hf_tokenizer(kernel.checkpoint, kernel.config.vocab_size)
    return ByteTokenizer(kernel.config.vocab_size)


@lru_cache(maxsize=4)
def _hf_tokenizer(path: str, vocab_size: int) -> HFTokenizer:
    tok = HFTokenizer.from_dir(path)
    if tok.vocab_size > vocab_size:
        raise InvalidArgument(f"{path}: the tokenizer has {tok.vocab_size} ids but the model only "
                              f"{vocab_size} embeddings; the tokenizer files belong to another model")
    return tok
