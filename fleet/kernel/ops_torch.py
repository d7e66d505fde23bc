"""torch backend (CPU or CUDA): the same fixed-shape tile algorithm as ops_numpy, in torch.

Weights come from the same numpy arrays as the numpy backend. Thread count is pinned with
torch.set_num_threads inside `limit()` (restored afterwards). Exactness across chunkings is
aimed for the same way (fixed shapes per tile); the tests report the measured max|Δ|.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from fleet.errors import InvalidArgument
from fleet.kernel.config import ModelConfig
from fleet.kernel.ops_numpy import KvIO, _cat_bias
from fleet.kernel.rope import tables
from fleet.kernel.weights import Weights


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., P, hd] pre-RoPE, cos/sin [P, hd/2] -> post-RoPE (rotate-half, elementwise only)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _add(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x + bias, or x itself when the layer has no bias (no extra op: bits unchanged)."""
    return x if bias is None else x + bias


class TorchOps:
    """Decoder math and array primitives for the torch backend."""

    name = "torch"

    def __init__(self, cfg: ModelConfig, w: Weights, threads: int = 1, device: str = "cpu") -> None:
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidArgument(f"device {device!r} requested but torch sees no CUDA device")
        if not (device == "cpu" or device.startswith("cuda")):
            raise InvalidArgument(f"torch backend device must be 'cpu' or 'cuda[:N]', got {device!r}")
        self.cfg, self.threads, self.device = cfg, threads, device
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(device)

        def t_opt(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else t(a)

        self.embed_w = t(w.embed)
        self.wqkv = [t(np.concatenate([L.wq, L.wk, L.wv]).T) for L in w.layers]  # [dim, (H+2KV)hd]
        self.bqkv = [t_opt(_cat_bias([L.bq, L.bk, L.bv], [H * hd, KV * hd, KV * hd])) for L in w.layers]
        self.wo = [t(L.wo.T) for L in w.layers]  # [H*hd, dim]
        self.bo = [t_opt(L.bo) for L in w.layers]
        self.wgu = [t(np.concatenate([L.w_gate, L.w_up]).T) for L in w.layers]  # [dim, 2F]
        self.bgu = [t_opt(_cat_bias([L.b_gate, L.b_up], [cfg.hidden_dim] * 2)) for L in w.layers]
        self.wd = [t(L.w_down.T) for L in w.layers]  # [F, dim]
        self.bd = [t_opt(L.b_down) for L in w.layers]
        self.n1 = [t(L.attn_norm) for L in w.layers]
        self.n2 = [t(L.mlp_norm) for L in w.layers]
        self.final_norm = t(w.final_norm)
        self.lm_head = t(w.lm_head.T)  # [dim, V]
        cos, sin = tables(cfg, cfg.max_context + 1024)
        self.cos, self.sin = t(cos), t(sin)  # [P, hd/2]
        self.scale = float(np.float32(1.0 / np.sqrt(hd)))
        self._mask_key: tuple[int, int, int] | None = None
        self._mask: torch.Tensor | None = None

    @contextmanager
    def limit(self) -> Iterator[None]:
        """Pin torch's intra-op threads to the kernel's count for the duration (then restore)."""
        prev, tf32 = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
        torch.set_num_threads(self.threads)
        torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: fp32 means fp32 on CUDA too (HF parity)
        try:
            with torch.no_grad():
                yield
        finally:
            torch.set_num_threads(prev)
            torch.backends.cuda.matmul.allow_tf32 = tf32

    def blas_info(self) -> str:
        cuda = torch.cuda.get_device_name(self.device) if self.device.startswith("cuda") else ""
        return f"torch {torch.__version__} {cuda}".strip()

    def zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32, device=self.device)

    def copy(self, a: torch.Tensor) -> torch.Tensor:
        return a.clone()

    def cat(self, arrs: list[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.cat(arrs, dim=axis)

    def to_numpy(self, a: torch.Tensor) -> np.ndarray:
        return a.detach().cpu().numpy()

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        with warnings.catch_warnings():  # read-only arrays are adopted zero-copy; we never write them (CoW)
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a).to(self.device)

    def rope(self, x: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
        idx = torch.from_numpy(np.asarray(positions, np.int64)).to(self.device)
        return rope_torch(x, self.cos[idx], self.sin[idx])

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = (x * x).mean(dim=-1, keepdim=True)  # [T, 1]
        return x * (1.0 / torch.sqrt(var + self.cfg.norm_eps)) * w

    def embed(self, ids: np.ndarray, slot0: int, T: int) -> torch.Tensor:
        x = torch.zeros((T, self.cfg.dim), dtype=torch.float32, device=self.device)
        x[slot0 : slot0 + len(ids)] = self.embed_w[
            torch.from_numpy(np.asarray(ids, np.int64)).to(self.device)
        ]
        return x

    def _mask_for(self, pos0: int, T: int, Lk: int) -> torch.Tensor:
        if self._mask_key != (pos0, T, Lk) or self._mask is None:
            q = torch.arange(T, device=self.device)[:, None]  # [T, 1] query offset in the tile
            self._mask = (
                torch.arange(Lk - pos0, device=self.device)[None, :] > q
            )  # [T, Lk-pos0] True = masked
            self._mask_key = (pos0, T, Lk)
        return self._mask

    def layer(self, x: torch.Tensor, l: int, pos0: int, kv_io: KvIO) -> torch.Tensor:
        cfg = self.cfg
        T, H, KV, G, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.n_groups, cfg.head_dim
        qkv = self._norm(x, self.n1[l]) @ self.wqkv[l]  # [T, (H+2KV)*hd]
        qkv = _add(qkv, self.bqkv[l])
        cos, sin = self.cos[pos0 : pos0 + T], self.sin[pos0 : pos0 + T]  # [T, hd/2]
        q = qkv[:, : H * hd].reshape(T, KV, G, hd).permute(1, 2, 0, 3)  # [KV, G, T, hd]
        q = rope_torch(q, cos, sin).reshape(KV, G * T, hd) * self.scale  # [KV, G*T, hd]
        kraw = qkv[:, H * hd : (H + KV) * hd].reshape(T, KV, hd).permute(1, 0, 2).contiguous()  # [KV, T, hd]
        v = qkv[:, (H + KV) * hd :].reshape(T, KV, hd).permute(1, 0, 2).contiguous()  # [KV, T, hd]
        K, V = kv_io(l, rope_torch(kraw, cos, sin), kraw, v)  # [KV, Lk, hd]
        s = torch.matmul(q, K.transpose(1, 2)).reshape(KV, G, T, -1)  # [KV, G, T, Lk]
        s[..., pos0:].masked_fill_(
            self._mask_for(pos0, T, s.shape[-1]), float("-inf")
        )  # keys < pos0: visible
        s = s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # masked -> exact 0
        den = s.sum(dim=-1, keepdim=True).reshape(KV, G * T, 1)  # [KV, G*T, 1]
        o = torch.matmul(s.reshape(KV, G * T, -1), V) / den  # [KV, G*T, hd]: normalise after P@V
        o = o.reshape(KV, G, T, hd).permute(2, 0, 1, 3).reshape(T, H * hd)  # [T, H*hd]
        a = o @ self.wo[l]  # [T, dim]
        x = x + _add(a, self.bo[l])
        gu = self._norm(x, self.n2[l]) @ self.wgu[l]  # [T, 2F]
        gu = _add(gu, self.bgu[l])
        F = cfg.hidden_dim
        g = gu[:, :F]
        m = (g / (1.0 + torch.exp(-g))) * gu[:, F:]  # SwiGLU [T, F]
        d = m @ self.wd[l]  # [T, dim]
        out: torch.Tensor = x + _add(d, self.bd[l])
        return out

    def logits(self, row: torch.Tensor) -> np.ndarray:
        h = self._norm(row[None, :], self.final_norm)  # [1, dim]
        return (h @ self.lm_head)[0].detach().cpu().numpy().astype(np.float32)  # [V]
