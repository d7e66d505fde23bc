"""GPU check for the torch/CUDA backend: the witnesses and prefill throughput, a few minutes at most.

    python bench/gpu_check.py [--device cuda] [--tokens 2048] [--json PATH]

Prints the witness table (measured max|Δ| beside each control), numpy-vs-CUDA agreement, and
prefill tokens/s of the kernel (torch/CUDA) vs transformers on the same GPU, config and length.
Exits 1 when a witness row fails: a row claiming == 0 must be exactly 0 on CUDA too (with its
controls > 0), HF parity and numpy vs CUDA within their 1e-4 bounds. Needs a CUDA device; on a CPU-only machine it says so.
`--device cpu --tokens 256` runs the same script on the CPU as a dry run of its code paths.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from fleet.core.kernel import Kernel, ModelConfig, max_abs_delta
from fleet.core.kernel.exactness import environment, run_checks

CFG = ModelConfig(
    vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=1408, max_seq_len=8192
)


def _timed(fn, reps: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def prefill(device: str, tokens: int) -> dict[str, float]:
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, tokens).tolist()
    out: dict[str, float] = {}
    for tile in (64, 256):
        k = Kernel.synthetic(CFG, seed=0, backend="torch", device=device, tile_size=tile)
        k.session().append(ids[:128])  # warm-up
        out[f"kernel tile={tile}"] = tokens / _timed(lambda k=k: k.session().append(ids))
    hc = LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=CFG.dim,
        num_hidden_layers=CFG.n_layers,
        num_attention_heads=CFG.n_heads,
        num_key_value_heads=CFG.n_kv_heads,
        intermediate_size=CFG.hidden_dim,
        max_position_embeddings=CFG.max_seq_len,
    )
    x = torch.tensor([ids], device=device)
    for impl in ("eager", "sdpa"):
        m = LlamaForCausalLM._from_config(hc, attn_implementation=impl).to(device).eval()
        with torch.no_grad():
            m(x[:, :128])
            out[f"transformers {impl}"] = tokens / _timed(lambda m=m: m(x, use_cache=True, logits_to_keep=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run this on a CUDA machine", file=sys.stderr)
        return 2
    env = environment("torch", a.device)
    gpu = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu (dry run)"
    print(f"device: {gpu} | torch {torch.__version__} | {env['cpu']}")
    rows = run_checks(backend="torch", device=a.device)
    for r in rows:
        ctrl = "-" if r.control is None else f"{r.control:.3e}"
        ulp = "-" if r.ulp_control is None else f"{r.ulp_control:.3e}"
        print(
            f"  {r.status:<8} {r.name:<55} {r.claim:<9} max|Δ|={r.value:.3e} control={ctrl} "
            f"1-ulp={ulp} {r.note}"
        )
    ids = np.random.default_rng(50).integers(0, 512, 300).tolist()
    agree = max_abs_delta(
        Kernel.synthetic(ModelConfig.tiny(), backend="torch", device=a.device).session().append(ids),
        Kernel.synthetic(ModelConfig.tiny()).session().append(ids),
    )
    print(f"  numpy vs torch/{a.device} logits max|Δ|={agree:.3e} (bound 1e-4)")
    speed = prefill(a.device, a.tokens)
    for name, v in speed.items():
        print(f"  prefill {a.tokens} tokens: {name:<22} {v:,.0f} tok/s")
    # a row that claims == 0 is checked as 0 (no tolerance); the bounds as bounds
    exact = all(r.ok for r in rows if r.claim == "== 0")
    bounded = agree <= 1e-4 and all(r.ok for r in rows if r.claim != "== 0")
    print(
        f"  every exactness witness held at max|Δ| = 0 on this device: {exact}; 1e-4 bounds held: {bounded}"
    )
    ok = exact and bounded
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "env": env,
                    "ok": ok,
                    "witnesses": [r.as_dict() for r in rows],
                    "numpy_vs_cuda": agree,
                    "prefill_tok_s": speed,
                    "gpu": gpu,
                },
                f,
                indent=2,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
