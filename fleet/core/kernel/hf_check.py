"""HF parity witness: a small random Llama saved by transformers, loaded by `from_pretrained`.

transformers is imported lazily: without it the witness reports itself as not run.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np

from fleet.core.kernel.checks import ExactnessCheck, not_run
from fleet.core.kernel.kernel import Kernel
from fleet.core.kernel.types import max_abs_delta

INSTALL_HINT = "pip install 'kvfleet[hf]' (./dev.sh installs it), or pass --no-hf to skip this witness"

PROMPT = [(7 * i + 3) % 256 for i in range(37)]
# A small random Llama-family config with a clear top-1 margin (init std 0.2); the parity tests use it too.
SMALL_HF_CONFIG: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def hf_parity(
    backend: str = "numpy", device: str = "cpu", threads: int = 1, steps: int = 32
) -> list[ExactnessCheck]:
    """Logits max|Δ| over `steps` greedy steps (<= 1e-4) and identical greedy continuation."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return [not_run("HF parity LlamaForCausalLM", "<= 1e-4", f"not run: {e}; {INSTALL_HINT}")]
    tf: Any = transformers
    LlamaConfig, LlamaForCausalLM, hf_logging = tf.LlamaConfig, tf.LlamaForCausalLM, tf.utils.logging
    cfg = LlamaConfig(**SMALL_HF_CONFIG, attn_implementation="eager")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(cfg).float().save_pretrained(tmp, safe_serialization=True)
        m = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            out = m.generate(
                torch.tensor([PROMPT]),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        hf_tokens = out.sequences[0, len(PROMPT) :].tolist()
        k = Kernel.from_pretrained(tmp, backend=backend, device=device, threads=threads)
    s = k.session()
    ours = [s.append(PROMPT)] + [s.append([t]) for t in hf_tokens[:-1]]
    hf_logits = [x[0].numpy() for x in out.logits]
    d = max(max_abs_delta(a, b) for a, b in zip(ours, hf_logits, strict=True))
    same = all(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ours, hf_logits, strict=True))
    g = k.session()
    g.append(PROMPT)
    greedy_ok = g.generate(steps) == hf_tokens
    note = f"argmax equal={same}, greedy {steps} equal={greedy_ok}"
    return [
        ExactnessCheck(
            f"HF parity LlamaForCausalLM ({steps} greedy steps)",
            "<= 1e-4",
            d,
            None,
            d <= 1e-4 and same and greedy_ok,
            note,
        )
    ]
