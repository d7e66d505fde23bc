"""numpy backend: the decoder math on one fixed-shape row tile.

Every per-token op runs on a full tile of `T` rows (zero rows pad it), so BLAS always sees the
same shapes and a token always sits in the same row slot (its absolute position mod T). Attention
for tile t reduces over the fixed key range [0, Lk(t)) with masked entries at -inf (exp -> exact 0),
so every shape depends only on t — never on how the caller chunked the tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from threadpoolctl import ThreadpoolController

from fleet.core.kernel.config import ModelConfig
from fleet.core.kernel.l0memo import L0Slots, memo_rows
from fleet.core.kernel.rope import rope_np, tables
from fleet.core.kernel.threads import ThreadPin
from fleet.core.kernel.weights import Weights

_TPC: ThreadpoolController | None = None


def _controller() -> ThreadpoolController:
    global _TPC
    if _TPC is None:
        _TPC = ThreadpoolController()
    return _TPC


# BLAS's thread count is process-wide: one pin for every kernel of the process (fleet/core/kernel/threads.py)
_BLAS_PIN = ThreadPin(lambda n: _controller().limit(limits=n, user_api="blas"),
                      lambda limiter: limiter.restore_original_limits())


def _cat_bias(parts: list[np.ndarray | None], sizes: list[int]) -> np.ndarray | None:
    if all(p is None for p in parts):
        return None
    return np.concatenate(
        [np.zeros(n, np.float32) if p is None else p for p, n in zip(parts, sizes, strict=True)]
    )


def _lin(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """a [T, in] times weight w [out, in]: computed as w @ a^T -> [out, T], returned as a [T, out] view."""
    out: np.ndarray = (w @ a.T).T
    return out


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
        # weights kept [out, in]: `_lin` runs W @ x^T (OpenBLAS is faster that way round for a tile)
        self.wqkv = [
            np.ascontiguousarray(np.concatenate([L.wq, L.wk, L.wv])) for L in w.layers
        ]  # [(H+2KV)hd, dim]
        self.bqkv = [_cat_bias([L.bq, L.bk, L.bv], [H * hd, KV * hd, KV * hd]) for L in w.layers]
        self.wo = [np.ascontiguousarray(L.wo) for L in w.layers]  # [dim, H*hd]
        self.bo = [L.bo for L in w.layers]
        self.wgu = [np.ascontiguousarray(np.concatenate([L.w_gate, L.w_up])) for L in w.layers]  # [2F, dim]
        self.bgu = [_cat_bias([L.b_gate, L.b_up], [cfg.hidden_dim] * 2) for L in w.layers]
        self.wd = [np.ascontiguousarray(L.w_down) for L in w.layers]  # [dim, F]
        self.bd = [L.b_down for L in w.layers]
        self.n1 = [L.attn_norm for L in w.layers]
        self.n2 = [L.mlp_norm for L in w.layers]
        self.final_norm = w.final_norm
        self.lm_head = np.ascontiguousarray(w.lm_head.T)  # [dim, V]
        self.cos, self.sin = tables(cfg, cfg.max_context + 1024)  # [P, hd/2] float32 (+ tile slack)
        self.scale = np.float32(1.0 / np.sqrt(hd))
        self._masks: dict[tuple[int, int], np.ndarray] = {}
        # layer 0, one token at a time: fixed buffers (same shapes, same addresses every call)
        W = (H + 2 * KV) * hd
        self._e1, self._h1 = np.zeros((1, cfg.dim), np.float32), np.zeros((1, cfg.dim), np.float32)
        self._y1 = np.zeros((W, 1), np.float32)
        self._slots = L0Slots(memo_rows(W * 4))
        self._tab = np.zeros((min(self._slots.capacity, 1024), W), np.float32)  # grows to capacity
        self._l0_lock = threading.Lock()

    # -- array primitives (the cache code is backend-agnostic through these) --
    @contextmanager
    def limit(self) -> Iterator[None]:
        """Pin BLAS to the kernel's thread count (the caller's OMP settings change nothing), also while another
        session's pass overlaps this one (`ThreadPin`: the last one out restores the caller's count)."""
        with _BLAS_PIN.hold(self.threads):
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

    def _mask_for(self, T: int, n: int) -> np.ndarray:
        """[T, n] True where key pos0+j is after query pos0+r, for the n keys from the tile's first
        position on (keys before it are visible to every row). Cached per (T, n): immutable."""
        m = self._masks.get((T, n))
        if m is None:
            m = self._masks[(T, n)] = np.arange(n)[None, :] > np.arange(T)[:, None]
        return m

    def _rope_qk(self, qk: np.ndarray, pos0: int) -> np.ndarray:
        """RoPE on q and k heads at once: qk [T, H+KV, hd] (a strided view) -> new [T, H+KV, hd].
        Per element the same products and difference/sum as `rope_np`: K == rope(Kraw) bit for bit."""
        T, h = qk.shape[0], qk.shape[-1] // 2
        cos, sin = self.cos[pos0 : pos0 + T, None], self.sin[pos0 : pos0 + T, None]  # [T, 1, hd/2]
        x1, x2 = qk[..., :h], qk[..., h:]
        out = np.empty(qk.shape, np.float32)
        np.subtract(np.multiply(x1, cos, out=out[..., :h]), x2 * sin, out=out[..., :h])
        np.add(np.multiply(x2, cos, out=out[..., h:]), x1 * sin, out=out[..., h:])
        return out

    def _attend(
        self, q: np.ndarray, K: np.ndarray, V: np.ndarray, pos0: int, T: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """q [KV, G*T, hd] (scaled) over keys K, V [KV, Lk, hd] -> unnormalised P@V [KV, G*T, hd]
        and the softmax denominators [KV, G*T, 1]; masked entries exp to an exact 0."""
        KV, Lk = K.shape[0], K.shape[1]
        s = np.matmul(q, K.transpose(0, 2, 1))  # [KV, G*T, Lk]
        # keys < pos0 are visible to every row of the tile: mask only the tail [pos0, Lk)
        np.copyto(
            s.reshape(KV, -1, T, Lk)[..., pos0:], np.float32(-np.inf), where=self._mask_for(T, Lk - pos0)
        )
        np.subtract(s, s.max(axis=-1, keepdims=True), out=s)
        np.exp(s, out=s)  # masked -> exact 0
        return np.matmul(s, V), s.sum(axis=-1, keepdims=True)

    def _row0(self, tok: int, row: int) -> None:
        """Compute layer 0's fused q/k/v projection (pre-RoPE, bias added) of token `tok` into memo
        row `row` [(H+2KV)*hd].

        NOTE: at layer 0 a token's hidden state is its embedding, so this is a function of the
        token id alone. It is computed alone, in one fixed [1, dim] shape and fixed buffers, never
        inside a tile: a BLAS GEMM may give a row different bits in a different row slot (OpenBLAS
        Haswell kernels do), and `reposition` moves survivors to new slots. Computed this way the
        survivors' layer-0 Kraw/V are a never-saw session's by construction, on every CPU.
        """
        if row >= len(self._tab):  # grow the table (doubling, up to capacity)
            grown = np.zeros(
                (min(self._slots.capacity, max(2 * len(self._tab), row + 1)), self._tab.shape[1]), np.float32
            )
            grown[: len(self._tab)] = self._tab
            self._tab = grown
        self._tab[row] = self._project0(tok)

    def _project0(self, tok: int) -> np.ndarray:
        """Token `tok`'s layer-0 q/k/v projection [(H+2KV)*hd] in the fixed buffers (the caller
        holds `_l0_lock` and copies the result out before the next call)."""
        self._e1[0] = self.embed_w[tok]
        var = np.mean(self._e1 * self._e1, axis=-1, keepdims=True)  # [1, 1]
        np.multiply(
            self._e1 * (np.float32(1.0) / np.sqrt(var + np.float32(self.cfg.norm_eps))),
            self.n1[0],
            out=self._h1,
        )  # [1, dim] RMSNorm
        np.matmul(self.wqkv[0], self._h1.T, out=self._y1)  # [W, 1]
        return self._y1[:, 0] if self.bqkv[0] is None else self._y1[:, 0] + self.bqkv[0]

    def _proj0(self, ids: np.ndarray, slot0: int, T: int) -> np.ndarray:
        """Layer-0 projections of a tile [T, (H+2KV)*hd]: `ids` at rows slot0.., zeros elsewhere."""
        out = np.zeros((T, self._tab.shape[1]), np.float32)
        step = self._slots.capacity // 2
        toks = np.asarray(ids).tolist()
        with self._l0_lock:
            for c in range(0, len(toks), step):
                rows, misses = self._slots.lookup(toks[c : c + step])
                self._slots.fill(misses, self._row0)
                out[slot0 + c : slot0 + c + len(rows)] = self._tab[rows]  # one gather
        return out

    def qkv(
        self, x: np.ndarray, l: int, pos0: int, ids: np.ndarray | None = None, slot0: int = 0
    ) -> tuple[np.ndarray, ...]:
        """Layer l's attention inputs for tile x [T, dim] whose row r holds position pos0 + r.

        At layer 0 pass the tile's token `ids` (at rows slot0..): their projections come from
        `_row0`, slot-invariant by construction.

        Returns:
            q [KV, G*T, hd] (post-RoPE, scaled), then k (post-RoPE), kraw (pre-RoPE), v: [KV, T, hd].
        """
        if l == 0 and ids is not None:
            qkv = self._proj0(ids, slot0, x.shape[0])  # [T, (H+2KV)*hd]
        else:
            qkv = _add(_lin(self._norm(x, self.n1[l]), self.wqkv[l]), self.bqkv[l])  # [T, (H+2KV)*hd]
        return self.split_qkv(qkv, pos0)

    def split_qkv(self, qkv: np.ndarray, pos0: int) -> tuple[np.ndarray, ...]:
        """Fused projections qkv [T, (H+2KV)*hd] of positions pos0.. -> (q, k, kraw, v) as `qkv`."""
        cfg = self.cfg
        T, H, KV, G, hd = qkv.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.n_groups, cfg.head_dim
        rot = self._rope_qk(qkv[:, : (H + KV) * hd].reshape(T, H + KV, hd), pos0)  # [T, H+KV, hd]
        q = np.empty((KV, G, T, hd), np.float32)
        np.multiply(rot[:, :H].reshape(T, KV, G, hd).transpose(1, 2, 0, 3), self.scale, out=q)
        kraw = qkv[:, H * hd : (H + KV) * hd].reshape(T, KV, hd).transpose(1, 0, 2)  # [KV, T, hd] views
        v = qkv[:, (H + KV) * hd :].reshape(T, KV, hd).transpose(1, 0, 2)
        return q.reshape(KV, G * T, hd), rot[:, H:].transpose(1, 0, 2), kraw, v

    def layer0(
        self, ids: np.ndarray, pos0: int, memo: bool = True
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer-0 (K post-RoPE, Kraw pre-RoPE, V) [KV, n, hd] of `ids` at positions pos0.., by the
        prefill path (the memo's rows then the tile RoPE on the key heads): a reference independent
        of `rope()`. memo=False computes every row afresh (`_project0`, one GEMV per token) and
        never reads or fills the memo: a reference independent of the memo too."""
        H, KV, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        n = len(ids)
        if memo:
            proj = self._proj0(ids, 0, n)  # [n, (H+2KV)*hd]
        else:
            with self._l0_lock:
                proj = np.stack([self._project0(int(t)).copy() for t in ids])  # [n, (H+2KV)*hd]
        kraw = proj[:, H * hd : (H + KV) * hd].reshape(n, KV, hd)  # [n, KV, hd]
        k = self._rope_qk(kraw, pos0)  # [n, KV, hd]
        v = proj[:, (H + KV) * hd :].reshape(n, KV, hd)
        return k.transpose(1, 0, 2), kraw.transpose(1, 0, 2), v.transpose(1, 0, 2)

    def rope_rows(self, kraw: np.ndarray, pos0: int) -> np.ndarray:
        """kraw [L, KV, m, hd] pre-RoPE at positions pos0..pos0+m -> post-RoPE, by the prefill
        path's RoPE (`_rope_qk`: table slices, in-place ufuncs): an independent check of `rope()`."""
        L, KV, m, hd = kraw.shape
        rot = self._rope_qk(kraw.transpose(2, 0, 1, 3).reshape(m, L * KV, hd), pos0)  # [m, L*KV, hd]
        out: np.ndarray = rot.reshape(m, L, KV, hd).transpose(1, 2, 0, 3)
        return out

    def attention(self, q: np.ndarray, K: np.ndarray, V: np.ndarray, pos0: int) -> np.ndarray:
        """Tile queries q [KV, G*T, hd] over keys K, V [KV, Lk, hd] -> o [T, H*hd] (Lk fixed by the tile)."""
        KV, G, hd = self.cfg.n_kv_heads, self.cfg.n_groups, self.cfg.head_dim
        T = q.shape[1] // G
        pv, den = self._attend(q, K, V, pos0, T)  # normalise after P@V (hd < Lk)
        o = np.empty((T, KV, G, hd), np.float32)
        np.divide(
            pv.reshape(KV, G, T, hd).transpose(2, 0, 1, 3),
            den.reshape(KV, G, T, 1).transpose(2, 0, 1, 3),
            out=o,
        )
        return o.reshape(T, KV * G * hd)

    def mlp(self, x: np.ndarray, l: int, o: np.ndarray) -> np.ndarray:
        """Output projection of o [T, H*hd] and the SwiGLU MLP, added to x [T, dim] in place."""
        x += _add(_lin(o, self.wo[l]), self.bo[l])  # [T, dim]
        gu = _add(_lin(self._norm(x, self.n2[l]), self.wgu[l]), self.bgu[l])  # [T, 2F]
        F = self.cfg.hidden_dim
        g, m = gu[:, :F], np.negative(gu[:, :F])  # SwiGLU [T, F]: g / (1 + exp(-g)) * u, in place
        np.exp(m, out=m)
        m += np.float32(1.0)
        np.divide(g, m, out=m)
        m *= gu[:, F:]
        x += _add(_lin(m, self.wd[l]), self.bd[l])  # [T, dim]
        return x

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
