"""torch backend (CPU or CUDA): the same fixed-shape tile algorithm as ops_numpy, in torch.

Weights come from the same numpy arrays as the numpy backend. Thread count is pinned with
torch.set_num_threads inside `limit()` (restored afterwards). Exactness across chunkings is
aimed for the same way (fixed shapes per tile); the tests report the measured max|Δ|.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from fleet.core.errors import InvalidArgument
from fleet.core.kernel.config import ModelConfig
from fleet.core.kernel.l0memo import L0Slots, memo_rows
from fleet.core.kernel.ops_numpy import _cat_bias
from fleet.core.kernel.rope import tables
from fleet.core.kernel.threads import ThreadPin
from fleet.core.kernel.weights import Weights


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., P, hd] pre-RoPE, cos/sin [P, hd/2] -> post-RoPE (rotate-half, elementwise only)."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _pin_torch(n: int) -> tuple[int, bool]:
    """Pin torch's intra-op threads to `n` and fp32 matmuls on CUDA; what it replaced."""
    prev = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(n)
    torch.backends.cuda.matmul.allow_tf32 = False  # NOTE: fp32 means fp32 on CUDA too (HF parity)
    return prev


def _restore_torch(prev: tuple[int, bool]) -> None:
    torch.set_num_threads(prev[0])
    torch.backends.cuda.matmul.allow_tf32 = prev[1]


