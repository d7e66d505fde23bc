"""Kernel: a model (weights + backend) that opens sessions. See docs/kernel.md for the contract."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fleet.core.errors import InvalidArgument
from fleet.core.kernel.cache import Block, PagedKV
from fleet.core.kernel.config import ModelConfig
from fleet.core.kernel.inputs import as_int
from fleet.core.kernel.session import Session
from fleet.core.kernel.types import PrefixKV
from fleet.core.kernel.weights import Weights, load_pretrained, synthetic

BACKENDS = ("numpy", "torch")
MAX_TILE = 1024
DEFAULT_TILE = 64  # rows per fixed-shape tile (bench/kernel_prefill.py: prefill vs decode trade-off)
DEFAULT_BLOCK = 16  # tokens per cache block


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _make_ops(backend: str, cfg: ModelConfig, w: Weights, threads: int, device: str) -> Any:
    if backend == "numpy":
        if device != "cpu":
            raise InvalidArgument(f"the numpy backend runs on cpu only, got device={device!r}")
        from fleet.core.kernel.ops_numpy import NumpyOps

        return NumpyOps(cfg, w, threads, device)
    if backend == "torch":
        from fleet.core.kernel.ops_torch import TorchOps

        return TorchOps(cfg, w, threads, device)
    raise InvalidArgument(f"unknown backend {backend!r}; supported: {BACKENDS}")


@functools.cache
def code_path(backend: str, device: str) -> str:
    """The code path the backend's math libraries take in this process, as they report it.

    numpy (both backends: RoPE tables are numpy float64 sin/cos): its version and the SIMD targets its
    dispatch may use (enabled CPU features among its baseline and dispatch targets;
    NPY_DISABLE_CPU_FEATURES removes some). numpy backend: numpy's own BLAS as threadpoolctl reports it
    (library, version, core type such as SkylakeX or Haswell, which OPENBLAS_CORETYPE forces, threading
    layer). torch backend: its version, on CPU the ATen capability (ATEN_CPU_CAPABILITY) and the ISA caps
    of its GEMM libraries (MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA), on CUDA the device, its compute
    capability and the CUDA version. Cached per process: it is fixed once the libraries are loaded, so
    kernels of one process that compute the same bits get the same model_id.
    """
    try:
        import numpy._core._multiarray_umath as um  # numpy >= 2
    except ImportError:  # numpy 1.26
        import numpy.core._multiarray_umath as um
    feats, targets = um.__cpu_features__, [*um.__cpu_baseline__, *um.__cpu_dispatch__]
    parts = [f"numpy {np.__version__} simd={'+'.join(sorted(t for t in targets if feats.get(t)))}"]
    if backend == "numpy":
        parts.append(f"blas={_numpy_blas()}")
    elif backend == "torch":
        import torch

        parts.append(f"torch {torch.__version__}")
        if device.startswith("cuda"):
            cap = torch.cuda.get_device_capability(device)
            parts.append(f"{torch.cuda.get_device_name(device)} sm{cap[0]}{cap[1]} cuda {torch.version.cuda}")
        else:
            isa = ",".join(
                f"{v}={os.environ.get(v, '')}" for v in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
            )
            parts.append(f"cpu={torch.backends.cpu.get_cpu_capability()} {isa}")
    return "; ".join(parts)


def _numpy_blas() -> str:
    """numpy's own BLAS (the library under numpy's install, not one another package loaded later)."""
    from threadpoolctl import threadpool_info

    blas = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    root = os.path.dirname(os.path.dirname(os.path.realpath(np.__file__)))
    own = [
        i
        for i in blas
        if os.path.realpath(i.get("filepath", "")).startswith(
            (os.path.join(root, "numpy"), os.path.join(root, "numpy.libs"))
        )
    ]
    return ", ".join(
        f"{i.get('internal_api')} {i.get('version')} {i.get('architecture', '')} {i.get('threading_layer', '')}"
        for i in sorted(own or blas, key=lambda i: str(i.get("filepath")))
    )


def _geometry(name: str, value: Any, upper: int | None = None) -> int:
    """`value` as a Python int in [1, upper] (any integer type; not a bool), or InvalidArgument naming `name`."""
    n = as_int(value)
    if n is None or n < 1 or (upper is not None and n > upper):
        rule = "a positive integer" if upper is None else f"an integer in [1, {upper}]"
        raise InvalidArgument(f"{name} must be {rule} (not a bool), got {value!r}")
    return n


class Kernel:
    """A Llama-family decoder bound to one backend, with the cache geometry its sessions use.

    Exactness (batch invariance) holds within one kernel: same backend, device, CPU code path,
    `threads`, `tile_size` and `block_size` (all recorded in `env()` and folded into `model_id`).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Weights,
        backend: str = "numpy",
        device: str = "cpu",
        threads: int = 1,
        block_size: int = DEFAULT_BLOCK,
        tile_size: int = DEFAULT_TILE,
    ) -> None:
        # NOTE: as_int, as the session's arguments: isinstance(x, int) refused np.int64(16) ("block_size must be a
        # positive integer, got 16") and took True for 1
        threads, block_size, tile_size = (_geometry("threads", threads), _geometry("block_size", block_size),
                                          _geometry("tile_size", tile_size, MAX_TILE))
        self.config, self.weights = cfg, weights
        self.backend, self.block_size, self.tile_size, self.threads = backend, block_size, tile_size, threads
        self.ops = _make_ops(backend, cfg, weights, threads, device)
        self.device = self.ops.device
        self.block_bytes = cfg.block_bytes(block_size)
        # what decides the bits: config, weights, backend, device, dtype (fp32 throughout), the CPU code
        # path of the libraries (code_path), threads and geometry; a PrefixKV is adopted only on an equal id
        ident = (
            f"{cfg!r}|{weights.source}|{backend}|{self.device}|float32|{code_path(backend, self.device)}"
            f"|{threads}|{block_size}|{tile_size}"
        )
        self.model_id = hashlib.sha256(ident.encode()).hexdigest()[:16]
        self.checkpoint = ""  # the checkpoint directory of a pretrained kernel (its tokenizer lives there)

    @classmethod
    def synthetic(
        cls, cfg: ModelConfig, seed: int = 0, backend: str = "numpy", device: str = "cpu", **kw: Any
    ) -> Kernel:
        """Seeded random weights (np.random.default_rng(seed)): identical in every process and backend."""
        return cls(cfg, synthetic(cfg, seed), backend, device, **kw)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, backend: str = "numpy", device: str = "cpu", **kw: Any
    ) -> Kernel:
        """Load a local Hugging Face checkpoint directory (config.json + *.safetensors).

        Raises:
            InvalidArgument: missing files, or an architecture other than Llama/Qwen2/Mistral.
        """
        p = Path(path)
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise InvalidArgument(f"{p}: no config.json (expected a Hugging Face checkpoint directory)")
        try:
            hf = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise InvalidArgument(f"{cfg_file}: not valid JSON ({e})") from e
        cfg = ModelConfig.from_hf(hf)
        kernel = cls(cfg, load_pretrained(p, cfg), backend, device, **kw)
        kernel.checkpoint = str(p)
        return kernel

    def env(self) -> dict[str, Any]:
        """What the exactness witnesses hold for: backend, device, CPU, threads, BLAS, geometry."""
        return {
            "backend": self.backend,
            "device": self.device,
            "cpu": cpu_name(),
            "threads": self.threads,
            "blas": self.ops.blas_info() if hasattr(self.ops, "blas_info") else "",
            "numpy": np.__version__,
            "tile_size": self.tile_size,
            "block_size": self.block_size,
            "model_id": self.model_id,
            "weights": self.weights.source,
            "arch": self.config.arch,
        }

    def session(self, prefix: PrefixKV | None = None) -> Session:
        """A new empty session, or one that adopts `prefix`'s blocks zero-copy (copy-on-write).

        Raises:
            InvalidArgument: the prefix comes from another model/geometry or is malformed.
        """
        shape = (self.config.n_layers, self.config.n_kv_heads, self.block_size, self.config.head_dim)
        if prefix is None:
            return Session(self, PagedKV(self.ops, shape), [])
        tokens = self._check_prefix(prefix, shape)
        blocks = [Block(self.ops.from_numpy(a), external=True) for a in prefix.blocks]
        return Session(self, PagedKV(self.ops, shape, blocks), tokens)

    def _check_prefix(self, prefix: PrefixKV, shape: tuple[int, int, int, int]) -> list[int]:
        """Raise InvalidArgument for a prefix this kernel cannot adopt; else its tokens as Python ints."""
        if not isinstance(prefix, PrefixKV):
            raise InvalidArgument(f"prefix must be a PrefixKV, got {type(prefix).__name__}")
        if prefix.model_id != self.model_id:
            raise InvalidArgument(
                f"prefix was produced by model {prefix.model_id}, this kernel is {self.model_id}: "
                "KV caches are not portable across weights, backends, devices, CPU code paths, threads "
                "or cache geometries (model_id folds them all in)"
            )
        if not (isinstance(prefix.tokens, Sequence | np.ndarray) and isinstance(prefix.blocks, Sequence)):
            # NOTE: len() of a None raised TypeError, a block given as a list AttributeError (found by review)
            raise InvalidArgument(f"prefix tokens and blocks must be sequences, got {type(prefix.tokens).__name__} "
                                  f"and {type(prefix.blocks).__name__}")
        if prefix.block_size != self.block_size or len(prefix.tokens) != prefix.num_blocks * self.block_size:
            raise InvalidArgument("prefix tokens must fill whole blocks of this kernel's block_size")
        for a in prefix.blocks:
            if not isinstance(a, np.ndarray):
                raise InvalidArgument(f"prefix blocks must be numpy arrays (read-only views), got {type(a).__name__}")
            if tuple(a.shape) != (3, *shape) or a.dtype != np.float32:
                raise InvalidArgument(
                    f"prefix block has shape {a.shape} {a.dtype}, expected {(3, *shape)} float32"
                )
        V, tokens = self.config.vocab_size, []
        for tok in prefix.tokens:  # NOTE: float and bool ids were adopted as they were (found by review)
            i = as_int(tok)
            if i is None:
                raise InvalidArgument(f"prefix token ids must be integers (not float, bool, text): {tok!r}")
            if not 0 <= i < V:
                raise InvalidArgument(f"prefix holds token ids outside the vocabulary [0, {V})")
            tokens.append(i)
        return tokens
