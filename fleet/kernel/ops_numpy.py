"""numpy backend: the decoder math on one fixed-shape row tile.

Every per-token op runs on a full tile of `T` rows (zero rows pad it), so BLAS always sees the
same shapes and a token always sits in the same row slot (its absolute position mod T). Attention
for tile t reduces over the fixed key range [0, Lk(t)) with masked entries at -inf (exp -> exact 0),
so every shape depends only on t — never on how the caller chunked the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from threadpoolctl import ThreadpoolController

from fleet.kernel.config import ModelConfig
from fleet.kernel.rope import rope_np, tables
from fleet.kernel.weights import Weights

# kv_io(layer, k [KV,T,hd] post-RoPE, kraw [KV,T,hd] pre-RoPE, v [KV,T,hd]) -> (K, V) each [KV, Lk, hd]
KvIO = Callable[[int, Any, Any, Any], tuple[Any, Any]]

_TPC: ThreadpoolController | None = None


def _controller() -> ThreadpoolController:
    global _TPC
    if _TPC is None:
        _TPC = ThreadpoolController()
    return _TPC


def _cat_bias(parts: list[np.ndarray | None], sizes: list[int]) -> np.ndarray | None:
    if all(p is None for p in parts):
        return None
    return np.concatenate(
        [np.zeros(n, np.float32) if p is None else p for p, n in zip(parts, sizes, strict=True)]
    )


def _add(x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x + bias, or x itself when the layer has no bias (no extra op: bits unchanged)."""
    return x if bias is None else x + bias


