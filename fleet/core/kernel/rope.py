"""Rotary position embedding tables (θ and Llama-3 / linear `rope_scaling`), computed once.

Tables are computed in float64 and rounded to float32 once, then indexed by absolute position, so
`rope(Kraw[i], i)` is a deterministic elementwise function of (Kraw[i], i): the same bits whether it
runs inside a prefill tile or when a survivor is re-rotated after an eviction.
"""

from __future__ import annotations

import math

import numpy as np

from fleet.core.kernel.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim/2] (float64), with the config's rope scaling applied."""
    hd = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))  # [hd/2]
    sc = cfg.rope_scaling_dict()
    kind = sc.get("rope_type", "default")
    if kind == "linear":
        return base / float(sc["factor"])
    if kind == "llama3":
        return _llama3(base, sc)
    return base


def _llama3(freq: np.ndarray, sc: dict[str, object]) -> np.ndarray:
    """Llama-3.x frequency remapping (as in transformers' `_compute_llama3_parameters`)."""
    factor = float(sc["factor"])  # type: ignore[arg-type]
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])  # type: ignore[arg-type]
    old_len = float(sc["original_max_position_embeddings"])  # type: ignore[arg-type]
    wavelen = 2 * math.pi / freq
    out = np.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, out)


def tables(cfg: ModelConfig, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [num_positions, head_dim/2] float32 (computed in float64, rounded once)."""
    pos = np.arange(num_positions, dtype=np.float64)[:, None]  # [P, 1]
    ang = pos * inv_freq(cfg)[None, :]  # [P, hd/2]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate `x` [..., P, hd] (pre-RoPE) by cos/sin [P, hd/2] (rotate-half convention, as HF).

    Returns the post-RoPE array, same shape. Pure elementwise: no reduction, no shape dependence.
    """
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = np.empty_like(x)
    out[..., :h] = x1 * cos - x2 * sin
    out[..., h:] = x2 * cos + x1 * sin
    return out
