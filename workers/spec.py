"""Which kernel a worker builds: a small, serialisable spec (the same in every actor)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fleet.errors import InvalidArgument
from fleet.kernel import ByteTokenizer, Kernel, ModelConfig
from fleet.kernel.hf_tokenizer import HFTokenizer


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
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in ("synthetic", "pretrained"):
            raise InvalidArgument(f"kernel kind must be 'synthetic' or 'pretrained', got {self.kind!r}")
        if self.kind == "pretrained" and not self.path:
            raise InvalidArgument("a pretrained kernel spec needs a checkpoint path")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = dict(self.config)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | KernelSpec) -> KernelSpec:
        if isinstance(d, KernelSpec):
            return d
        d = dict(d)
        d["config"] = tuple(sorted(dict(d.get("config") or {}).items()))
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise InvalidArgument(f"unknown kernel spec fields: {sorted(unknown)}")
        return cls(**d)


@lru_cache(maxsize=4)
def make_kernel(spec: KernelSpec) -> Kernel:
    """Build (once per process) the kernel a spec names."""
    kw = dict(block_size=spec.block_size, tile_size=spec.tile_size, threads=spec.threads)
    if spec.kind == "pretrained":
        return Kernel.from_pretrained(spec.path, backend=spec.backend, device=spec.device, **kw)
    cfg = ModelConfig.tiny(**dict(spec.config))
    return Kernel.synthetic(cfg, seed=spec.seed, backend=spec.backend, device=spec.device, **kw)


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
