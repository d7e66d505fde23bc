"""Must show 7: bad input raises a clear error and leaves the cache unchanged (digest-verified)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.kernels import make_kernel, rand_ids

from fleet.core.errors import InvalidArgument
from fleet.core.kernel import Kernel, ModelConfig, PrefixKV

BAD_IDS = [
    ([1, 512], "outside the vocabulary"),
    ([-1], "outside the vocabulary"),
    ([1.0, 2.0], "must be integers"),
    (np.array([1, 2], np.float32), "must be integers"),
    ([True, False], "must be integers"),
    ([], "non-empty"),
    ([[1, 2]], "1-D"),
    ("hello", "not text"),
    ([1, "2"], "must be integers"),
]
BAD_SPANS = [
    (dict(start=-1, length=2), "not a non-empty range"),
    (dict(start=3, length=0), "not a non-empty range"),
    (dict(start=3, length=-2), "not a non-empty range"),
    (dict(start=40, length=1), "not a non-empty range"),
    (dict(start=35, length=6), "not a non-empty range"),
    (dict(start=1.0, length=2), "integers"),
    (dict(start=1, length=True), "integers"),
    (dict(start=1, length=2, mode="fast"), "mode"),
]


def _session(backend: str):  # type: ignore[no-untyped-def]
    s = make_kernel(backend).session()
    s.append(rand_ids(20, 40))
    return s


@pytest.mark.parametrize(("ids", "msg"), BAD_IDS)
def test_bad_token_ids_leave_cache_unchanged(backend: str, ids: object, msg: str) -> None:
    s = _session(backend)
    before, logits = s.digest(), s.last_logits
    with pytest.raises(InvalidArgument, match=msg):
        s.append(ids)
    assert s.digest() == before and len(s) == 40 and np.array_equal(s.last_logits, logits)
    assert s.append([5]).shape == (512,)  # control: a good append still changes the cache
    assert s.digest() != before


@pytest.mark.parametrize(("kw", "msg"), BAD_SPANS)
def test_bad_evictions_leave_cache_unchanged(backend: str, kw: dict, msg: str) -> None:
    s = _session(backend)
    before = s.digest()
    with pytest.raises(InvalidArgument, match=msg):
        s.evict(**kw)
    assert s.digest() == before and len(s) == 40


def test_bad_export_and_foreign_prefix(backend: str) -> None:
    s = _session(backend)
    before = s.digest()
    for n in (0, 15, 48, 16.0):
        with pytest.raises(InvalidArgument, match="multiple of block_size"):
            s.export_prefix(n)  # type: ignore[arg-type]
    assert s.digest() == before
    prefix = s.export_prefix(32)
    other = make_kernel(backend, seed=1)
    with pytest.raises(InvalidArgument, match="not portable"):
        other.session(prefix=prefix)
    forged = PrefixKV(prefix.tokens[:16], prefix.block_size, prefix.blocks, prefix.model_id)
    with pytest.raises(InvalidArgument, match="whole blocks"):
        make_kernel(backend).session(prefix=forged)
    with pytest.raises(InvalidArgument, match="generate"):
        s.generate(-1)


def test_unsupported_checkpoints_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="no config.json"):
        Kernel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(InvalidArgument, match="LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        Kernel.from_pretrained(tmp_path)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 8,
    }
    (tmp_path / "config.json").write_text(json.dumps({**hf, "hidden_act": "gelu"}))
    with pytest.raises(InvalidArgument, match="silu"):
        Kernel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    )
    with pytest.raises(InvalidArgument, match="yarn"):
        Kernel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(InvalidArgument, match="safetensors"):
        Kernel.from_pretrained(tmp_path)


def test_bad_configs_and_backends() -> None:
    with pytest.raises(InvalidArgument, match="multiple of n_kv_heads"):
        ModelConfig.tiny(n_kv_heads=3)
    with pytest.raises(InvalidArgument, match="backend"):
        Kernel.synthetic(ModelConfig.tiny(), backend="jax")
    with pytest.raises(InvalidArgument, match="cpu only"):
        Kernel.synthetic(ModelConfig.tiny(), device="cuda")
    with pytest.raises(InvalidArgument, match="tile_size"):
        Kernel.synthetic(ModelConfig.tiny(), tile_size=0)
