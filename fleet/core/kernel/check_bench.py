"""The kernels, token streams and controls the exactness checks of one run share (fleet/core/kernel/exactness.py
runs the checks): seeded token ids, a row's verdict, and a kernel twin whose embedding is 1 ulp off."""

from __future__ import annotations

from typing import Any

import numpy as np

from fleet.core.kernel.checks import ExactnessCheck
from fleet.core.kernel.config import ModelConfig
from fleet.core.kernel.kernel import Kernel
from fleet.core.kernel.types import max_abs_delta


def random_ids(seed: int, n: int, vocab: int) -> list[int]:
    """`n` token ids in [0, `vocab`), seeded."""
    out: list[int] = np.random.default_rng(seed).integers(0, vocab, n).tolist()
    return out


def exact_row(name: str, value: float, control: float, ulp: float | None, note: str = "") -> ExactnessCheck:
    """An "== 0" row: it holds when `value` is 0 and its control (and the 1-ulp one, if measured) is not."""
    ok = value == 0.0 and control > 0 and (ulp is None or ulp > 0)
    return ExactnessCheck(name, "== 0", value, control, ok, note, ulp)


def nudge_embedding(k: Kernel, tok: int) -> None:
    """Move one element of token `tok`'s embedding up by one ulp (in place, this kernel only)."""
    e = k.ops.embed_w
    if isinstance(e, np.ndarray):
        e[tok, 0] = np.nextafter(e[tok, 0], np.float32(np.inf))
    else:
        import torch

        e[tok, 0] = torch.nextafter(e[tok, 0], torch.tensor(float("inf"), device=e.device))


class Bench:
    """Kernels and token streams shared by the checks of one run."""

    def __init__(self, backend: str, device: str, threads: int, seed: int) -> None:
        self.kw = dict(seed=seed, backend=backend, device=device, threads=threads)
        self.kernels: dict[tuple[int, int | None], Kernel] = {}
        V = ModelConfig.tiny().vocab_size
        self.pre, self.span, self.post, self.query = (
            random_ids(s, n, V) for s, n in ((1, 45), (2, 13), (3, 37), (4, 6))
        )

    def kernel(self, n_layers: int = 2, nudged: int | None = None) -> Kernel:
        """The shared kernel, or (nudged=tok) a twin whose embedding of `tok` is 1 ulp off."""
        key = (n_layers, nudged)
        if key not in self.kernels:
            k = Kernel.synthetic(ModelConfig.tiny(n_layers=n_layers), **self.kw)  # type: ignore[arg-type]
            if nudged is not None:
                nudge_embedding(k, nudged)
            self.kernels[key] = k
        return self.kernels[key]

    def run(self, tokens: list[int], n_layers: int = 2, nudged: bool = False) -> np.ndarray:
        s = self.kernel(n_layers, self.query[-1] if nudged else None).session()
        s.append(tokens)
        return s.append(self.query)

    def ulp(self, tokens: list[int], ref: np.ndarray, n_layers: int = 2) -> float:
        """The 1-ulp control: `tokens` + query with the last token's embedding 1 ulp off, vs ref.

        NOTE: the last token, because its own embedding feeds the logits through the residual
        stream; a 1-ulp change further back can round away inside one attention sum."""
        return max_abs_delta(self.run(tokens, n_layers, nudged=True), ref)

    def evicted(self, mode: str, n_layers: int) -> tuple[np.ndarray, Any]:
        s = self.kernel(n_layers).session()
        s.append(self.pre + self.span + self.post)
        r = s.evict(len(self.pre), len(self.span), mode=mode)
        return s.append(self.query), r
