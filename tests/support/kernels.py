"""Factories for the kernel contract suite (imported by the tests in this folder)."""

from __future__ import annotations

import functools

import numpy as np

from fleet.core.kernel import Kernel, ModelConfig

BACKENDS = ["numpy", "torch"]


@functools.cache
def make_kernel(backend: str = "numpy", seed: int = 0, tile_size: int = 32, **overrides: object) -> Kernel:
    """A tiny seeded kernel (cached: weights are immutable and sessions are independent)."""
    return Kernel.synthetic(ModelConfig.tiny(**overrides), seed=seed, backend=backend, tile_size=tile_size)


def rand_ids(seed: int, n: int, vocab: int = 512) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()
