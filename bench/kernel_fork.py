"""Fork memory and time: copy-on-write branches vs eager copies of the whole cache.

    ./dev.sh bench kernel_fork [--prefix 4096] [--suffix 256] [--forks 8] [--no-write]

Bytes come from the sessions' own accounting (`Session.memory()`: shared blocks counted once);
the eager baseline copies every block of the parent per branch, as an engine without CoW would.
"""

from __future__ import annotations

import argparse

import numpy as np
from kernel_report import best_of, write_part

from fleet.core.kernel import Kernel, ModelConfig
from fleet.core.kernel.kernel import cpu_name

CFG = ModelConfig(
    vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=1408, max_seq_len=8192
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    k = Kernel.synthetic(CFG, seed=0)
    rng = np.random.default_rng(0)
    root = k.session()
    root.append(rng.integers(0, CFG.vocab_size, a.prefix).tolist())
    t_fork = best_of(lambda: root.fork().close(), 5)
    blocks = [b.kv for b in root._kv.blocks]
    t_copy = best_of(lambda: [x.copy() for x in blocks], 3)  # what an eager branch costs
    forks = [root.fork() for _ in range(a.forks)]
    for f in forks:
        f.append(rng.integers(0, CFG.vocab_size, a.suffix).tolist())
    reps = [f.memory() for f in forks]
    cow = reps[0].bytes_shared + sum(r.bytes_alone for r in reps)
    eager = sum(r.bytes_total for r in reps)
    mib, bs = 1 << 20, k.block_size
    # independent of the accounting: block counts from the token counts alone
    expect = (a.prefix // bs + a.forks * (-(-(a.prefix + a.suffix) // bs) - a.prefix // bs)) * k.block_bytes
    partial = (
        "the partially filled last prefix block is copied on first write"
        if a.prefix % bs
        else ("the prefix is block-aligned, so nothing of it is copied")
    )
    body = f"""### Fork memory: copy-on-write vs eager copies (`./dev.sh bench kernel_fork`)

{a.forks} forks of a {a.prefix}-token session, each then appending {a.suffix} tokens (same Llama
config, {k.block_bytes // 1024} KiB per {k.block_size}-token block, K+Kraw+V for {CFG.n_layers} layers). CPU: {cpu_name()}.

| | bytes held | |
|---|---|---|
| copy-on-write (shared prefix once + per-fork suffix blocks) | {cow / mib:.1f} MiB | 1.0x |
| eager copies ({a.forks} x (prefix + suffix)) | {eager / mib:.1f} MiB | {eager / cow:.2f}x |
| prefix + {a.forks} suffixes, from token counts | {expect / mib:.1f} MiB | {eager / expect:.2f}x |

Each fork holds {reps[0].num_shared_blocks} shared blocks and {reps[0].bytes_alone // k.block_bytes} of its own
({partial}). Creating a branch: fork {t_fork * 1e3:.2f} ms
vs an eager copy of the cache {t_copy * 1e3:.1f} ms ({t_copy / t_fork:.0f}x).
"""
    print(body)
    assert cow == expect, (cow, expect)
    if not a.no_write:
        write_part("kernel_fork", body)


if __name__ == "__main__":
    main()
