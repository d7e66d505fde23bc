"""Prefill throughput of the kernel vs transformers, same config, same cache length, same threads.

    ./dev.sh bench kernel_prefill [--tokens 2048] [--threads 1] [--reps 3] [--no-write]

Also reports decode tokens/s per tile size: every decode step runs a whole fixed-shape tile, the
price of batch invariance on CPU BLAS (see docs/kernel.md).
"""

from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from kernel_report import best_of, write_part

from fleet.kernel import Kernel, ModelConfig
from fleet.kernel.kernel import DEFAULT_TILE, cpu_name

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiles", default="32,64,128")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, a.tokens).tolist()
    torch.set_num_threads(a.threads)
    hf = {}
    for impl in ("eager", "sdpa"):
        m = hf_model(impl)
        with torch.no_grad():
            x = torch.tensor([ids])
            hf[impl] = a.tokens / best_of(lambda m=m, x=x: m(x, use_cache=True, logits_to_keep=1), a.reps)
        print(f"transformers {impl}: {hf[impl]:.0f} tok/s", flush=True)
    rows = []
    for backend in ("numpy", "torch"):
        for tile in (int(t) for t in a.tiles.split(",")):
            k = Kernel.synthetic(CFG, seed=0, backend=backend, threads=a.threads, tile_size=tile)
            pre = a.tokens / best_of(lambda k=k: k.session().append(ids), a.reps)
            s = k.session()
            s.append(ids[:512])
            dec = 16 / best_of(lambda s=s: s.fork().generate(16), 1)
            rows.append((backend, tile, pre, dec))
            print(
                f"kernel {backend} tile={tile}: prefill {pre:.0f} tok/s ({pre / hf['eager']:.2f}x eager, "
                f"{pre / hf['sdpa']:.2f}x sdpa), decode {dec:.0f} tok/s",
                flush=True,
            )
    table = [
        "| engine | tile | prefill tok/s | vs HF eager | vs HF sdpa | decode tok/s (after 512) |",
        "|---|---|---|---|---|---|",
    ]
    table += [
        f"| transformers {i} | - | {v:.0f} | {v / hf['eager']:.2f}x | {v / hf['sdpa']:.2f}x | - |"
        for i, v in hf.items()
    ]
    table += [
        f"| kvfleet {b} | {t} | {p:.0f} | {p / hf['eager']:.2f}x | {p / hf['sdpa']:.2f}x | {d:.0f} |"
        for b, t, p, d in rows
    ]
    default = [(b, p) for b, t, p, _ in rows if t == DEFAULT_TILE]
    verdict = "; ".join(f"{b} {p / hf['eager']:.2f}x eager / {p / hf['sdpa']:.2f}x sdpa" for b, p in default)
    body = f"""### Prefill throughput vs transformers (`./dev.sh bench kernel_prefill`)

Llama config dim={CFG.dim}, {CFG.n_layers} layers, {CFG.n_heads} heads / {CFG.n_kv_heads} KV heads,
hidden {CFG.hidden_dim}, vocab {CFG.vocab_size}, fp32; one prefill of {a.tokens} tokens into an empty
cache (transformers: one forward with use_cache, logits for the last token only). {a.threads} thread(s)
for every engine; best of {a.reps}. CPU: {cpu_name()} ({platform.machine()}), torch {torch.__version__}.

{chr(10).join(table)}

Target >= 1.0x transformers on CPU, at the default tile ({DEFAULT_TILE}): {verdict}.
Met against the eager attention path; not met against `sdpa` whenever that ratio is below 1.

Reading it: the kernel pays for exactness with fixed-shape row tiles (every GEMM is [tile, dim]),
so BLAS runs below its large-matrix efficiency and a decode step costs a whole tile. transformers'
`sdpa` path runs one [{a.tokens}, dim] GEMM per weight and a fused attention kernel; its `eager`
path (the one HF parity is checked against) materialises the full score matrix.
"""
    if not a.no_write:
        write_part("kernel_prefill", body)


if __name__ == "__main__":
    main()
