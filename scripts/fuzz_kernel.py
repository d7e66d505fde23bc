"""Seeded differential fuzzer of the KV kernel's exactness contract (docs/kernel.md, "The exactness contract").

    python scripts/fuzz_kernel.py --seed 3 --ops 400                  # numpy backend, in process
    python scripts/fuzz_kernel.py --seed 3 --ops 400 --backend torch  # torch backend (CPU)
    python scripts/fuzz_kernel.py --seed 3 --ops 30 --fleet           # also a short run through a local Ray fleet
    python scripts/fuzz_kernel.py --seed 3 --ops 30 --sdk             # ... and through the SDK and a controller
    python scripts/fuzz_kernel.py --seed 3 --ops 400 --faults         # primitives failing part way through ops

It applies a random sequence of session operations to `fleet.core.kernel` directly: new sessions, sessions adopting
an exported prefix, appends (length 1, tile- and block-crossing, long, ids at 0 and vocab-1), tool-result spans
appended and later evicted, evictions of random spans in both modes (at position 0, at the end, the whole session,
length 1, a span evicted again at the same positions), truncations (tail evictions), forks (of forks), decoding,
close, and bad input of every kind the docs name. The model is one of a few tiny seeded configs (1 or 2 layers, GQA,
biases, tied embeddings, a short context, small blocks and tiles), picked by the seed. After every step it checks
every live session against references computed from scratch:

- a float64 reference model written here (independent of the kernel's code: its own RMSNorm, RoPE, GQA attention and
  SwiGLU) that follows each session's own history, reposition eviction included: K/Kraw/V of every position and the
  last logits within `TOL`;
- a fresh prefill of the tokens the session should hold, on the same kernel: bit for bit (max|d| = 0) on the
  positions the contract calls exact (all of them unless a reposition on a deep model shifted survivors: then those
  before the span, as `num_exact_tokens` must say), digest and last logits included when the whole session is;
- `K == RoPE(Kraw)` and layer 0 against the prefill path (memo and memo bypassed): 0 on every state;
- each eviction's `EvictReport` (exact, tail, counts, logits_fresh, invariant_delta) against what the docs say;
- isolation: every session the step did not touch keeps its digest, tokens and last logits bit for bit (a fork must
  never see its sibling's or its parent's writes, nor an adopter its exporter's, nor the reverse), and arrays handed
  out (logits, tokens, exported blocks) can be written by the caller without changing any session;
- bad input: refused with a `fleet.core.errors` error whose message names the argument or rule, leaving the session
  unchanged (digest, tokens, last logits, num_exact_tokens); valid input must not be refused.

- with --faults: one of the backend's primitives (allocation, copy, RoPE, layer 0 and its memo fill, attention, MLP,
  logits, ...) raises at its k-th call during an op, as an out-of-memory would: an append, eviction, export or
  fork that fails leaves every session bit for bit as it was, and a decode keeps exactly the tokens of the steps
  before the failing one (docs/kernel.md, "A failure part way ... is all or nothing too");
- sharing: `memory()`'s shared blocks are those another live session holds too, or exported / adopted ones, and each
  block's ref_cnt is the number of live sessions holding it.

At the end each session's whole history (its ancestors' ops, then its own) is replayed on a second kernel of the same
model (a fresh layer-0 memo) and must give the same digest and last logits bit for bit: what the fleet's op-log
replay relies on, also on the states that are not a prefill's; and on the other backend, within 1e-4 (K/Kraw/V and
logits: the contract's "numpy vs torch" row). A third of the adopted prefixes go through pickle first, as Ray's
object store hands them to another actor.

Then (--context-ops, default 150) the piece ledger in process (fleet.core.context.SessionContext on a 1-3 layer
model): pieces (many of one token), evictions in both modes (the tail often), forks and decode, checking after each op
that no piece is `shifted` where the kernel holds a prefill's KV, that the pieces in the cache tile it, the session
against a fresh prefill while it is exact, and its op log replayed op by op (and over its ledger when the log's KV
follows its tokens) to the same digest and piece states.

With --fleet it then drives a few ops through the real path (a local Ray cluster, a KernelFleet on a SQLite store, as
tests/workers start them, on the fleet's default model): create, messages, model output, tool results, piece
evictions (an already evicted piece again), quarantine verdicts (evictions with a proof), forks (sharing blocks or
not), decode, releases (the next call rebuilds the session from its op log), close, and bad calls, comparing the
fleet's tokens, digest, logits and piece states after each step with an in-process SessionContext given the same ops
and, while the session is a prefill of its tokens, with a fresh prefill.
With --sdk the same kind of sequence goes through the SDK (AsyncFleetClient) to a controller serving gRPC on a
loopback port (its own kernel fleet on the local Ray cluster): tokens, digests, returned logits, evict results and
refusals (their error types) against the in-process context.

Exit status 0 when nothing was flagged, 1 otherwise (each finding printed with the step that caused it).
"""

# ruff: noqa: B023  (the loop's lambdas are called before the loop moves on: `both`, `refused`)

from __future__ import annotations

import argparse
import dataclasses
import math
import pickle
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted  # noqa: E402
from fleet.core.kernel import (  # noqa: E402
    Kernel,
    ModelConfig,
    Session,
    l0memo,  # noqa: E402
)
from fleet.core.kernel.rope import inv_freq  # noqa: E402
from fleet.core.kernel.weights import Weights  # noqa: E402

TOL = 1e-4  # float32 kernel vs the float64 reference: K/Kraw/V and logits (docs: HF parity <= 1e-4)

# (name, ModelConfig.tiny overrides, Kernel keyword arguments); the seed picks one
CONFIGS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("tiny", {}, dict(tile_size=32, block_size=16)),
    ("tiny-1layer", dict(n_layers=1), dict(tile_size=32, block_size=16)),
    ("tiny-short-ctx", dict(max_seq_len=96), dict(tile_size=8, block_size=4)),
    ("qwen-like", dict(qkv_bias=True, tie_embeddings=True, vocab_size=300), dict(tile_size=16, block_size=8)),
    ("mqa-3layer", dict(n_layers=3, n_kv_heads=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
     dict(tile_size=16, block_size=16)),
    ("window", dict(sliding_window=80, max_seq_len=4096, mlp_bias=True, o_bias=True), dict(tile_size=32, block_size=8)),
    ("odd-geometry", dict(max_seq_len=400), dict(tile_size=5, block_size=3)),
    ("tile1-block1", dict(max_seq_len=200), dict(tile_size=1, block_size=1)),
    ("small-memo", {}, dict(tile_size=16, block_size=16, memo_rows=8)),  # a layer-0 memo of 8 rows (FIFO reuse)
    # appends past GROUP_TOKENS (2048) positions
    ("long", dict(max_seq_len=4600), dict(tile_size=64, block_size=16, long=True)),
    ("threads2", dict(max_seq_len=300), dict(tile_size=32, block_size=16, threads=2)),  # two BLAS/torch threads
    ("big-vocab", dict(vocab_size=5000), dict(tile_size=32, block_size=16)),  # the layer-0 memo grows past 1,024 rows
]


def _flagger(findings: list[str], where: str) -> Callable[[str], None]:
    """A finding recorder: appends `[where] msg` to `findings` and prints it at once."""
    def flag(msg: str) -> None:
        findings.append(f"[{where}] {msg}")
        print("FINDING:", findings[-1], flush=True)
    return flag


def _local_ray() -> str:
    """A temporary directory with a local Ray started in it (2 CPUs, no dashboard): the fleet and SDK modes' cluster."""
    import ray

    tmp = tempfile.mkdtemp(prefix="kvfleet-fuzz-")
    ray.init(address="local", num_cpus=2, namespace="kvfleet", include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=f"{tmp}/ray")
    return tmp


# ---------------------------------------------------------------------------------------------------------------
# The float64 reference model (independent of the kernel's tile code)
# ---------------------------------------------------------------------------------------------------------------


