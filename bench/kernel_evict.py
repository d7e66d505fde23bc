"""Middle-span eviction cost: a 64-token span out of a 4,096-token cache.

    ./dev.sh bench kernel_evict [--tokens 4096] [--span 64] [--reps 3] [--no-write]

Three ways to drop the span and continue: `reposition` (re-rotate survivors' keys once from Kraw;
exact only for 1-layer models, reported), `exact` (re-derive the survivors after the span: a
prefill of the tail inside the kernel), and a full re-prefill of everything that remains in a
fresh session (what an engine without span eviction or a prefix cache does). Each run starts from
a CoW fork of the same prefilled session, so the copy-on-write of touched blocks is included.
"""

from __future__ import annotations

import argparse

import numpy as np
from kernel_report import best_of, write_part

from fleet.kernel import Kernel, ModelConfig
from fleet.kernel.kernel import cpu_name

CFG = ModelConfig(
    vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=1408, max_seq_len=8192
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--span", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    k = Kernel.synthetic(CFG, seed=0, backend=a.backend)
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, a.tokens).tolist()
    start = (a.tokens - a.span) // 2
    base = k.session()
    base.append(ids)
    survivors = ids[:start] + ids[start + a.span :]
    t_rep = best_of(lambda: base.fork().evict(start, a.span, mode="reposition"), a.reps)
    print(f"reposition: {t_rep * 1e3:.1f} ms", flush=True)
    t_exact = best_of(lambda: base.fork().evict(start, a.span, mode="exact"), a.reps)
    print(f"exact: {t_exact * 1e3:.1f} ms", flush=True)
    t_full = best_of(lambda: k.session().append(survivors), 1)
    print(f"full re-prefill: {t_full * 1e3:.1f} ms", flush=True)
    tail = a.tokens - start - a.span
    body = f"""### Middle eviction: reposition vs exact vs re-prefill (`./dev.sh bench kernel_evict`)

A {a.span}-token span at positions [{start}, {start + a.span}) evicted from a {a.tokens}-token cache
({a.backend} backend, same Llama config as the prefill bench, {k.threads} thread, tile {k.tile_size},
block {k.block_size}; best of {a.reps}, the full re-prefill once). CPU: {cpu_name()}.

| way to drop the span | what it recomputes | time | vs reposition |
|---|---|---|---|
| `reposition` | re-rotates {tail} survivor keys from Kraw (exact only for 1 layer; flagged) | {t_rep * 1e3:.1f} ms | 1.0x |
| `exact` | re-derives the {tail} survivors (tail prefill; exact at any depth) | {t_exact * 1e3:.1f} ms | {t_exact / t_rep:.1f}x |
| full re-prefill | prefills all {a.tokens - a.span} remaining tokens in a fresh session | {t_full * 1e3:.1f} ms | {t_full / t_rep:.1f}x |

Target: reposition at least 20x faster than re-prefilling the tail: measured
**{t_exact / t_rep:.1f}x** against the tail re-prefill (`exact`) and {t_full / t_rep:.1f}x against a full re-prefill.
Reposition still carries the span's influence in the survivors' layer >= 1 state (see docs/kernel.md).
"""
    if not a.no_write:
        write_part("kernel_evict", body)


if __name__ == "__main__":
    main()