class NumpyOps:
    """Decoder math and array primitives for the numpy backend (CPU, fp32, pinned BLAS threads)."""

    name = "numpy"

    def __init__(self, cfg: ModelConfig, w: Weights, threads: int = 1, device: str = "cpu") -> None:
        self.cfg, self.threads, self.device = cfg, threads, "cpu"
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.embed_w = w.embed  # [V, dim]
        self.wqkv = [
            np.ascontiguousarray(np.concatenate([L.wq, L.wk, L.wv]).T) for L in w.layers
        ]  # [dim, (H+2KV)hd]
        self.bqkv = [_cat_bias([L.bq, L.bk, L.bv], [H * hd, KV * hd, KV * hd]) for L in w.layers]
        self.wo = [np.ascontiguousarray(L.wo.T) for L in w.layers]  # [H*hd, dim]
        self.bo = [L.bo for L in w.layers]
        self.wgu = [np.ascontiguousarray(np.concatenate([L.w_gate, L.w_up]).T) for L in w.layers]  # [dim, 2F]
        self.bgu = [_cat_bias([L.b_gate, L.b_up], [cfg.hidden_dim] * 2) for L in w.layers]
        self.wd = [np.ascontiguousarray(L.w_down.T) for L in w.layers]  # [F, dim]
        self.bd = [L.b_down for L in w.layers]
        self.n1 = [L.attn_norm for L in w.layers]
        self.n2 = [L.mlp_norm for L in w.layers]
        self.final_norm = w.final_norm
        self.lm_head = np.ascontiguousarray(w.lm_head.T)  # [dim, V]
        self.cos, self.sin = tables(cfg, cfg.max_context + 1024)  # [P, hd/2] float32 (+ tile slack)
        self.scale = np.float32(1.0 / np.sqrt(hd))
        self._mask_key: tuple[int, int, int] | None = None
        self._mask = np.zeros((0, 0), bool)

    # -- array primitives (the cache code is backend-agnostic through these) --
    @contextmanager
    def limit(self) -> Iterator[None]:
        """Pin BLAS to the kernel's thread count (the caller's OMP settings change nothing)."""
        with _controller().limit(limits=self.threads, user_api="blas"):
            yield

    def zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def copy(self, a: np.ndarray) -> np.ndarray:
        return np.array(a, dtype=np.float32, copy=True)

    def cat(self, arrs: list[np.ndarray], axis: int) -> np.ndarray:
        return np.concatenate(arrs, axis=axis)

    def to_numpy(self, a: np.ndarray) -> np.ndarray:
        return a

    def from_numpy(self, a: np.ndarray) -> np.ndarray:
        return a

    def rope(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """x [..., P, hd] pre-RoPE at `positions` [P] -> post-RoPE (bit-identical to prefill's)."""
        return rope_np(x, self.cos[positions], self.sin[positions])

    # -- model --
    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)  # [T, 1]
        out: np.ndarray = x * (np.float32(1.0) / np.sqrt(var + np.float32(self.cfg.norm_eps))) * w
        return out

    def embed(self, ids: np.ndarray, slot0: int, T: int) -> np.ndarray:
        """Tile input [T, dim]: embeddings at rows slot0.., zeros elsewhere."""
        x = np.zeros((T, self.cfg.dim), np.float32)
        x[slot0 : slot0 + len(ids)] = self.embed_w[ids]
        return x

    def _mask_for(self, pos0: int, T: int, Lk: int) -> np.ndarray:
        if self._mask_key != (pos0, T, Lk):
            q = np.arange(T)[:, None]  # [T, 1] query offset in the tile
            self._mask = np.arange(Lk - pos0)[None, :] > q  # [T, Lk-pos0] True = key after query
            self._mask_key = (pos0, T, Lk)
        return self._mask

    def layer(self, x: np.ndarray, l: int, pos0: int, kv_io: KvIO) -> np.ndarray:
        """One decoder layer on tile x [T, dim] whose row r holds absolute position pos0 + r."""
        cfg = self.cfg
        T, H, KV, G, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.n_groups, cfg.head_dim
        h = self._norm(x, self.n1[l])  # [T, dim]
        qkv = h @ self.wqkv[l]  # [T, (H+2KV)*hd]
        qkv = _add(qkv, self.bqkv[l])
        cos, sin = self.cos[pos0 : pos0 + T], self.sin[pos0 : pos0 + T]  # [T, hd/2]
        q = qkv[:, : H * hd].reshape(T, KV, G, hd).transpose(1, 2, 0, 3)  # [KV, G, T, hd]
        q = rope_np(q, cos, sin).reshape(KV, G * T, hd) * self.scale  # [KV, G*T, hd]
        kraw = np.ascontiguousarray(
            qkv[:, H * hd : (H + KV) * hd].reshape(T, KV, hd).transpose(1, 0, 2)
        )  # [KV,T,hd]
        v = np.ascontiguousarray(qkv[:, (H + KV) * hd :].reshape(T, KV, hd).transpose(1, 0, 2))  # [KV, T, hd]
        K, V = kv_io(l, rope_np(kraw, cos, sin), kraw, v)  # [KV, Lk, hd] each
        s = np.matmul(q, K.transpose(0, 2, 1)).reshape(KV, G, T, -1)  # [KV, G, T, Lk]
        # keys < pos0 are visible to every row of the tile: mask only the tail [pos0, Lk)
        np.copyto(s[..., pos0:], np.float32(-np.inf), where=self._mask_for(pos0, T, s.shape[-1]))
        np.subtract(s, s.max(axis=-1, keepdims=True), out=s)
        np.exp(s, out=s)  # masked -> exact 0
        den = s.sum(axis=-1, keepdims=True).reshape(KV, G * T, 1)  # [KV, G*T, 1]
        o = np.matmul(s.reshape(KV, G * T, -1), V) / den  # [KV, G*T, hd]: normalise after P@V (hd < Lk)
        o = o.reshape(KV, G, T, hd).transpose(2, 0, 1, 3).reshape(T, H * hd)  # [T, H*hd]
        a = o @ self.wo[l]  # [T, dim]
        x = x + _add(a, self.bo[l])
        gu = self._norm(x, self.n2[l]) @ self.wgu[l]  # [T, 2F]
        gu = _add(gu, self.bgu[l])
        F = cfg.hidden_dim
        g = gu[:, :F]
        m = (g / (np.float32(1.0) + np.exp(-g))) * gu[:, F:]  # SwiGLU [T, F]
        d = m @ self.wd[l]  # [T, dim]
        out: np.ndarray = x + _add(d, self.bd[l])
        return out

    def logits(self, row: np.ndarray) -> np.ndarray:
        """Next-token logits [V] for one final hidden row [dim] (always shape [1, dim] -> fixed)."""
        h = self._norm(row[None, :], self.final_norm)  # [1, dim]
        out: np.ndarray = np.asarray((h @ self.lm_head)[0], dtype=np.float32)  # [V]
        return out

    def blas_info(self) -> str:
        info = [i for i in _controller().info() if i.get("user_api") == "blas"]
        return ", ".join(
            f"{i.get('internal_api')} {i.get('version')} {i.get('architecture', '')}".strip() for i in info
        )
