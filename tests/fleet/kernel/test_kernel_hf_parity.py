"""Must show 5: parity with Hugging Face transformers on saved (safetensors) checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from fleet.core.errors import ResourceExhausted
from fleet.core.kernel import Kernel, max_abs_delta
from fleet.core.kernel.hf_check import SMALL_HF_CONFIG

SMALL = SMALL_HF_CONFIG
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 50000.0,
}
PROMPT = [(7 * i + 3) % 256 for i in range(37)]
STEPS = 32
MARGIN = 1e-3  # every greedy step's top-1 lead over top-2 (>> the 1e-4 logit bound)


def _save(
    tmp: Path,
    model_cls: Any,
    cfg: Any,
    seed: int,
    dtype: torch.dtype = torch.float32,
    keep: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Save a seeded model as `dtype` safetensors; `keep` receives its fp32 tensors before the cast."""
    torch.manual_seed(seed)
    m = model_cls(cfg).float().eval()
    with torch.no_grad():  # random biases (HF zero-inits them) so the bias path is really checked
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    if keep is not None:
        keep.update({n: v.detach().clone() for n, v in m.state_dict().items()})
    m.to(dtype).save_pretrained(tmp, safe_serialization=True)
    # The reference loads the same files (fp32, eager attention), as our kernel does.
    return model_cls.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_greedy(m: Any) -> tuple[list[int], list[np.ndarray]]:
    with torch.no_grad():
        out = m.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(PROMPT) :].tolist(), [s[0].numpy() for s in out.logits]


def _check(tmp: Path, m: Any, backend: str, label: str) -> None:
    hf_tokens, hf_logits = _hf_greedy(m)
    margins = [float(np.diff(np.sort(x)[-2:])[0]) for x in hf_logits]
    k = Kernel.from_pretrained(tmp, backend=backend)
    s = k.session()
    ours = [s.append(PROMPT)]
    for tok in hf_tokens[:-1]:
        ours.append(s.append([tok]))
    d = max(max_abs_delta(a, b) for a, b in zip(ours, hf_logits, strict=True))
    same_argmax = all(int(np.argmax(a)) == int(np.argmax(b)) for a, b in zip(ours, hf_logits, strict=True))
    g = k.session()
    g.append(PROMPT)
    greedy = g.generate(STEPS)
    print(
        f"[hf parity {label} {backend}] logits max|Δ|={d:.2e} over {STEPS} steps, argmax equal={same_argmax}, "
        f"greedy {STEPS} equal={greedy == hf_tokens}, min top-1 margin={min(margins):.3f}"
    )
    assert min(margins) > MARGIN, "weak top-1 margin: pick another seed"
    assert d <= 1e-4 and same_argmax and greedy == hf_tokens


def test_llama_with_llama3_rope_scaling(tmp_path: Path, backend: str) -> None:
    cfg = LlamaConfig(**SMALL, rope_scaling=LLAMA3_ROPE, attn_implementation="eager")
    _check(tmp_path, _save(tmp_path, LlamaForCausalLM, cfg, seed=0), backend, "llama+llama3-rope")


def test_qwen2_with_qkv_bias_and_tied_embeddings(tmp_path: Path, backend: str) -> None:
    cfg = Qwen2Config(**SMALL, tie_word_embeddings=True, attn_implementation="eager")
    m = _save(tmp_path, Qwen2ForCausalLM, cfg, seed=1)
    assert Kernel.from_pretrained(tmp_path).config.tie_embeddings
    _check(tmp_path, m, backend, "qwen2+bias+tied")


def test_mistral_without_sliding_window(tmp_path: Path) -> None:
    cfg = MistralConfig(**SMALL, sliding_window=None, attn_implementation="eager")
    _check(tmp_path, _save(tmp_path, MistralForCausalLM, cfg, seed=2), "numpy", "mistral")


_LAYER_FIELDS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def _loaded(k: Kernel) -> dict[str, np.ndarray]:
    """The kernel's weights under their checkpoint names."""
    w = k.weights
    out = {
        "model.embed_tokens.weight": w.embed,
        "model.norm.weight": w.final_norm,
        "lm_head.weight": w.lm_head,
    }
    for i, layer in enumerate(w.layers):
        out.update({f"model.layers.{i}.{hf}": getattr(layer, f) for f, hf in _LAYER_FIELDS.items()})
    return out


def test_bf16_checkpoint_is_widened_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cfg = LlamaConfig(**SMALL, attn_implementation="eager")
    pre: dict[str, torch.Tensor] = {}  # the fp32 weights before the bf16 rounding
    m = _save(tmp_path, LlamaForCausalLM, cfg, seed=3, dtype=torch.bfloat16, keep=pre)
    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        ckpt.update(load_file(f))
    ours = _loaded(Kernel.from_pretrained(tmp_path))
    assert set(ours) == set(ckpt) and all(ckpt[n].dtype == torch.bfloat16 for n in ours)
    assert all(v.dtype == np.float32 for v in ours.values())
    d = max(max_abs_delta(v, ckpt[n].float().numpy()) for n, v in ours.items())  # widened bf16
    c = max(max_abs_delta(v, pre[n].numpy()) for n, v in ours.items())  # control: pre-rounding fp32
    print(
        f"[hf bf16] {len(ours)} loaded fp32 tensors vs checkpoint bf16 .float(): max|Δ|={d:.1e}"
        f"   control (fp32 weights before the bf16 cast) max|Δ|={c:.3e}"
    )
    assert d == 0.0 and c > 0
    _check(tmp_path, m, "numpy", "llama-bf16")


def test_mistral_sliding_window_shorter_than_sequence_is_refused(tmp_path: Path) -> None:
    cfg = MistralConfig(**SMALL, sliding_window=16, attn_implementation="eager")
    _save(tmp_path, MistralForCausalLM, cfg, seed=4)
    s = Kernel.from_pretrained(tmp_path).session()
    s.append(PROMPT[:16])  # within the window: full attention == sliding attention
    before = s.digest()
    with pytest.raises(ResourceExhausted, match="sliding_window"):
        s.append([1])
    assert s.digest() == before