class RefModel:
    """The decoder in float64, token rows at once with a causal mask, over a cache the caller holds."""

    def __init__(self, cfg: ModelConfig, w: Weights) -> None:
        self.cfg = cfg
        f = np.float64
        self.embed = w.embed.astype(f)
        self.layers = [{k: (None if v is None else np.asarray(v, f)) for k, v in
                        ((fl.name, getattr(L, fl.name)) for fl in dataclasses.fields(L))} for L in w.layers]
        self.final_norm = w.final_norm.astype(f)
        self.lm_head = w.lm_head.astype(f)
        self.inv = inv_freq(cfg)  # float64 [hd/2]

    def _rms(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps) * w

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [..., P, hd] at positions pos [P], rotate-half, angles in float64."""
        ang = pos[:, None] * self.inv[None, :]  # [P, hd/2]
        c, s = np.cos(ang), np.sin(ang)
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    @staticmethod
    def _lin(x: np.ndarray, w: np.ndarray, b: np.ndarray | None) -> np.ndarray:
        y = x @ w.T
        return y if b is None else y + b

    def forward(self, kv: np.ndarray, ids: list[int], p0: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows of `ids` at positions [p0, p0+m) over the cache kv [3, L, KV, p0, hd] (K, Kraw, V).

        Returns: their rows [3, L, KV, m, hd] and the logits [V] after the last one."""
        cfg = self.cfg
        H, KV, hd, G, m = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_groups, len(ids)
        pos = np.arange(p0, p0 + m, dtype=np.float64)
        x = self.embed[np.asarray(ids, np.int64)]  # [m, dim]
        out = np.zeros((3, cfg.n_layers, KV, m, hd))
        causal = np.arange(p0 + m)[None, :] > (p0 + np.arange(m))[:, None]  # [m, p0+m]
        for l, L in enumerate(self.layers):
            h = self._rms(x, L["attn_norm"])
            q = self._lin(h, L["wq"], L["bq"]).reshape(m, H, hd).transpose(1, 0, 2)  # [H, m, hd]
            kraw = self._lin(h, L["wk"], L["bk"]).reshape(m, KV, hd).transpose(1, 0, 2)  # [KV, m, hd]
            v = self._lin(h, L["wv"], L["bv"]).reshape(m, KV, hd).transpose(1, 0, 2)
            k = self.rope(kraw, pos)
            q = self.rope(q, pos)
            out[0, l], out[1, l], out[2, l] = k, kraw, v
            K = np.concatenate([kv[0, l], k], axis=1)  # [KV, p0+m, hd]
            Vv = np.concatenate([kv[2, l], v], axis=1)
            o = np.zeros((m, H, hd))
            for head in range(H):
                s = q[head] @ K[head // G].T / math.sqrt(hd)  # [m, p0+m]
                s[causal] = -np.inf
                s = np.exp(s - s.max(axis=-1, keepdims=True))
                o[:, head] = (s / s.sum(axis=-1, keepdims=True)) @ Vv[head // G]
            x = x + self._lin(o.reshape(m, H * hd), L["wo"], L["bo"])
            h2 = self._rms(x, L["mlp_norm"])
            g, u = self._lin(h2, L["w_gate"], L["b_gate"]), self._lin(h2, L["w_up"], L["b_up"])
            x = x + self._lin(g / (1.0 + np.exp(-g)) * u, L["w_down"], L["b_down"])
        logits = self._rms(x[-1], self.final_norm) @ self.lm_head.T
        return out, logits


# ---------------------------------------------------------------------------------------------------------------
# What each session should hold
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Shadow:
    """The expected state of one session: its tokens, the float64 reference rows and logits, how many leading
    positions are a prefill's (the contract's `num_exact_tokens`), and its history (for the replay check)."""

    tokens: list[int]
    kv: np.ndarray  # [3, L, KV, n, hd] float64
    logits: np.ndarray | None
    exact_upto: int
    history: list[tuple[Any, ...]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # tool-result spans appended (start, length)
    evicted: list[tuple[int, int]] = field(default_factory=list)  # spans already evicted (at their old positions)

    def copy(self) -> Shadow:
        return Shadow(list(self.tokens), self.kv.copy(), None if self.logits is None else self.logits.copy(),
                      self.exact_upto, list(self.history), list(self.spans), list(self.evicted))


@dataclass
class Snap:
    """What a session holds, bit for bit, at one instant."""

    digest: str
    tokens: list[int]
    logits: np.ndarray | None
    num_exact: int
    num_blocks: int

    @classmethod
    def of(cls, s: Session) -> Snap:
        return cls(s.digest(), s.tokens, s.last_logits, s.num_exact_tokens, s.memory().num_blocks)

    def same(self, other: Snap) -> bool:
        if (self.logits is None) != (other.logits is None):
            return False
        return (self.digest == other.digest and self.tokens == other.tokens and self.num_exact == other.num_exact
                and self.num_blocks == other.num_blocks
                and (self.logits is None or np.array_equal(self.logits, other.logits)))


class Finding(Exception):
    pass


class InjectedFault(Exception):
    """Raised by a primitive the --faults mode armed (as an out-of-memory would be, part way through an op)."""


def delta(a: Any, b: Any) -> float:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if x.shape != y.shape:
        return math.inf
    return float(np.max(np.abs(x - y))) if x.size else 0.0


# ---------------------------------------------------------------------------------------------------------------
# The in-process fuzzer
# ---------------------------------------------------------------------------------------------------------------


class KernelFuzz:
    def __init__(self, seed: int, backend: str, config: str | None = None, verbose: bool = False) -> None:
        self.rng = random.Random(seed)
        name, over, kw = CONFIGS[seed % len(CONFIGS)] if config is None else next(c for c in CONFIGS if c[0] == config)
        self.name, self.backend, self.verbose = name, backend, verbose
        self.cfg = ModelConfig.tiny(**over)
        kw = dict(kw)
        self.memo_rows, self.long = kw.pop("memo_rows", None), kw.pop("long", False)
        self.kw, self.wseed = kw, seed % 5
        self.kernel = self.make_kernel()
        self.ref = RefModel(self.cfg, self.kernel.weights)
        self.V, self.ctx, self.BS = self.cfg.vocab_size, self.cfg.max_context, self.kernel.block_size
        self.sessions: dict[int, Session] = {}
        self.shadows: dict[int, Shadow] = {}
        self.snaps: dict[int, Snap] = {}
        self.next_id = 0
        self.findings: list[str] = []
        self.step = 0
        self.max_ref_delta = 0.0
        self.counts: dict[str, int] = {}
        self.longest = 0
        self.max_cross_delta = 0.0
        self.faults, self.armed, self.faults_fired = False, "", 0

    def make_kernel(self, backend: str | None = None) -> Kernel:
        """The run's model; with `memo_rows`, its layer-0 memo holds that many rows (FIFO reuse from the start)."""
        saved = l0memo.L0_MIN_ROWS, l0memo.L0_MEMO_BYTES
        if self.memo_rows:
            l0memo.L0_MIN_ROWS, l0memo.L0_MEMO_BYTES = self.memo_rows, 0
        try:
            return Kernel.synthetic(self.cfg, seed=self.wseed, backend=backend or self.backend, **self.kw)
        finally:
            l0memo.L0_MIN_ROWS, l0memo.L0_MEMO_BYTES = saved

    # -- bookkeeping -------------------------------------------------------------------------------------------
    def flag(self, msg: str) -> None:
        self.findings.append(f"[{self.name}/{self.backend} step {self.step}] {msg}")
        print("FINDING:", self.findings[-1], flush=True)

    def empty_kv(self) -> np.ndarray:
        c = self.cfg
        return np.zeros((3, c.n_layers, c.n_kv_heads, 0, c.head_dim))

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def ids(self, n: int) -> list[int]:
        """n token ids, often at the vocabulary's bounds."""
        r = self.rng
        return [r.choice((0, self.V - 1)) if r.random() < 0.15 else r.randrange(self.V) for _ in range(n)]

    def length(self, room: int) -> int:
        r = self.rng
        pick = r.random()
        n = (1 if pick < 0.3 else r.randint(2, 12) if pick < 0.7 else r.randint(13, 70) if pick < 0.95
             else r.randint(71, 260))
        return max(0, min(n, room))

    # -- the expected effects --------------------------------------------------------------------------------------
    def sh_append(self, sh: Shadow, ids: list[int]) -> None:
        n = len(sh.tokens)
        rows, logits = self.ref.forward(sh.kv, ids, n)
        sh.kv = np.concatenate([sh.kv, rows], axis=3)
        sh.tokens += ids
        sh.logits = logits
        sh.exact_upto = n + len(ids) if sh.exact_upto >= n else sh.exact_upto

    def sh_recompute_last(self, sh: Shadow, n: int) -> None:
        """Keep n tokens; token n-1 recomputed in place over [0, n-1) (its row and the logits)."""
        sh.kv, sh.tokens = sh.kv[:, :, :, :n], sh.tokens[:n]
        sh.exact_upto = min(sh.exact_upto, n)
        if n == 0:
            sh.logits = None
            return
        rows, sh.logits = self.ref.forward(sh.kv[:, :, :, : n - 1], sh.tokens[n - 1:], n - 1)
        sh.kv = np.concatenate([sh.kv[:, :, :, : n - 1], rows], axis=3)
        sh.exact_upto = n if sh.exact_upto >= n - 1 else sh.exact_upto

    def sh_evict(self, sh: Shadow, start: int, length: int, mode: str) -> dict[str, Any]:
        """Apply an eviction to the shadow; return the report fields the docs promise."""
        end = start + length
        survivors = sh.tokens[end:]
        m = len(survivors)
        if m == 0:  # a tail: a truncation, exact when the positions before it are
            self.sh_recompute_last(sh, start)
            return dict(tail=True, num_recomputed=0, num_rerotated=0, logits_fresh=start > 0,
                        exact=sh.exact_upto == len(sh.tokens), invariant_delta=None)
        if mode == "exact":
            rows, logits = self.ref.forward(sh.kv[:, :, :, :start], survivors, start)
            sh.kv = np.concatenate([sh.kv[:, :, :, :start], rows], axis=3)
            sh.tokens = sh.tokens[:start] + survivors
            sh.logits = logits
            sh.exact_upto = start + m if sh.exact_upto >= start else sh.exact_upto
            return dict(tail=False, num_recomputed=m, num_rerotated=0, logits_fresh=True,
                        exact=sh.exact_upto == len(sh.tokens), invariant_delta=None)
        keep = sh.kv[:, :, :, end:].copy()
        keep[0] = self.ref.rope(keep[1], np.arange(start, start + m, dtype=np.float64))
        sh.kv = np.concatenate([sh.kv[:, :, :, :start], keep], axis=3)
        sh.tokens = sh.tokens[:start] + survivors
        sh.logits = None
        if self.cfg.n_layers == 1:  # every row a function of (id, position): a prefill's
            sh.exact_upto = len(sh.tokens) if sh.exact_upto >= start else sh.exact_upto
        else:
            sh.exact_upto = min(sh.exact_upto, start)
        return dict(tail=False, num_recomputed=0, num_rerotated=m, logits_fresh=False,
                    exact=sh.exact_upto == len(sh.tokens), invariant_delta=0.0)

    # -- checks ------------------------------------------------------------------------------------------------
    def check_session(self, sid: int, what: str) -> None:
        s, sh = self.sessions[sid], self.shadows[sid]
        n = len(sh.tokens)
        if s.tokens != sh.tokens or len(s) != n or s.positions != list(range(n)):
            self.flag(f"{what}: session {sid} holds tokens {s.tokens[:8]}..(n={len(s)}), expected n={n}")
            return
        if s.num_exact_tokens != sh.exact_upto:
            self.flag(f"{what}: session {sid} num_exact_tokens={s.num_exact_tokens}, expected {sh.exact_upto}")
        mem = s.memory()
        if (mem.num_tokens != n or mem.num_blocks != -(-n // self.BS)
                or mem.bytes_total != mem.num_blocks * mem.block_bytes):
            self.flag(f"{what}: session {sid} memory {mem} for {n} tokens")
        last = s.last_logits
        if (last is None) != (sh.logits is None):
            self.flag(f"{what}: session {sid} last_logits is {'None' if last is None else 'set'}, expected "
                      f"{'None' if sh.logits is None else 'set'}")
        elif last is not None:
            d = delta(last, sh.logits)
            self.max_ref_delta = max(self.max_ref_delta, d)
            if d > TOL:
                self.flag(f"{what}: session {sid} logits vs the float64 reference max|d| = {d:.3g}")
        if n == 0:
            if s.digest() != self.kernel.session().digest():
                self.flag(f"{what}: empty session {sid} digest differs from a new session's")
            return
        kv = s.kv_numpy(0, n)
        d = delta(kv, sh.kv)
        self.max_ref_delta = max(self.max_ref_delta, d)
        if d > TOL:
            where = np.argwhere(np.abs(kv - sh.kv) > TOL)[0]
            self.flag(f"{what}: session {sid} KV vs the float64 reference max|d| = {d:.3g} (first at tensor/layer/"
                      f"head/position {tuple(int(i) for i in where)})")
        for name, val in (("rope_invariant_delta", s.rope_invariant_delta()), ("layer0_delta", s.layer0_delta()),
                          ("layer0_delta(memo=False)", s.layer0_delta(memo=False))):
            if val != 0.0:
                self.flag(f"{what}: session {sid} {name} = {val:.3g}, expected 0")
        # bit for bit against a fresh prefill of the tokens, on the positions the contract calls exact
        fresh = self.kernel.session()
        flog = fresh.append(sh.tokens)
        e = sh.exact_upto
        if e:
            d = delta(kv[:, :, :, :e], fresh.kv_numpy(0, e))
            if d != 0.0:
                self.flag(f"{what}: session {sid} positions [0, {e}) differ from a fresh prefill by {d:.3g}")
        if e == n:
            if s.digest() != fresh.digest():
                self.flag(f"{what}: session {sid} digest differs from a fresh prefill's of its {n} tokens")
            if last is not None and not np.array_equal(last, flog):
                self.flag(f"{what}: session {sid} last logits differ from a fresh prefill's by {delta(last, flog):.3g}")
        fresh.close()

    def check_sharing(self, what: str) -> None:
        """memory() against who holds each block: a block is shared when another live session's table holds it too,
        or it was exported / adopted (a PrefixKV may be read elsewhere); alone otherwise."""
        holders: dict[int, int] = {}
        for s in self.sessions.values():
            for b in s._kv.blocks:
                holders[id(b)] = holders.get(id(b), 0) + 1
        for sid, s in self.sessions.items():
            want = sum(1 for b in s._kv.blocks if holders[id(b)] > 1 or b.external)
            mem = s.memory()
            if mem.num_shared_blocks != want:
                self.flag(f"{what}: session {sid} memory() says {mem.num_shared_blocks} shared blocks, {want} are "
                          f"(held by another live session, or exported/adopted)")
            for b in s._kv.blocks:
                if b.ref_cnt != holders[id(b)]:
                    self.flag(f"{what}: a block of session {sid} has ref_cnt {b.ref_cnt}, {holders[id(b)]} live "
                              "sessions hold it")
                    break

    def check_all(self, what: str, touched: set[int]) -> None:
        self.check_sharing(what)
        for sid in list(self.sessions):
            if sid in touched or sid not in self.snaps:
                self.check_session(sid, what)
            else:
                now = Snap.of(self.sessions[sid])
                if not now.same(self.snaps[sid]):
                    self.flag(f"{what}: session {sid} changed although the step did not touch it (branch leak)")
            self.snaps[sid] = Snap.of(self.sessions[sid])
            self.longest = max(self.longest, len(self.sessions[sid]))

    def expect_refused(self, sid: int, what: str, fn: Any, kinds: tuple[type, ...], words: tuple[str, ...]) -> None:
        """`fn()` must raise one of `kinds` with a message naming one of `words`, and change nothing."""
        s = self.sessions[sid]
        before = Snap.of(s)
        try:
            fn()
        except kinds as e:
            msg = str(e)
            if words and not any(w in msg for w in words):
                self.flag(f"{what}: refused with an unclear message {type(e).__name__}: {msg!r}")
        except Exception as e:  # noqa: BLE001
            if isinstance(e, InjectedFault):
                raise
            self.flag(f"{what}: raised {type(e).__name__}: {e!r}, expected one of {[k.__name__ for k in kinds]}")
        else:
            self.flag(f"{what}: accepted, the contract refuses it")
            # the session changed: take what it holds now as expected, or every later check repeats this finding
            self.rebase(sid)
            return
        if not Snap.of(s).same(before):
            self.flag(f"{what}: refused but the session changed")
            self.rebase(sid)

    def rebase(self, sid: int) -> None:
        """After a finding that changed a session: drop it from the run (it can no longer be predicted)."""
        self.sessions.pop(sid).close()
        self.shadows.pop(sid)
        self.snaps.pop(sid, None)

    # -- ops ---------------------------------------------------------------------------------------------------
    def pick(self) -> int | None:
        return self.rng.choice(sorted(self.sessions)) if self.sessions else None

    def op_new(self) -> set[int]:
        sid = self.new_id()
        self.sessions[sid] = self.kernel.session()
        self.shadows[sid] = Shadow([], self.empty_kv(), None, 0)
        return {sid}

    def op_append(self, sid: int, n: int | None = None, span: bool = False) -> set[int]:
        s, sh = self.sessions[sid], self.shadows[sid]
        room = self.ctx - len(sh.tokens)
        n = self.length(room) if n is None else min(n, room)
        if n == 0:
            return self.op_bad_append(sid)
        ids = self.ids(n)
        arg: Any = self.rng.choice([ids, np.asarray(ids, np.int64), np.asarray(ids, np.int32), tuple(ids),
                                    np.asarray(ids, np.uint16) if self.V <= 65536 else ids])
        try:
            out = s.append(arg)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, InjectedFault):
                raise
            self.flag(f"append of {n} ids to session {sid} ({len(sh.tokens)} tokens) refused: {e!r}")
            self.rebase(sid)
            return set()
        start = len(sh.tokens)
        self.sh_append(sh, ids)
        sh.history.append(("append", ids))
        if span:
            sh.spans.append((start, n))
        out[:] = 12345.0  # the caller's copy: the session must not see it
        return {sid}

    def op_bad_append(self, sid: int) -> set[int]:
        V, n = self.V, len(self.shadows[sid].tokens)
        s = self.sessions[sid]
        cases: list[tuple[str, Any, tuple[type, ...], tuple[str, ...]]] = [
            ("[]", [], (InvalidArgument,), ("non-empty",)),
            ("np.array([], int64)", np.array([], np.int64), (InvalidArgument,), ("non-empty",)),
            ("[vocab]", [V], (InvalidArgument,), ("vocabulary",)),
            ("[-1]", [1, -1], (InvalidArgument,), ("vocabulary",)),
            ("[0, vocab+7]", np.array([0, V + 7], np.int64), (InvalidArgument,), ("vocabulary",)),
            ("floats", [1.0, 2.0], (InvalidArgument,), ("integer",)),
            ("bools", [True], (InvalidArgument,), ("bool", "integer")),
            ("bool array", np.array([True, False]), (InvalidArgument,), ("integer", "bool")),
            ("mixed int/bool", [3, np.bool_(True)], (InvalidArgument,), ("bool", "integer")),
            ("2-D", [[1, 2]], (InvalidArgument,), ("1-D",)),
            ("text", "hi", (InvalidArgument,), ("text",)),
            ("bytes", b"hi", (InvalidArgument,), ("text",)),
            ("int scalar", 7, (InvalidArgument,), ("1-D", "sequence", "token ids")),
            ("None", None, (InvalidArgument,), ("1-D", "sequence", "token ids")),
            ("0-d array", np.array(5), (InvalidArgument,), ("1-D",)),
            ("str ids", [1, "2"], (InvalidArgument,), ("integer",)),
            ("uint64 huge", np.array([2**63 + 5], np.uint64), (InvalidArgument,), ("vocabulary",)),
            ("past the context", [1] * (self.ctx - n + 1), (ResourceExhausted,), ("context",)),
        ]
        label, arg, kinds, words = self.rng.choice(cases)
        self.expect_refused(sid, f"append({label}) to session {sid}", lambda: s.append(arg), kinds, words)
        self.expect_refused(sid, f"check_append({label}) to session {sid}", lambda: s.check_append(arg), kinds, words)
        return set()

    def op_evict(self, sid: int) -> set[int]:
        s, sh = self.sessions[sid], self.shadows[sid]
        n, r = len(sh.tokens), self.rng
        if n == 0:
            return self.op_bad_evict(sid)
        mode = r.choice(["exact", "reposition"])
        kind = r.random()
        if kind < 0.35 and sh.spans:  # a tool-result span appended earlier
            start, length = sh.spans.pop(r.randrange(len(sh.spans)))
            if start + length > n:
                return self.op_bad_evict(sid)
        elif kind < 0.45 and sh.evicted:  # the positions of a span evicted before: valid if still inside
            start, length = r.choice(sh.evicted)
            if start + length > n:
                self.expect_refused(sid, f"evict({start}, {length}) again, past the end of session {sid} (n={n})",
                                    lambda: s.evict(start, length, mode), (InvalidArgument,), ("span",))
                return set()
        elif kind < 0.55:
            start, length = 0, r.randint(1, n)  # at position 0 (the whole session sometimes)
        elif kind < 0.65:
            length = r.randint(1, min(n, 20))
            start = n - length  # at the end: a truncation
        elif kind < 0.72:
            start, length = 0, n
        else:
            start = r.randrange(n)
            length = r.randint(1, min(n - start, 1 + r.choice([0, 3, 20, 100])))
        ints = r.choice([int, np.int64, np.int16 if n < 30000 else int, np.uint32])
        try:
            rep = s.evict(ints(start), ints(length), mode)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, InjectedFault):
                raise
            self.flag(f"evict({start}, {length}, {mode}) of session {sid} (n={n}) refused: {e!r}")
            self.rebase(sid)
            return set()
        want = self.sh_evict(sh, start, length, mode)
        sh.history.append(("evict", start, length, mode))
        sh.evicted.append((start, length))
        sh.spans = self.shift_spans(sh.spans, start, length)
        got = dict(tail=rep.tail, num_recomputed=rep.num_recomputed, num_rerotated=rep.num_rerotated,
                   logits_fresh=rep.logits_fresh, exact=rep.exact, invariant_delta=rep.invariant_delta)
        if (rep.mode, rep.start, rep.length, rep.num_evicted) != (mode, start, length, length) or got != want:
            self.flag(f"evict({start}, {length}, {mode}) of session {sid} (n={n}): report {rep}, expected {want}")
        for v in (rep.start, rep.length, rep.num_evicted):
            if type(v) is not int:
                self.flag(f"evict report holds a {type(v).__name__}, not an int")
        return {sid}

    @staticmethod
    def shift_spans(spans: list[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
        out = []
        for a, n in spans:
            if a + n <= start:
                out.append((a, n))
            elif a >= start + length:
                out.append((a - length, n))
        return out

    def op_bad_evict(self, sid: int) -> set[int]:
        s, n = self.sessions[sid], len(self.shadows[sid].tokens)
        cases: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
            ("start=-1", dict(start=-1, length=1), ("span",)),
            ("length=0", dict(start=0, length=0), ("span",)),
            ("past the end", dict(start=n, length=1), ("span",)),
            ("overlapping the end", dict(start=max(0, n - 1), length=2), ("span",)),
            ("float start", dict(start=0.0, length=1), ("integer",)),
            ("bool length", dict(start=0, length=True), ("integer",)),
            ("str start", dict(start="0", length=1), ("integer",)),
            ("None length", dict(start=0, length=None), ("integer",)),
            ("bad mode", dict(start=0, length=1, mode="fast"), ("mode",)),
            ("mode None", dict(start=0, length=1, mode=None), ("mode",)),
            ("mode as an array", dict(start=0, length=1, mode=np.array(["exact"])), ("mode",)),
            ("np.int8 wrap", dict(start=np.int8(100), length=np.int8(100)), ("span",)),
            ("huge length", dict(start=0, length=2**70), ("span",)),
        ]
        label, kw, words = self.rng.choice(cases)
        if label == "np.int8 wrap" and n >= 200:
            return set()
        self.expect_refused(sid, f"evict({label}) of session {sid} (n={n})", lambda: s.evict(**kw),
                            (InvalidArgument,), words)
        return set()

    def op_fork(self, sid: int) -> set[int]:
        child = self.new_id()
        self.sessions[child] = self.sessions[sid].fork()
        sh = self.shadows[sid].copy()
        self.shadows[child] = sh
        return {child}

    def op_generate(self, sid: int) -> set[int]:
        s, sh = self.sessions[sid], self.shadows[sid]
        n = len(sh.tokens)
        if n == 0 or self.rng.random() < 0.1:
            cases = [("negative", -1, (InvalidArgument,), ("non-negative",)),
                     ("float", 1.5, (InvalidArgument,), ("integer",)),
                     ("bool", True, (InvalidArgument,), ("integer",)),
                     ("past the context", self.ctx - n + 1, (ResourceExhausted,) if n else (ResourceExhausted,
                      InvalidArgument), ("context", "at least one token"))]
            if n == 0:
                cases.append(("on an empty session", 1, (InvalidArgument,), ("at least one token",)))
            label, arg, kinds, words = self.rng.choice(cases)
            self.expect_refused(sid, f"generate({label}) on session {sid} (n={n})", lambda: s.generate(arg), kinds,
                                words)
            return set()
        k = min(self.rng.choice([0, 1, 1, 2, 5]), self.ctx - n)
        partial = False
        try:
            got = s.generate(k)
        except InjectedFault:
            # it keeps the tokens decoded before the failing step (docs/kernel.md), each step all or nothing; the
            # last token re-derived first (last_logits None after a reposition) is a step of its own
            got, partial = s.tokens[n:], True
            self.faults_fired += 1
            self.counts["generate failed part way"] = self.counts.get("generate failed part way", 0) + 1
            if s.tokens[:n] != sh.tokens:
                self.flag(f"generate({k}) on session {sid} failed part way and its first {n} tokens changed")
                self.rebase(sid)
                return set()
            if not got and (s.last_logits is None) == (sh.logits is None):
                return set()  # nothing done: the run's check compares it with its state before
        except Exception as e:  # noqa: BLE001
            self.flag(f"generate({k}) on session {sid} (n={n}) raised {e!r}")
            self.rebase(sid)
            return set()
        if (k or partial) and sh.logits is None:
            self.sh_recompute_last(sh, n)
        for tok in got:
            assert sh.logits is not None
            top = np.sort(sh.logits)[-2:]
            if int(np.argmax(sh.logits)) != tok and top[1] - top[0] > 2 * TOL:
                self.flag(f"generate on session {sid}: decoded {tok}, the reference's argmax is "
                          f"{int(np.argmax(sh.logits))} (margin {top[1] - top[0]:.3g})")
            self.sh_append(sh, [tok])
        if len(got) != k and not partial:
            self.flag(f"generate({k}) returned {len(got)} ids")
        sh.history.append(("generate", k, tuple(got)) if not partial else ("generate_partial", tuple(got)))
        return {sid}

    def op_export(self, sid: int) -> set[int]:
        s, sh = self.sessions[sid], self.shadows[sid]
        n, BS = len(sh.tokens), self.BS
        r = self.rng
        if n < BS or r.random() < 0.15:
            bad = r.choice([0, -BS, BS + 1 if BS > 1 else 0, (n // BS + 1) * BS, 1.0 * BS, True])
            self.expect_refused(sid, f"export_prefix({bad!r}) of session {sid} (n={n})", lambda: s.export_prefix(bad),
                                (InvalidArgument,), ("multiple of block_size",))
            return set()
        num = BS * r.randint(1, n // BS)
        if num > sh.exact_upto:
            self.expect_refused(sid, f"export_prefix({num}) of session {sid} past num_exact_tokens={sh.exact_upto}",
                                lambda: s.export_prefix(num), (FailedPrecondition,), ("reposition",))
            return set()
        try:
            p = s.export_prefix(num)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, InjectedFault):
                raise
            self.flag(f"export_prefix({num}) of session {sid} (n={n}, exact {sh.exact_upto}) raised {e!r}")
            return set()
        for a in p.blocks:  # read-only: a caller writing them must get an error, not change the cache
            try:
                a[...] = 7.0
                self.flag(f"export_prefix({num}) of session {sid}: a block array is writable")
            except ValueError:
                pass
        child = self.new_id()
        if r.random() < 0.3:  # a forged prefix: refused with InvalidArgument, whatever is wrong with it
            label, bad = r.choice([
                ("an id outside the vocabulary", dataclasses.replace(p, tokens=(*p.tokens[:-1], self.V))),
                ("a float id", dataclasses.replace(p, tokens=(*p.tokens[:-1], 1.0))),
                ("a bool id", dataclasses.replace(p, tokens=(True, *p.tokens[1:]))),
                ("another model's", dataclasses.replace(p, model_id="0" * 16)),
                ("one token short", dataclasses.replace(p, tokens=p.tokens[:-1])),
                ("tokens None", dataclasses.replace(p, tokens=None)),
                ("blocks as lists", dataclasses.replace(p, blocks=tuple(a.tolist() for a in p.blocks))),
                ("float64 blocks", dataclasses.replace(p, blocks=tuple(a.astype(np.float64) for a in p.blocks))),
                ("another block_size", dataclasses.replace(p, block_size=BS + 1)),
            ])
            try:
                self.kernel.session(prefix=bad)
                self.flag(f"a forged prefix ({label}) was adopted")
            except InvalidArgument:
                pass
            except Exception as e:  # noqa: BLE001
                if isinstance(e, InjectedFault):
                    raise
                self.flag(f"a forged prefix ({label}) raised {type(e).__name__}: {e!r}, not InvalidArgument")
        if r.random() < 0.3:  # as Ray's object store hands it to another actor: pickled, plain numpy arrays
            p = pickle.loads(pickle.dumps(p))
        t = self.kernel.session(prefix=p)
        self.sessions[child] = t
        csh = Shadow(list(sh.tokens[:num]), sh.kv[:, :, :, :num].copy(), None, num)
        csh.history = [("append", list(sh.tokens[:num]), "adopted")]
        self.shadows[child] = csh
        return {child}

    def op_close(self, sid: int) -> set[int]:
        s = self.sessions[sid]
        if self.rng.random() < 0.5:
            s.close()
            self.sessions.pop(sid)
            self.shadows.pop(sid)
            self.snaps.pop(sid, None)
            return set()
        s.close()  # closed, then used again: an empty session
        sh = self.shadows[sid]
        sh.tokens, sh.kv, sh.logits, sh.exact_upto, sh.spans, sh.evicted = [], self.empty_kv(), None, 0, [], []
        sh.history.append(("close",))
        return {sid}

    def op_caller_writes(self, sid: int) -> set[int]:
        """Arrays and lists handed out are the caller's: writing them changes nothing."""
        s = self.sessions[sid]
        lg = s.last_logits
        if lg is not None:
            lg[:] = -1.0
        toks = s.tokens
        toks[:] = [0] * len(toks)
        toks.append(1)
        pos = s.positions
        pos.clear()
        if len(s):
            kv = s.kv_numpy(0, len(s))
            kv[...] = 0.0
        return set()

    def op_bad_reads(self, sid: int) -> set[int]:
        s, n = self.sessions[sid], len(self.shadows[sid].tokens)
        cases = [("kv_numpy(0, 0)", lambda: s.kv_numpy(0, 0)), ("kv_numpy(-1, n)", lambda: s.kv_numpy(-1, n)),
                 ("kv_numpy(0, n+1)", lambda: s.kv_numpy(0, n + 1)),
                 ("rope_invariant_delta(0, n+1)", lambda: s.rope_invariant_delta(0, n + 1)),
                 ("layer0_delta(2, 1)", lambda: s.layer0_delta(2, 1))]
        label, fn = self.rng.choice(cases)
        self.expect_refused(sid, f"{label} on session {sid} (n={n})", fn, (InvalidArgument,), ("<=",))
        return set()

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self, num_ops: int) -> None:
        r = self.rng
        ops = [("new", 3), ("append", 30), ("span", 10), ("evict", 22), ("fork", 8), ("generate", 7),
               ("export", 5), ("close", 3), ("bad_append", 5), ("bad_evict", 4), ("caller_writes", 2),
               ("bad_reads", 2), ("long", 2)]
        names, weights = zip(*ops, strict=True)
        self.op_new()
        self.check_all("new", {0})
        for self.step in range(1, num_ops + 1):
            op = r.choices(names, weights)[0]
            if op != "new" and not self.sessions:
                op = "new"
            if len(self.sessions) >= 8 and op in ("fork", "export", "new"):
                op = "close"
            sid = self.pick()
            self.counts[op] = self.counts.get(op, 0) + 1
            assert sid is not None or op == "new"
            before_n = len(self.shadows[sid].tokens) if sid is not None else 0
            fault = self.arm(op)
            try:
                if op == "new":
                    touched = self.op_new()
                elif op == "append":
                    touched = self.op_append(sid)  # type: ignore[arg-type]
                elif op == "span":
                    touched = self.op_append(sid, self.rng.randint(1, 40), span=True)  # type: ignore[arg-type]
                elif op == "long":
                    huge = self.long and self.rng.random() < 0.3
                    n = self.rng.randint(2049, 2300) if huge else self.rng.randint(100, 400)
                    touched = self.op_append(sid, n)  # type: ignore[arg-type]
                else:
                    touched = getattr(self, f"op_{op}")(sid)
            except Finding:
                continue
            except InjectedFault as e:  # all or nothing: every session as it was before the op
                self.disarm()
                self.faults_fired += 1
                for other in list(self.sessions):
                    if other in self.snaps and not Snap.of(self.sessions[other]).same(self.snaps[other]):
                        self.flag(f"{op} on session {sid} failed part way ({e}) and session {other} changed")
                        self.rebase(other)
                self.check_sharing(f"{op} on session {sid} failed part way ({e})")
                continue
            except Exception:  # noqa: BLE001
                self.flag(f"{op} on session {sid}: the fuzzer itself failed:\n{traceback.format_exc()}")
                continue
            finally:
                if fault:
                    self.disarm()
            if self.verbose:
                print(f"step {self.step}: {op} on {sid} (n {before_n} -> "
                      f"{len(self.shadows[sid].tokens) if sid in self.shadows else '-'}), touched {sorted(touched)}")
            self.check_all(f"{op} on session {sid}", touched)
        self.replay_all()

    @staticmethod
    def refresh(t: Session) -> None:
        """Re-derive the last token of `t` as generate's first step does (a generate that failed right after it)."""
        t._refresh_last()

    FAULT_POINTS = ("zeros", "copy", "cat", "rope", "rope_rows", "layer0", "qkv", "attention", "mlp", "logits",
                    "embed", "_row0")

    def arm(self, op: str) -> bool:
        """With --faults, make one of the ops' primitives raise at its k-th call during the next op (an out of
        memory part way, say): the op must then leave every session as it was (docs/kernel.md, "A failure part way
        ... is all or nothing too"); a decode keeps the tokens decoded before its failing step (op_generate)."""
        if not self.faults or op not in ("append", "span", "long", "evict", "export", "fork", "generate") \
                or self.rng.random() > 0.5:
            return False
        name, k = self.rng.choice(self.FAULT_POINTS), self.rng.randint(1, 6)
        ops, real, calls = self.kernel.ops, getattr(self.kernel.ops, name), [0]

        def faulty(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == k:
                raise InjectedFault(f"{name} failed at its call {k}")
            return real(*a, **kw)

        setattr(ops, name, faulty)  # an instance attribute: shadows the method for this kernel only
        self.armed = name
        return True

    def disarm(self) -> None:
        if self.armed:
            delattr(self.kernel.ops, self.armed)
            self.armed = ""

    def replay_all(self) -> None:
        """Each session's history on a second kernel of the same model: the same digest and logits, bit for bit;
        and on the other backend: K/Kraw/V and logits within 1e-4 (docs/kernel.md, "numpy vs torch")."""
        self.replay_on(self.make_kernel(), exact=True)
        other = "torch" if self.backend == "numpy" else "numpy"
        try:
            kx = self.make_kernel(other)
        except ImportError:
            return
        self.replay_on(kx, exact=False)

    def replay_on(self, k2: Kernel, exact: bool) -> None:
        """Replay every live session's history on `k2`: bit for bit (`exact`), or within TOL (another backend)."""
        if exact and k2.model_id != self.kernel.model_id:
            self.flag("a second kernel of the same model has another model_id")
        where = "a second kernel" if exact else f"the {k2.backend} backend"
        for sid, s in self.sessions.items():
            t, diverged = k2.session(), False
            for h in self.shadows[sid].history:
                if h[0] == "append" and h[2:] == ("adopted",):  # adopt them, exported by a session of k2
                    src = k2.session()
                    src.append(h[1])
                    t = k2.session(prefix=src.export_prefix(len(h[1])))
                elif h[0] == "append":
                    t.append(h[1])
                elif h[0] == "evict":
                    t.evict(h[1], h[2], h[3])
                elif h[0] == "generate":
                    got = t.generate(h[1])
                    if tuple(got) != h[2]:
                        if exact:
                            self.flag(f"replay of session {sid}: generate decoded {got}, the original {list(h[2])}")
                        diverged = True  # another backend may break a near-tie the other way: not comparable
                        break
                elif h[0] == "generate_partial":  # the steps that succeeded: the same greedy tokens
                    if h[1]:
                        got = t.generate(len(h[1]))
                        if tuple(got) != h[1]:
                            diverged = True
                            if exact:
                                self.flag(f"replay of session {sid}: generate decoded {got}, the original {h[1]}")
                            break
                    else:  # only the last token re-derived: what generate does first, then nothing
                        t.generate(0) if t.last_logits is not None else self.refresh(t)
                elif h[0] == "close":
                    t.close()
            if diverged:
                continue
            la, lb = s.last_logits, t.last_logits
            if exact:
                a, b = Snap.of(s), Snap.of(t)
                if a.digest != b.digest or a.tokens != b.tokens:
                    self.flag(f"replay of session {sid} ({len(self.shadows[sid].history)} ops) on {where}: digest "
                              "differs")
                if la is not None and lb is not None and not np.array_equal(la, lb):
                    self.flag(f"replay of session {sid}: last logits differ by {delta(la, lb):.3g}")
                continue
            if s.tokens != t.tokens or (la is None) != (lb is None):
                self.flag(f"replay of session {sid} on {where}: {len(t)} tokens (here {len(s)}, equal: "
                          f"{s.tokens == t.tokens}), last logits {'None' if lb is None else 'set'} (here "
                          f"{'None' if la is None else 'set'}); history {[h[0] for h in self.shadows[sid].history]}")
                continue
            d = max(delta(la, lb) if la is not None else 0.0, delta(s.kv_numpy(0, len(s)), t.kv_numpy(0, len(t)))
                    if len(s) else 0.0)
            self.max_cross_delta = max(self.max_cross_delta, d)
            if d > TOL:
                self.flag(f"replay of session {sid} on {where}: K/Kraw/V or logits differ by {d:.3g} (> {TOL})")


# ---------------------------------------------------------------------------------------------------------------
# Through the real path: a local Ray cluster and a KernelFleet (as tests/workers start them)
# ---------------------------------------------------------------------------------------------------------------


def ledger_vs_kernel(ctx: Any, what: str, flag: Any) -> None:
    """The ledger's piece states against the kernel's exactness: a `shifted` piece holds a position past
    `num_exact_tokens` (its KV is not a prefill's), and the pieces in the cache tile it in order."""
    from fleet.core.context import RESIDENT, SHIFTED

    e, at = ctx.session.num_exact_tokens, 0
    for p in ctx.pieces:
        if p.state == SHIFTED and p.end <= e:
            flag(f"{what}: piece {p.piece_id} [{p.start}, {p.end}) is 'shifted' but the kernel holds a prefill's KV "
                 f"up to {e}")
        if p.state in (RESIDENT, SHIFTED):
            if p.start != at:
                flag(f"{what}: piece {p.piece_id} starts at {p.start}, the pieces before it end at {at}")
            at = p.end
    if at != len(ctx.session):
        flag(f"{what}: the pieces in the cache hold {at} tokens, the session {len(ctx.session)}")


def run_context(seed: int, num_ops: int, backend: str) -> list[str]:
    """The piece ledger in process (fleet.core.context.SessionContext, no Ray): random pieces (many of one token),
    evictions in both modes (the tail often), forks, decode; after each op the ledger against the kernel
    (`ledger_vs_kernel`), the session against a fresh prefill while it is exact, and its op log replayed (op by op,
    and over its ledger when the log's KV follows its tokens) to the same digest."""
    import tempfile

    from fleet.cas import open_store
    from fleet.core.context import EVICTED, RESIDENT, SHIFTED, SessionContext
    from fleet.core.errors import KvfleetError
    from fleet.core.oplog import exact_tokens, kv_follows_tokens
    from fleet.core.quarantine.admit import admit_tool_result
    from fleet.core.quarantine.detector import Verdict
    from workers.spec import KernelSpec, make_kernel, make_tokenizer

    rng = random.Random(seed)
    findings: list[str] = []
    kernel = make_kernel(KernelSpec(block_size=16, backend=backend, config=(("n_layers", 1 + seed % 3),)))
    tok = make_tokenizer(kernel)
    V = kernel.config.vocab_size

    def flag(msg: str) -> None:
        findings.append(f"[context/{backend}] {msg}")
        print("FINDING:", findings[-1], flush=True)

    tmp = tempfile.mkdtemp(prefix="kvfleet-fuzz-")
    store = open_store(f"sqlite:///{tmp}/ctx.db")
    blobs = [f"tool output {i}: {'z' * i}".encode() for i in range(1, 6)] + [b"!"]  # one of a single token
    ctxs = {"c0": SessionContext.new(kernel, tok, "t", "c0", store=store)}
    ctxs["c0"].add_system("Be brief.")
    n = 1
    for step in range(1, num_ops + 1):
        sid = rng.choice(sorted(ctxs))
        ctx = ctxs[sid]
        op = rng.choice(["output", "output", "one", "one", "evict", "evict", "tail", "fork", "generate", "tool",
                         "quarantine"])
        what = f"step {step}: {op} on {sid}"
        live = [p.piece_id for p in ctx.pieces if p.state in (RESIDENT, SHIFTED)]
        try:
            if op == "tool":
                data = rng.choice(blobs)
                ref = store.put(data, "t")
                if store.stat(ref, "t").quarantined:  # held out of every context: refused, nothing changes
                    before = ctx.digest(), len(ctx.ops)
                    try:
                        ctx.add_tool_result(ref, data)
                        flag(f"{what}: a quarantined blob was appended")
                    except FailedPrecondition:
                        pass
                    if (ctx.digest(), len(ctx.ops)) != before:
                        flag(f"{what}: a refused tool result changed the session or its log")
                    continue
                ctx.add_tool_result(ref, data)
            elif op == "quarantine" and any(p.ref for p in ctx.pieces):
                ref = str(rng.choice([p.ref for p in ctx.pieces if p.ref]))
                adm = admit_tool_result(ctx, ref, store, "t", verdict=Verdict(True, ["fuzz"]))
                pr = adm.proof
                if pr is not None and pr.exact != (pr.cache_digest_equal and pr.max_abs_delta_evict_vs_never == 0.0):
                    flag(f"{what}: the eviction proof's exact={pr.exact} disagrees with its own measurements {pr}")
                if any(p.ref == ref and p.state in (RESIDENT, SHIFTED) for p in ctx.pieces):
                    flag(f"{what}: a quarantined ref still has pieces in the cache")
            elif op in ("output", "one"):
                ctx.add_output([rng.randrange(V) for _ in range(1 if op == "one" else rng.randint(2, 30))])
            elif op in ("evict", "tail") and live:
                pid = live[-1] if op == "tail" else rng.choice(live)
                ctx.evict_piece(pid, rng.choice(["exact", "reposition"]))
            elif op == "fork":
                child = f"c{n}"
                n += 1
                ctxs[child] = ctx.fork(child)
            elif op == "generate" and len(ctx.session):
                ctx.generate(rng.choice([1, 2]))
        except KvfleetError as e:
            flag(f"{what}: refused {e!r}")
            continue
        ledger_vs_kernel(ctx, what, flag)
        logged, e = exact_tokens(ctx.ops), ctx.session.num_exact_tokens
        if logged > e or (logged != e and kernel.config.n_layers > 1):  # 1 layer: the log does not measure
            flag(f"{what}: the op log says {logged} exact tokens (oplog.exact_tokens), the kernel {e}")
        if ctx.session.num_exact_tokens == len(ctx.session) and len(ctx.session):
            fresh = kernel.session()
            fresh.append(ctx.session.tokens)
            if fresh.digest() != ctx.digest():
                flag(f"{what}: {sid} is exact by num_exact_tokens but not a fresh prefill of its tokens")
        if [p.state for p in ctx.pieces if p.state == EVICTED] and step % 5:
            continue
        again = SessionContext.replay(list(ctx.ops), kernel, tok, lambda r: bytes(store.get(r, "t")), "t", sid)
        if again.digest() != ctx.digest() or [p.state for p in again.pieces] != [p.state for p in ctx.pieces]:
            flag(f"{what}: {sid}'s op log replayed op by op gives another digest or other piece states")
        if kv_follows_tokens(ctx.ops):
            try:
                over = SessionContext.replay_over(list(ctx.ops), kernel.session(), tok,
                                                  lambda r: bytes(store.get(r, "t")), "t", sid)
            except KvfleetError as e:
                if "reposition" not in str(e):
                    flag(f"{what}: replay_over refused {sid}'s log: {e!r}")
            else:
                if over.digest() != ctx.digest():
                    flag(f"{what}: {sid}'s log replayed over its ledger gives another digest")
    store.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return findings


def run_fleet(seed: int, num_ops: int, backend: str) -> list[str]:
    """A short random sequence through a KernelFleet on a local Ray cluster, each op given to an in-process
    SessionContext too: the same answers (or the same refusal), tokens, digest, logits and piece states."""
    import uuid

    import ray

    from fleet.core.context import EVICTED, QUARANTINED, RESIDENT, SHIFTED, SessionContext
    from fleet.core.errors import KvfleetError, NotFound
    from fleet.core.oplog import parse_log
    from fleet.core.quarantine.admit import admit_tool_result
    from fleet.core.quarantine.detector import Verdict
    from workers.fleet import KernelFleet
    from workers.spec import KernelSpec, make_kernel, make_tokenizer

    rng = random.Random(seed)
    findings: list[str] = []
    spec = KernelSpec(block_size=16, backend=backend)
    kernel = make_kernel(spec)
    tok = make_tokenizer(kernel)
    V = kernel.config.vocab_size

    flag = _flagger(findings, f"fleet/{backend}")

    tmp = _local_ray()
    fleet = KernelFleet(f"sqlite:///{tmp}/kvfleet.db", spec, call_timeout_s=120.0)
    tenant = "fz" + uuid.uuid4().hex[:6]
    local: dict[str, SessionContext] = {}
    counts: dict[str, int] = {}

    def fetch(ref: str) -> bytes:
        return bytes(fleet.store.get(ref, tenant))

    def compare(sid: str, what: str) -> None:
        ctx = local[sid]
        snap = fleet.snapshot(tenant, sid, include_tokens=True)
        toks = snap["tokens"]
        if toks != ctx.session.tokens:
            flag(f"{what}: fleet session {sid} holds {len(toks)} tokens, the in-process context {len(ctx.session)}")
            return
        if snap["digest"] != ctx.digest():
            flag(f"{what}: fleet session {sid} digest differs from the in-process context given the same ops")
        fl, ll = fleet.last_logits(tenant, sid), ctx.session.last_logits
        if (fl is None) != (ll is None) or (fl is not None and not np.array_equal(fl, ll)):
            flag(f"{what}: fleet session {sid} last logits differ from the in-process context's")
        if ctx.session.num_exact_tokens == len(toks) and toks:
            fresh = kernel.session()
            fresh.append(toks)
            if fresh.digest() != snap["digest"]:
                flag(f"{what}: fleet session {sid} is not a fresh prefill of its {len(toks)} tokens")
        if [p.state for p in fleet.pieces(tenant, sid)] != [p.state for p in ctx.pieces]:
            flag(f"{what}: fleet session {sid} piece states differ from the in-process context's")
        ledger_vs_kernel(ctx, what, flag)

    def both(sid: str, what: str, on_fleet: Any, on_local: Any) -> tuple[Any, Any] | None:
        """Run an op on the fleet and in process: both answer, or both refuse with the same error (and the fleet's
        session is unchanged). Returns the two answers, or None after a refusal."""
        before = fleet.digest(tenant, sid)
        errs: list[BaseException | None] = []
        outs: list[Any] = []
        for fn in (on_fleet, on_local):
            try:
                outs.append(fn())
                errs.append(None)
            except KvfleetError as e:
                outs.append(None)
                errs.append(e)
        if type(errs[0]) is not type(errs[1]):
            flag(f"{what}: the fleet answered {errs[0]!r}, the in-process context {errs[1]!r}")
        if errs[0] is not None:
            if fleet.digest(tenant, sid) != before:
                flag(f"{what}: refused ({errs[0]!r}) but the session changed")
            return None
        return outs[0], outs[1]

    def bad_calls(s: str, n: int) -> list[tuple[str, Any, tuple[type, ...]]]:
        return [
            ("evict a piece that does not exist", lambda: fleet.evict(tenant, s, n + 3), (NotFound,)),
            ("evict piece -1", lambda: fleet.evict(tenant, s, -1), (NotFound,)),
            ("evict with a bad mode", lambda: fleet.evict(tenant, s, 0, mode="fast"), (InvalidArgument,)),
            ("append no ids", lambda: fleet.append_output(tenant, s, []), (InvalidArgument,)),
            ("append an id outside the vocabulary", lambda: fleet.append(tenant, s, [1, V]), (InvalidArgument,)),
            ("append id -1", lambda: fleet.append(tenant, s, [-1]), (InvalidArgument,)),
            ("generate -1", lambda: fleet.generate(tenant, s, -1), (InvalidArgument,)),
            ("append a bool id", lambda: fleet.append(tenant, s, [True]), (InvalidArgument,)),
            ("append empty text", lambda: fleet.append(tenant, s, ""), (InvalidArgument,)),
            ("a tool result never stored", lambda: fleet.add_tool_result(tenant, s, "0" * 64), (NotFound,)),
        ]

    def refused(sid: str, what: str, fn: Any, kinds: tuple[type, ...]) -> None:
        before = fleet.digest(tenant, sid)
        try:
            fn()
        except kinds:
            pass
        except Exception as e:  # noqa: BLE001
            flag(f"{what}: raised {type(e).__name__}: {e}, expected {[k.__name__ for k in kinds]}")
        else:
            flag(f"{what}: accepted")
        if fleet.digest(tenant, sid) != before:
            flag(f"{what}: refused but the session changed")

    try:
        prompts = ["You are a fuzzer. Be exact. " * 2, "You are a fuzzer. Be exact. " * 3 + "Reply briefly.", "x"]
        adopted_total = [0]
        prompt = prompts[0]
        fleet.create_session(tenant, "s0", prompt)
        local["s0"] = SessionContext.new(kernel, tok, tenant, "s0", store=fleet.store)
        local["s0"].add_system(prompt)
        compare("s0", "create")
        nsess = 1
        for step in range(1, num_ops + 1):
            sid = rng.choice(sorted(local))
            ctx = local[sid]
            op = rng.choice(["msg", "msg", "output", "tool", "tool", "evict", "evict", "fork", "generate", "bad",
                             "quarantine", "release", "create", "close"])
            counts[op] = counts.get(op, 0) + 1
            what = f"step {step}: {op} on {sid}"
            if op == "msg":
                text = "".join(rng.choice("abc xyz.\n") for _ in range(rng.randint(1, 40)))
                role = rng.choice(["user", "assistant"])
                both(sid, what, lambda: fleet.append(tenant, sid, text, role=role), lambda: ctx.add_message(role, text))
            elif op == "output":
                ids = [rng.choice([0, V - 1, rng.randrange(V)]) for _ in range(rng.randint(1, 20))]
                both(sid, what, lambda: fleet.append(tenant, sid, ids), lambda: ctx.add_output(ids))
            elif op == "tool":
                data = f"tool result {step}: {rng.random()}".encode() * rng.randint(1, 4)
                ref = fleet.store.put(data, tenant)
                both(sid, what, lambda: fleet.add_tool_result(tenant, sid, ref),
                     lambda: ctx.add_tool_result(ref, data))
            elif op == "evict":
                mode = rng.choice(["exact", "reposition"])
                dead = [p.piece_id for p in ctx.pieces if p.state in (EVICTED, QUARANTINED)]
                live = [p.piece_id for p in ctx.pieces if p.state in (RESIDENT, SHIFTED)]
                again = bool(dead) and rng.random() < 0.3
                pid = rng.choice(dead if again else live or [0])
                what += f" (piece {pid}{', evicted before' if again else ''}, {mode})"
                got = both(sid, what, lambda: fleet.evict(tenant, sid, pid, mode=mode).result,
                           lambda: ctx.evict_piece(pid, mode))
                if again and got is not None:
                    flag(f"{what}: an evicted piece was evicted again")
                if got is not None and got[0] != got[1] and dataclasses.replace(got[0], invariant_delta=None) != \
                        dataclasses.replace(got[1], invariant_delta=None):
                    flag(f"{what}: fleet report {got[0]} differs from the in-process context's {got[1]}")
            elif op == "quarantine":  # a verdict on a tool result: its pieces evicted ("exact") with a proof each
                refs = sorted({str(p.ref) for p in ctx.pieces if p.ref is not None})
                if not refs:
                    continue
                ref = rng.choice(refs)
                v = Verdict(True, ["fuzz"])
                got = both(sid, what, lambda: fleet.admit_tool_result(tenant, sid, ref, verdict=v).result,
                           lambda: admit_tool_result(ctx, ref, fleet.store, tenant, verdict=v))
                if got is not None:
                    a, b = got
                    if (a.verdict, a.evicted, a.proof is None) != (b.verdict, b.evicted, b.proof is None):
                        flag(f"{what}: fleet admission {a} differs from the in-process one {b}")
                    pr = a.proof
                    if pr is not None and pr.exact and (not pr.cache_digest_equal or pr.max_abs_delta_evict_vs_never):
                        flag(f"{what}: the proof says exact but the cache differs from never-saw's: {pr}")
                    if pr is not None and ctx.session.num_exact_tokens == len(ctx.session) and not pr.exact:
                        flag(f"{what}: the proof says not exact on a session that is a prefill of its tokens: {pr}")
            elif op == "fork":
                child = f"s{nsess}"
                nsess += 1
                fleet.fork(tenant, sid, child, share=rng.random() < 0.7)
                local[child] = ctx.fork(child)
                compare(child, what)
            elif op == "generate":
                k = rng.choice([1, 2, 4])
                got = both(sid, what, lambda: fleet.generate(tenant, sid, k).result, lambda: ctx.generate(k))
                if got is not None and tuple(got[0].tokens) != tuple(got[1].tokens):
                    flag(f"{what}: fleet decoded {got[0].tokens}, the in-process context {got[1].tokens}")
            elif op == "bad":
                label, fn, kinds = rng.choice(bad_calls(sid, len(ctx.pieces)))
                refused(sid, f"{what}: {label}", fn, kinds)
            elif op == "create":  # prompts sharing whole blocks: a create adopts them from the node's radix tree
                sid = f"s{nsess}"
                nsess += 1
                text = rng.choice(prompts) + "".join(rng.choice("uvw ") for _ in range(rng.randint(0, 20)))
                row = fleet.create_session(tenant, sid, text)
                local[sid] = SessionContext.new(kernel, tok, tenant, sid, store=fleet.store)
                local[sid].add_system(text)
                adopted_total[0] += int(row.get("adopted_tokens", 0) or 0)
            elif op == "release":  # its kernel dropped: the next call rebuilds it from its op log
                fleet.release_session(tenant, sid)
            elif op == "close":
                if len(local) < 2:
                    continue
                fleet.close(tenant, sid)
                local.pop(sid)
                try:
                    fleet.digest(tenant, sid)
                    flag(f"{what}: a closed session still answers")
                except NotFound:
                    pass
                continue
            compare(sid, what)
            for other in local:  # isolation: every other session still equals its in-process twin
                if other != sid and fleet.digest(tenant, other) != local[other].digest():
                    flag(f"{what}: session {other} changed, or differs from its in-process twin (branch leak)")
        for sid in local:  # each log replayed from scratch gives the same cache
            replayed = SessionContext.replay(parse_log(fleet.store.oplog_read(tenant, sid)), kernel, tok, fetch,
                                             tenant, sid)
            if replayed.digest() != fleet.digest(tenant, sid):
                flag(f"the op log of {sid} replayed in process gives another digest")
    finally:
        fleet.shutdown()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"fleet ops: {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}; tokens adopted by creates "
          f"{adopted_total[0]}")
    return findings


async def run_sdk(seed: int, num_ops: int) -> list[str]:
    """A short random sequence through the SDK: AsyncFleetClient -> a controller on 127.0.0.1:0 (gRPC) -> its kernel
    fleet on a local Ray cluster (the default model, numpy), each op given to an in-process SessionContext too."""
    import asyncio
    import hashlib

    import ray

    from controller.config import ControllerConfig
    from controller.metrics import Metrics
    from controller.server import build_server
    from fleet.core.context import EVICTED, RESIDENT, SHIFTED, SessionContext
    from fleet.core.errors import KvfleetError, NotFound
    from fleet.sdk import AsyncFleetClient
    from workers.spec import KernelSpec, make_kernel, make_tokenizer

    rng = random.Random(seed)
    findings: list[str] = []
    kernel = make_kernel(KernelSpec(block_size=16))
    tok = make_tokenizer(kernel)
    V = kernel.config.vocab_size

    flag = _flagger(findings, "sdk")

    tmp = _local_ray()
    ctl = await build_server(ControllerConfig(store_url=f"sqlite:///{tmp}/kvfleet.db", tokens_file=None,
                                              start_router=False, listen="127.0.0.1:0"), metrics=Metrics())
    c = AsyncFleetClient(ctl.address)
    local: dict[str, SessionContext] = {}

    async def compare(sid: str, what: str, logits: np.ndarray | None = None) -> None:
        ctx = local[sid]
        st = await c.get_session(sid, include_tokens=True)
        if list(st.token_ids) != ctx.session.tokens or st.row.num_tokens != len(ctx.session):
            flag(f"{what}: session {sid} holds {len(st.token_ids)} tokens over the SDK, the in-process context "
                 f"{len(ctx.session)}")
            return
        if st.digest != ctx.digest():
            flag(f"{what}: session {sid} digest over the SDK differs from the in-process context's")
        last = ctx.session.last_logits
        if logits is not None and (last is None or not np.array_equal(logits, last)):
            flag(f"{what}: the logits the SDK returned differ from the in-process context's")
        if ctx.session.num_exact_tokens == len(ctx.session) and len(ctx.session):
            fresh = kernel.session()
            fresh.append(ctx.session.tokens)
            if fresh.digest() != st.digest:
                flag(f"{what}: session {sid} over the SDK is not a fresh prefill of its tokens")
        ledger_vs_kernel(ctx, what, flag)

    async def both(what: str, on_sdk: Any, on_local: Any) -> tuple[Any, Any] | None:
        errs: list[BaseException | None] = []
        outs: list[Any] = []
        for i, fn in enumerate((on_sdk, on_local)):
            try:
                outs.append(await fn() if i == 0 else fn())
                errs.append(None)
            except KvfleetError as e:
                outs.append(None)
                errs.append(e)
        if type(errs[0]) is not type(errs[1]):
            flag(f"{what}: the SDK answered {errs[0]!r}, the in-process context {errs[1]!r}")
        return None if errs[0] is not None or errs[1] is not None else (outs[0], outs[1])

    try:
        prompt = "You are the SDK's fuzzer."
        await c.create_session("s0", prompt)
        local["s0"] = SessionContext.new(kernel, tok, "local", "s0")
        local["s0"].add_system(prompt)
        await compare("s0", "create")
        n = 1
        for step in range(1, num_ops + 1):
            sid = rng.choice(sorted(local))
            ctx = local[sid]
            op = rng.choice(["text", "ids", "tool", "evict", "evict", "fork", "generate", "bad"])
            what = f"step {step}: {op} on {sid}"
            logits = None
            if op == "text":
                text = "".join(rng.choice("pqr st.") for _ in range(rng.randint(1, 30)))
                got = await both(what, lambda: c.append(sid, text, return_logits=True),
                                 lambda: ctx.add_message("user", text))
                logits = got[0].logits if got else None
            elif op == "ids":
                ids = [rng.choice([0, V - 1, rng.randrange(V)]) for _ in range(rng.randint(1, 12))]
                got = await both(what, lambda: c.append(sid, ids, return_logits=True), lambda: ctx.add_output(ids))
                logits = got[0].logits if got else None
            elif op == "tool":
                data = f"result {step} {rng.random()}".encode()
                ref = await c.put_blob(data)
                if str(ref) != hashlib.sha256(data).hexdigest():
                    flag(f"{what}: put_blob answered ref {ref}")
                await both(what, lambda: c.add_tool_result(sid, ref), lambda: ctx.add_tool_result(str(ref), data))
            elif op == "evict":
                mode = rng.choice(["exact", "reposition"])
                dead = [p.piece_id for p in ctx.pieces if p.state == EVICTED]
                live = [p.piece_id for p in ctx.pieces if p.state in (RESIDENT, SHIFTED)]
                pid = rng.choice(dead if dead and rng.random() < 0.3 else live or [0])
                got = await both(f"{what} (piece {pid}, {mode})", lambda: c.evict(sid, pid, mode),
                                 lambda: ctx.evict_piece(pid, mode))
                if got is not None:
                    a, b = got
                    if (a.mode, a.start, a.length, a.tail, a.num_evicted, a.num_recomputed, a.num_rerotated, a.exact,
                            a.logits_fresh) != (b.mode, b.start, b.length, b.tail, b.num_evicted, b.num_recomputed,
                                                b.num_rerotated, b.exact, b.logits_fresh):
                        flag(f"{what}: the SDK's evict result {a} differs from the in-process report {b}")
            elif op == "fork":
                child = f"s{n}"
                n += 1
                await c.fork(sid, child)
                local[child] = ctx.fork(child)
                sid = child
            elif op == "generate":
                k = rng.choice([1, 3])
                got = await both(what, lambda: c.generate(sid, k), lambda: ctx.generate(k))
                if got is not None and tuple(got[0]) != tuple(got[1].tokens):
                    flag(f"{what}: the SDK decoded {got[0]}, the in-process context {got[1].tokens}")
            else:
                label, fn, kinds = rng.choice([
                    ("evict a piece that does not exist", lambda: c.evict(sid, len(ctx.pieces) + 2), (NotFound,)),
                    ("append an id outside the vocabulary", lambda: c.append(sid, [1, V]), (InvalidArgument,)),
                    ("append no ids", lambda: c.append(sid, []), (InvalidArgument,)),
                    ("evict with a bad mode", lambda: c.evict(sid, 0, "fast"), (InvalidArgument,)),
                    ("generate 0", lambda: c.generate(sid, 0), (InvalidArgument,)),
                ])
                before = (await c.get_session(sid)).digest
                try:
                    await fn()
                    flag(f"{what}: {label} accepted")
                except kinds:
                    pass
                except Exception as e:  # noqa: BLE001
                    flag(f"{what}: {label} raised {type(e).__name__}: {e}")
                if (await c.get_session(sid)).digest != before:
                    flag(f"{what}: {label} refused but the session changed")
            await compare(sid, what, logits)
            for other in local:
                if other != sid and (await c.get_session(other)).digest != local[other].digest():
                    flag(f"{what}: session {other} changed, or differs from its in-process twin (branch leak)")
    finally:
        await c.close()
        await ctl.stop(grace=1)
        await asyncio.sleep(0)
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    return findings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--backend", choices=["numpy", "torch"], default="numpy")
    ap.add_argument("--config", choices=[c[0] for c in CONFIGS], default=None,
                    help="the model (default: picked by the seed)")
    ap.add_argument("--fleet", action="store_true", help="also run a short sequence through a local Ray fleet")
    ap.add_argument("--fleet-ops", type=int, default=30)
    ap.add_argument("--sdk", action="store_true", help="also run a short sequence through the SDK and a controller")
    ap.add_argument("--context-ops", type=int, default=150,
                    help="ops of the in-process piece-ledger run (fleet.core.context) after the kernel's; 0: none")
    ap.add_argument("--faults", action="store_true",
                    help="make a primitive fail part way through some ops: each must leave every session as it was")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    fz = KernelFuzz(a.seed, a.backend, a.config, a.verbose)
    fz.faults = a.faults
    print(f"seed {a.seed}: model {fz.name} ({fz.cfg.n_layers} layers, vocab {fz.V}, context {fz.ctx}, "
          f"block {fz.BS}, tile {fz.kernel.tile_size}), backend {a.backend}, {a.ops} ops", flush=True)
    fz.run(a.ops)
    findings = list(fz.findings)
    print(f"kernel: {a.ops} ops ({', '.join(f'{k} {v}' for k, v in sorted(fz.counts.items()))}), "
          f"{len(fz.sessions)} sessions live at the end, longest {fz.longest} tokens, max|d| vs the float64 "
          f"reference {fz.max_ref_delta:.3g}, vs the other backend {fz.max_cross_delta:.3g}, "
          f"{fz.faults_fired} injected failures, "
          f"{len(fz.findings)} findings, {time.monotonic() - t0:.1f} s", flush=True)
    if a.context_ops:
        t1 = time.monotonic()
        fc = run_context(a.seed, a.context_ops, a.backend)
        print(f"context: {a.context_ops} ops, {len(fc)} findings, {time.monotonic() - t1:.1f} s", flush=True)
        findings += fc
    if a.fleet:
        t1 = time.monotonic()
        ff = run_fleet(a.seed, a.fleet_ops, a.backend)
        print(f"fleet: {a.fleet_ops} ops, {len(ff)} findings, {time.monotonic() - t1:.1f} s")
        findings += ff
    if a.sdk:
        import asyncio

        t2 = time.monotonic()
        fs = asyncio.run(run_sdk(a.seed, a.fleet_ops))
        print(f"sdk: {a.fleet_ops} ops, {len(fs)} findings, {time.monotonic() - t2:.1f} s")
        findings += fs
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
