"""Model configuration for the Llama-family decoder (Llama, Qwen2, Mistral)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fleet.core.errors import InvalidArgument
from fleet.core.kernel.inputs import as_int

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")

RopeScaling = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (fp32).

    `rope_scaling` accepts a dict (as in config.json) and is stored as a sorted tuple of items so the
    config stays hashable. `head_dim=0` means `dim // n_heads`.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    max_seq_len: int = 8192
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    rope_scaling: RopeScaling | dict[str, Any] | None = None
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    arch: str = "llama"

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        # NOTE: each size is a Python int at the door: int(x) > 0 let True, 512.0 and "64" through (a TypeError deep in
        # the weights), and np.int64(64) got a model_id of its own (its repr), so equal models shared no prefix
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "max_seq_len"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        if self.sliding_window is not None:
            object.__setattr__(self, "sliding_window", _positive("sliding_window", self.sliding_window))
        if as_int(self.head_dim) == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        object.__setattr__(self, "head_dim", _positive("head_dim", self.head_dim, "(dim // n_heads when 0)"))
        if self.n_heads % self.n_kv_heads:
            raise InvalidArgument(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim must be even for RoPE, got {self.head_dim}")
        rope_type = self.rope_scaling_dict().get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise InvalidArgument(
                f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )

    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    @property
    def n_groups(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def max_context(self) -> int:
        """Longest sequence the kernel computes exactly (sliding window caps it, see from_hf)."""
        if self.sliding_window is None:
            return self.max_seq_len
        return min(self.max_seq_len, self.sliding_window)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of `block_size` tokens (fp32; keys, values and the pre-RoPE keys; every layer)."""
        return 3 * self.n_layers * self.n_kv_heads * block_size * self.head_dim * 4

    def replace(self, **overrides: Any) -> ModelConfig:
        return dataclasses.replace(self, **overrides)

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """The small default used by tests and the demo (2 layers, GQA 4:2, vocab 512)."""
        base: dict[str, Any] = dict(
            vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=176
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from a Hugging Face config.json dict (Llama, Qwen2, Mistral).

        Raises:
            InvalidArgument: unsupported architecture, activation or rope type.
        """
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise InvalidArgument(
                f"unsupported checkpoint architecture {archs or hf.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"unsupported hidden_act {hf.get('hidden_act')!r}; only 'silu' (SwiGLU)")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        n_heads = int(hf["num_attention_heads"])
        is_qwen = arch == "Qwen2ForCausalLM"
        return cls(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            hidden_dim=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 8192)),
            rope_theta=theta,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
            qkv_bias=True if is_qwen else bool(hf.get("attention_bias", False)),
            o_bias=False if is_qwen else bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=_sliding_window(hf, arch),
            arch=arch,
        )


def _positive(name: str, value: Any, note: str = "") -> int:
    """`value` as a positive Python int (any integer type, not a bool), or InvalidArgument naming the field."""
    n = as_int(value)
    if n is None or n <= 0:
        raise InvalidArgument(f"ModelConfig.{name} must be a positive integer{' ' + note if note else ''}, got {value!r}")
    return n


def _sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    """The window that limits exact computation, or None when attention is full."""
    if arch == "LlamaForCausalLM":
        return None
    if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None
