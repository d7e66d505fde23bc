"""Prefill throughput of the kernel vs transformers, same config, same cache length, same threads.

    ./dev.sh bench kernel_prefill [--tokens 2048] [--threads 1] [--reps 5] [--tiles 32,64,128] [--no-write]

Beside each kernel at the default tile, two variants of the same kernel in the same run: the
layer-0 projection as a tile GEMM (the pre-fix path, not slot-invariant: what the fix costs or
saves) and a cold layer-0 memo (the first prefill after a kernel starts).

Also reports decode tokens/s per tile size (16 greedy steps after a 512-token prompt, same timer
and best-of-reps as prefill): every decode step runs a whole fixed-shape tile, the price of batch
invariance on CPU BLAS (see docs/kernel.md).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np
import torch
from kernel_report import write_part

from fleet.core.kernel import Kernel, ModelConfig, max_abs_delta
from fleet.core.kernel.kernel import DEFAULT_TILE, cpu_name

CFG = ModelConfig(
    vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=1408, max_seq_len=8192
)


def hf_model(impl: str):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=CFG.dim,
        num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads,
        num_key_value_heads=CFG.n_kv_heads,
        intermediate_size=CFG.hidden_dim,
        max_position_embeddings=CFG.max_seq_len,
    )
    return LlamaForCausalLM._from_config(hc, attn_implementation=impl).eval()


def clock(threads: int):  # type: ignore[no-untyped-def]
    """CPU time of this process for 1 thread (immune to other jobs on a shared machine), else wall."""
    return time.process_time if threads == 1 else time.perf_counter


def interleaved(
    fns: dict[str, Callable[[], object]], reps: int, now: Callable[[], float]
) -> dict[str, float]:
    """Best seconds per engine; every round runs every engine once, so load hits all alike."""
    best = {n: float("inf") for n in fns}
    for f in fns.values():
        f()  # warm-up
    for _ in range(reps):
        for n, f in fns.items():
            t = now()
            f()
            best[n] = min(best[n], now() - t)
    return best


def verdict(backend: str, pre: float, eager: float, sdpa: float) -> str:
    """The >= 1.0x target, met or not, against each transformers path, from the measured ratios."""
    parts = [
        f"{'met' if pre / ref >= 1.0 else 'not met'} against {name} ({pre / ref:.2f}x)"
        for name, ref in (("eager", eager), ("sdpa", sdpa))
    ]
    return f"{backend}: " + ", ".join(parts)


def exactness(ids: list[int], threads: int) -> list[str]:
    """Batch invariance at the bench config: split prefills vs one prefill, with controls."""
    lines = []
    for backend in ("numpy", "torch"):
        k = Kernel.synthetic(CFG, seed=0, backend=backend, threads=threads, tile_size=DEFAULT_TILE)
        whole = k.session()
        ref = whole.append(ids)
        worst, same = 0.0, True
        for cut in (1, len(ids) // 3, len(ids) - 1):
            s = k.session()
            s.append(ids[:cut])
            worst = max(worst, max_abs_delta(s.append(ids[cut:]), ref))
            same &= s.digest() == whole.digest()
        poke = [(ids[0] + 1) % CFG.vocab_size, *ids[1:]]
        c_tok = max_abs_delta(k.session().append(poke), ref)
        other = Kernel.synthetic(CFG, seed=0, backend=backend, threads=threads, tile_size=DEFAULT_TILE // 2)
        c_tile = max_abs_delta(other.session().append(ids), ref)
        lines.append(
            f"{backend}: split at 1, n/3, n-1 vs one prefill max|Δ| = {worst:.1e}, digests equal = {same}; "
            f"controls: one token changed {c_tok:.1e}, tile {DEFAULT_TILE // 2} vs {DEFAULT_TILE} {c_tile:.1e}"
        )
        print(lines[-1], flush=True)
    return lines


def cold(k: Kernel) -> Kernel:
    """The same kernel with its layer-0 memo emptied (a first prefill after start)."""
    k.ops._slots.clear()  # type: ignore[attr-defined]
    return k


def tile_l0(backend: str, threads: int) -> Kernel:
    """A kernel whose layer-0 projection runs as a [tile, dim] GEMM (the pre-fix path: fast, but a
    row's bits may depend on its slot, so a 1-layer reposition was not exact on AVX2 OpenBLAS)."""
    k = Kernel.synthetic(CFG, seed=0, backend=backend, threads=threads, tile_size=DEFAULT_TILE)
    qkv = k.ops.qkv
    k.ops.qkv = lambda x, l, pos0, ids=None, slot0=0: qkv(x, l, pos0)  # type: ignore[method-assign]
    return k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiles", default="32,64,128")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, a.tokens).tolist()
    torch.set_num_threads(a.threads)
    now = clock(a.threads)
    witness = exactness(ids, a.threads)
    fns: dict[str, Callable[[], object]] = {}
    for impl in ("eager", "sdpa"):
        m, x = hf_model(impl), torch.tensor([ids])
        fns[f"transformers {impl}"] = lambda m=m, x=x: m(x, use_cache=True, logits_to_keep=1)
    kernels = {}
    for backend in ("numpy", "torch"):
        for tile in (int(t) for t in a.tiles.split(",")):
            k = Kernel.synthetic(CFG, seed=0, backend=backend, threads=a.threads, tile_size=tile)
            kernels[(backend, tile)] = k
            fns[f"kvfleet {backend} {tile}"] = lambda k=k: k.session().append(ids)
        k = kernels[(backend, DEFAULT_TILE)]
        fns[f"kvfleet {backend} {DEFAULT_TILE} cold"] = lambda k=k: cold(k).session().append(ids)
        tk = tile_l0(backend, a.threads)
        fns[f"kvfleet {backend} {DEFAULT_TILE} tile-l0"] = lambda k=tk: k.session().append(ids)
    with torch.no_grad():
        tps = {n: a.tokens / t for n, t in interleaved(fns, a.reps, now).items()}
    eager, sdpa = tps["transformers eager"], tps["transformers sdpa"]
    decs: dict[str, Callable[[], object]] = {}
    for (backend, tile), k in kernels.items():
        s = k.session()
        s.append(ids[:512])
        decs[f"{backend} {tile}"] = lambda s=s: s.fork().generate(16)
    dec_s = interleaved(decs, a.reps, now)  # same timer, warm-up and best-of as prefill
    rows = []
    for backend, tile in kernels:
        dec = 16 / dec_s[f"{backend} {tile}"]
        pre = tps[f"kvfleet {backend} {tile}"]
        rows.append((backend, tile, pre, dec))
        print(
            f"kernel {backend} tile={tile}: prefill {pre:.0f} tok/s ({pre / eager:.2f}x eager, "
            f"{pre / sdpa:.2f}x sdpa), decode {dec:.0f} tok/s",
            flush=True,
        )
    table = [
        "| engine | tile | prefill tok/s | vs HF eager | vs HF sdpa | decode tok/s (16 steps after 512) |",
        "|---|---|---|---|---|---|",
    ]
    table += [
        f"| transformers {i} | - | {v:.0f} | {v / eager:.2f}x | {v / sdpa:.2f}x | - |"
        for i, v in (("eager", eager), ("sdpa", sdpa))
    ]
    table += [
        f"| kvfleet {b} | {t} | {p:.0f} | {p / eager:.2f}x | {p / sdpa:.2f}x | {d:.0f} |"
        for b, t, p, d in rows
    ]
    for b in ("numpy", "torch"):
        for var, what in (("cold", "cold layer-0 memo"), ("tile-l0", "layer 0 as a tile GEMM (pre-fix)")):
            v = tps[f"kvfleet {b} {DEFAULT_TILE} {var}"]
            table.append(
                f"| kvfleet {b}, {what} | {DEFAULT_TILE} | {v:.0f} | {v / eager:.2f}x | {v / sdpa:.2f}x | - |"
            )
    fix = "; ".join(
        f"{b}: {tps[f'kvfleet {b} {DEFAULT_TILE}'] / tps[f'kvfleet {b} {DEFAULT_TILE} tile-l0']:.2f}x warm, "
        f"{tps[f'kvfleet {b} {DEFAULT_TILE} cold'] / tps[f'kvfleet {b} {DEFAULT_TILE} tile-l0']:.2f}x cold"
        for b in ("numpy", "torch")
    )
    print(f"slot-invariant layer 0 vs the tile-GEMM layer 0: {fix}", flush=True)
    default = [(b, p) for b, t, p, _ in rows if t == DEFAULT_TILE]
    met = "; ".join(verdict(b, p, eager, sdpa) for b, p in default)
    print(f"target >= 1.0x at tile {DEFAULT_TILE}: {met}", flush=True)
    timer = "CPU time of the process" if a.threads == 1 else "wall-clock time"
    body = f"""### Prefill throughput vs transformers (`./dev.sh bench kernel_prefill`)

Llama config dim={CFG.dim}, {CFG.n_layers} layers, {CFG.n_heads} heads / {CFG.n_kv_heads} KV heads,
hidden {CFG.hidden_dim}, vocab {CFG.vocab_size}, fp32; one prefill of {a.tokens} tokens into an empty
cache (transformers: one forward with use_cache, logits for the last token only). {a.threads} thread(s)
for every engine; {timer}, best of {a.reps} rounds, every round running every engine once
(interleaved, so load on the shared machine hits all alike). Decode: 16 greedy steps on a fork of a
512-token session, timed the same way (same timer, warm-up, best of {a.reps} interleaved rounds). CPU: {cpu_name()} ({platform.machine()}),
torch {torch.__version__}.

{chr(10).join(table)}

Target >= 1.0x transformers prefill on CPU, at the default tile ({DEFAULT_TILE}): {met}.

What the slot-invariant layer 0 costs (layer-0 q/k/v computed per token id in a fixed [1, dim]
shape and memoised, instead of one [tile, dim] GEMM; docs/kernel.md), as prefill throughput
relative to the tile-GEMM layer 0 in the same run: {fix}.

Exactness at this config, measured in the same run (tile {DEFAULT_TILE}):

{chr(10).join("- " + w for w in witness)}

Reading it: the kernel pays for exactness with fixed-shape row tiles (every GEMM is [tile, dim]),
so BLAS runs below its large-matrix efficiency and a decode step costs a whole tile. transformers'
`sdpa` path runs one [{a.tokens}, dim] GEMM per weight and a fused attention kernel; its `eager`
path (the one HF parity is checked against) materialises the full score matrix. The kernel runs a
prefill layer by layer over groups of tiles (each op still on its own tile's fixed shape, so the
bits are those of one tile at a time) and reads keys from a per-call contiguous K/V window.
"""
    if not a.no_write:
        write_part("kernel_prefill", body)


if __name__ == "__main__":
    main()
