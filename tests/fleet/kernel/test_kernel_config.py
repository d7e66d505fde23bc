"""ModelConfig parsing from config.json dicts, RoPE scaling, and the byte tokenizer."""

from __future__ import annotations

import numpy as np
import pytest

from fleet.core.errors import InvalidArgument
from fleet.core.kernel import ByteTokenizer, ModelConfig
from fleet.core.kernel.rope import inv_freq

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 176,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}


def test_from_hf_reads_v4_and_v5_rope_fields() -> None:
    v5 = ModelConfig.from_hf(
        {
            **LLAMA,
            "rope_parameters": {
                "rope_theta": 5e5,
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    v4 = ModelConfig.from_hf(
        {
            **LLAMA,
            "rope_theta": 5e5,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        }
    )
    assert v4 == v5 and v5.rope_theta == 5e5 and v5.rope_scaling_dict()["rope_type"] == "llama3"
    assert (v5.head_dim, v5.n_groups, v5.max_context, v5.sliding_window) == (16, 2, 2048, None)
    plain = ModelConfig.from_hf({**LLAMA, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    # Llama-3 scaling leaves high frequencies alone and divides the lowest by `factor`.
    f3, f0 = inv_freq(v5), inv_freq(plain)
    assert f3[0] == f0[0] and np.isclose(f3[-1], f0[-1] / 8.0)


def test_qwen2_and_mistral_specifics() -> None:
    q = ModelConfig.from_hf(
        {**LLAMA, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False, "sliding_window": 32}
    )
    assert q.qkv_bias and not q.o_bias and q.sliding_window is None
    m = ModelConfig.from_hf({**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": 512})
    assert m.max_context == 512


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer(512)
    ids = tok.encode("héllo, agent")
    assert max(ids) < 256 and tok.decode(ids) == "héllo, agent".encode()
    assert tok.decode([*ids, 300]) == "héllo, agent".encode()  # ids past the byte range are dropped
    with pytest.raises(InvalidArgument):
        ByteTokenizer(100)


@pytest.mark.parametrize(("field", "bad"), [("n_layers", True), ("vocab_size", 512.0), ("dim", "64"),
                                            ("sliding_window", 0), ("head_dim", 15.9)])
def test_config_sizes_are_positive_integers(field: str, bad: object) -> None:
    """True, 512.0 and "64" passed int(x) > 0 and failed later with a TypeError inside the weights; a sliding
    window of 0 made a model that refused every append."""
    with pytest.raises(InvalidArgument, match=f"ModelConfig.{field} must be a positive integer"):
        ModelConfig.tiny(**{field: bad})


def test_config_head_dim_of_zero_is_refused_and_numpy_sizes_are_python_ints() -> None:
    with pytest.raises(InvalidArgument, match=r"head_dim must be a positive integer \(dim // n_heads when 0\), got 0"):
        ModelConfig.tiny(dim=2)  # 2 // 4 heads: a ZeroDivisionError in the kernel before
    wide = ModelConfig.tiny(dim=np.int64(64), max_seq_len=np.uint32(8192))
    assert wide == ModelConfig.tiny() and repr(wide) == repr(ModelConfig.tiny())  # repr goes into model_id
    assert type(wide.dim) is int and type(wide.head_dim) is int