# torch's thread count is process-wide: one pin for every kernel of the process (fleet/core/kernel/threads.py)
_TORCH_PIN = ThreadPin(_pin_torch, _restore_torch)


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
        self._masks: dict[tuple[int, int], torch.Tensor] = {}
        # layer 0, one token at a time: fixed buffers (same shapes, same addresses every call)
        W = (H + 2 * KV) * hd
        self._h1 = torch.zeros((1, cfg.dim), dtype=torch.float32, device=device)
        self._y1 = torch.zeros((1, W), dtype=torch.float32, device=device)
        self._slots = L0Slots(memo_rows(W * 4))
        self._tab = torch.zeros((min(self._slots.capacity, 1024), W), dtype=torch.float32, device=device)
        self._l0_lock = threading.Lock()

    @contextmanager
    def limit(self) -> Iterator[None]:
        """Pin torch's intra-op threads to the kernel's count for the duration, also while another session's pass
        overlaps this one (`ThreadPin`: the last one out restores the caller's settings)."""
        with _TORCH_PIN.hold(self.threads), torch.no_grad():
            yield

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
        return x * torch.rsqrt(var.add_(self.cfg.norm_eps)) * w

    def embed(self, ids: np.ndarray, slot0: int, T: int) -> torch.Tensor:
        x = torch.zeros((T, self.cfg.dim), dtype=torch.float32, device=self.device)
        x[slot0 : slot0 + len(ids)] = self.embed_w[
            torch.from_numpy(np.asarray(ids, np.int64)).to(self.device)
        ]
        return x

    def _mask_for(self, T: int, n: int) -> torch.Tensor:
        """[T, n] True where key pos0+j is after query pos0+r, for the n keys from the tile's first
        position on (keys before it are visible to every row). Cached per (T, n): immutable."""
        m = self._masks.get((T, n))
        if m is None:
            r = torch.arange(T, device=self.device)[:, None]  # [T, 1] query offset in the tile
            m = self._masks[(T, n)] = torch.arange(n, device=self.device)[None, :] > r
        return m

    def _rope_qk(self, qk: torch.Tensor, pos0: int) -> torch.Tensor:
        """RoPE on q and k heads at once: qk [T, H+KV, hd] (a strided view) -> new [T, H+KV, hd].
        Per element the same products and sum as `rope_torch`, so K == rope(Kraw) bit for bit."""
        T, h = qk.shape[0], qk.shape[-1] // 2
        cos, sin = self.cos[pos0 : pos0 + T, None], self.sin[pos0 : pos0 + T, None]  # [T, 1, hd/2]
        x1, x2 = qk[..., :h], qk[..., h:]
        out = torch.empty(qk.shape, dtype=qk.dtype, device=qk.device)
        torch.mul(x1, cos, out=out[..., :h]).sub_(x2 * sin)
        torch.mul(x2, cos, out=out[..., h:]).add_(x1 * sin)
        return out

    def _attend(
        self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos0: int, T: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [KV, G*T, hd] (scaled) over keys K, V [KV, Lk, hd] -> unnormalised P@V [KV, G*T, hd]
        and the softmax denominators [KV, G*T, 1]; masked entries exp to an exact 0."""
        KV, Lk = K.shape[0], K.shape[1]
        s = torch.bmm(q, K.transpose(1, 2))  # [KV, G*T, Lk]
        s.view(KV, -1, T, Lk)[..., pos0:].masked_fill_(self._mask_for(T, Lk - pos0), float("-inf"))
        s.sub_(s.amax(dim=-1, keepdim=True)).exp_()  # keys < pos0 are visible to every row
        return torch.bmm(s, V), s.sum(dim=-1, keepdim=True)

    def _row0(self, tok: int, row: int) -> None:
        """Compute layer 0's fused q/k/v projection (pre-RoPE, bias added) of token `tok` into memo
        row `row`: alone in one fixed [1, dim] shape, never inside a tile (see NumpyOps._row0)."""
        if row >= len(self._tab):  # grow the table (doubling, up to capacity)
            n = min(self._slots.capacity, max(2 * len(self._tab), row + 1))
            grown = torch.zeros((n, self._tab.shape[1]), dtype=torch.float32, device=self.device)
            grown[: len(self._tab)] = self._tab
            self._tab = grown
        self._tab[row] = self._project0(tok)

    def _project0(self, tok: int) -> torch.Tensor:
        """Token `tok`'s layer-0 q/k/v projection [(H+2KV)*hd] in the fixed buffers (the caller
        holds `_l0_lock` and copies the result out before the next call)."""
        self._h1.copy_(self._norm(self.embed_w[tok : tok + 1], self.n1[0]))  # [1, dim] RMSNorm
        torch.mm(self._h1, self.wqkv[0], out=self._y1)  # [1, W]
        return _add(self._y1[0], self.bqkv[0])

    def _proj0(self, ids: np.ndarray, slot0: int, T: int) -> torch.Tensor:
        """Layer-0 projections of a tile [T, (H+2KV)*hd]: `ids` at rows slot0.., zeros elsewhere."""
        out = torch.zeros((T, self._tab.shape[1]), dtype=torch.float32, device=self.device)
        step = self._slots.capacity // 2
        toks = np.asarray(ids).tolist()
        with self._l0_lock:
            for c in range(0, len(toks), step):
                rows, misses = self._slots.lookup(toks[c : c + step])
                self._slots.fill(misses, self._row0)
                idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
                out[slot0 + c : slot0 + c + len(rows)] = self._tab[idx]  # one gather
        return out

    def qkv(
        self, x: torch.Tensor, l: int, pos0: int, ids: np.ndarray | None = None, slot0: int = 0
    ) -> tuple[torch.Tensor, ...]:
        """Layer l's attention inputs for tile x [T, dim]: q [KV, G*T, hd] (post-RoPE, scaled),
        k (post-RoPE), kraw (pre-RoPE), v: [KV, T, hd] (views). At layer 0 pass the tile's `ids`."""
        if l == 0 and ids is not None:
            qkv = self._proj0(ids, slot0, x.shape[0])  # [T, (H+2KV)*hd]
        else:
            qkv = _add(torch.mm(self._norm(x, self.n1[l]), self.wqkv[l]), self.bqkv[l])  # [T, (H+2KV)*hd]
        return self.split_qkv(qkv, pos0)

    def split_qkv(self, qkv: torch.Tensor, pos0: int) -> tuple[torch.Tensor, ...]:
        """Fused projections qkv [T, (H+2KV)*hd] of positions pos0.. -> (q, k, kraw, v) as `qkv`."""
        cfg = self.cfg
        T, H, KV, G, hd = qkv.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.n_groups, cfg.head_dim
        rot = self._rope_qk(qkv[:, : (H + KV) * hd].reshape(T, H + KV, hd), pos0)  # [T, H+KV, hd]
        q = torch.empty((KV, G, T, hd), dtype=qkv.dtype, device=qkv.device)
        torch.mul(rot[:, :H].reshape(T, KV, G, hd).permute(1, 2, 0, 3), self.scale, out=q)  # [KV, G, T, hd]
        kraw = qkv[:, H * hd : (H + KV) * hd].reshape(T, KV, hd).transpose(0, 1)  # [KV, T, hd] views
        v = qkv[:, (H + KV) * hd :].reshape(T, KV, hd).transpose(0, 1)
        return q.view(KV, G * T, hd), rot[:, H:].transpose(0, 1), kraw, v

    def layer0(
        self, ids: np.ndarray, pos0: int, memo: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer-0 (K, Kraw, V) [KV, n, hd] of `ids` at positions pos0.., by the prefill path;
        memo=False computes every row afresh and never touches the memo (see NumpyOps.layer0)."""
        H, KV, hd = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        n = len(ids)
        if memo:
            proj = self._proj0(ids, 0, n)  # [n, (H+2KV)*hd]
        else:
            with self._l0_lock:
                proj = torch.stack([self._project0(int(t)).clone() for t in ids])  # [n, (H+2KV)*hd]
        kraw = proj[:, H * hd : (H + KV) * hd].reshape(n, KV, hd)  # [n, KV, hd]
        k = self._rope_qk(kraw, pos0)  # [n, KV, hd]
        v = proj[:, (H + KV) * hd :].reshape(n, KV, hd)
        return k.transpose(0, 1), kraw.transpose(0, 1), v.transpose(0, 1)

    def rope_rows(self, kraw: torch.Tensor, pos0: int) -> torch.Tensor:
        """kraw [L, KV, m, hd] at positions pos0.. -> post-RoPE by the prefill path's `_rope_qk`."""
        L, KV, m, hd = kraw.shape
        rot = self._rope_qk(kraw.permute(2, 0, 1, 3).reshape(m, L * KV, hd), pos0)  # [m, L*KV, hd]
        return rot.reshape(m, L, KV, hd).permute(1, 2, 0, 3)

    def attention(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos0: int) -> torch.Tensor:
        """Tile queries q [KV, G*T, hd] over keys K, V [KV, Lk, hd] -> o [T, H*hd] (Lk fixed by the tile)."""
        KV, G, hd = self.cfg.n_kv_heads, self.cfg.n_groups, self.cfg.head_dim
        T = q.shape[1] // G
        pv, den = self._attend(q, K, V, pos0, T)  # [KV, G*T, hd], [KV, G*T, 1]: normalise after P@V
        o = torch.empty((T, KV, G, hd), dtype=q.dtype, device=q.device)
        torch.div(pv.view(KV, G, T, hd).permute(2, 0, 1, 3), den.view(KV, G, T, 1).permute(2, 0, 1, 3), out=o)
        return o.view(T, KV * G * hd)

    def mlp(self, x: torch.Tensor, l: int, o: torch.Tensor) -> torch.Tensor:
        """Output projection of o [T, H*hd] and the SwiGLU MLP, added to x [T, dim] in place."""
        x += _add(torch.mm(o, self.wo[l]), self.bo[l])  # [T, dim]
        gu = _add(torch.mm(self._norm(x, self.n2[l]), self.wgu[l]), self.bgu[l])  # [T, 2F]
        F = self.cfg.hidden_dim
        m = torch.nn.functional.silu(gu[:, :F]).mul_(gu[:, F:])  # SwiGLU [T, F]
        x += _add(torch.mm(m, self.wd[l]), self.bd[l])  # [T, dim]
        return x

    def logits(self, row: torch.Tensor) -> np.ndarray:
        h = self._norm(row[None, :], self.final_norm)  # [1, dim]
        return (h @ self.lm_head)[0].detach().cpu().numpy().astype(np.float32)  # [V]
