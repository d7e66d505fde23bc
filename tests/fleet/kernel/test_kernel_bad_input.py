"""Must show 7: bad input raises a clear error and leaves the cache unchanged (digest-verified)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.kernels import make_kernel, rand_ids

from fleet.core.errors import InvalidArgument, ResourceExhausted
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
    (7, "1-D sequence of token ids, got int"),  # not iterable: a bare TypeError before
    (None, "1-D sequence of token ids, got NoneType"),
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
    (dict(start=1, length=2, mode=np.array(["exact"])), "mode"),  # accepted before: an array as the report's mode
    (dict(start=1, length=2, mode=np.array(["exact", "exact"])), "mode"),  # ValueError before
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
    with pytest.raises(InvalidArgument, match=msg):
        s.check_append(ids)
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


@pytest.mark.parametrize(("field", "forge", "msg"), [
    ("blocks", lambda p: tuple(a.tolist() for a in p.blocks), "must be numpy arrays"),  # AttributeError before
    ("blocks", lambda p: None, "must be sequences"),                                    # TypeError before
    ("tokens", lambda p: None, "must be sequences"),
])
def test_a_malformed_prefix_is_refused(backend: str, field: str, forge: object, msg: str) -> None:
    """Kernel.session documents InvalidArgument for a malformed prefix; a hand-built one raised a bare error."""
    import dataclasses

    prefix = _session(backend).export_prefix(16)
    bad = dataclasses.replace(prefix, **{field: forge(prefix)})  # type: ignore[operator]
    with pytest.raises(InvalidArgument, match=msg):
        make_kernel(backend).session(prefix=bad)
    assert len(make_kernel(backend).session(prefix=prefix)) == 16  # control: the prefix itself is adopted


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


@pytest.mark.parametrize("name", ["threads", "block_size", "tile_size"])
def test_kernel_geometry_takes_any_integer_type_and_refuses_bools(name: str) -> None:
    """np.int64(16) was refused ("block_size must be a positive integer, got 16") and True taken for 1."""
    cfg = ModelConfig.tiny()
    plain = Kernel.synthetic(cfg, **{name: 2})
    wide = Kernel.synthetic(cfg, **{name: np.int64(2)})
    assert getattr(wide, name) == 2 and type(getattr(wide, name)) is int
    assert wide.model_id == plain.model_id  # the same bits: the same id, so they share prefixes
    with pytest.raises(InvalidArgument, match=f"{name} must be .*not a bool.*got True"):
        Kernel.synthetic(cfg, **{name: True})
    with pytest.raises(InvalidArgument, match=name):
        Kernel.synthetic(cfg, **{name: 2.0})


NARROW_INTS = [  # found by review: narrow numpy ints wrapped around past the range check
    # 20 + 32760 wrapped: accepted, the session grew 40 -> 80
    ("evict", (np.int16(20), np.int16(32760)), "not a non-empty range"),
    ("evict", (np.int8(30), np.int8(100)), "not a non-empty range"),  # 130 wrapped to -126: truncated first
    ("evict", (np.uint64(0), np.int64(1)), None),  # a good span: evicts (TypeError in a slice before)
    ("evict", (np.bool_(True), 1), "integers"),
    ("kv_numpy", (np.int8(30), np.int8(30) + np.int8(0)), "kv_numpy needs"),
    ("kv_numpy", (np.int8(0), np.int16(40)), None),
    ("export_prefix", (np.int8(16),), None),
    ("export_prefix", (True,), "multiple of block_size"),
    ("generate", (np.int8(2),), None),
    ("generate", (True,), "generate needs"),
]


@pytest.mark.parametrize(("method", "args", "msg"), NARROW_INTS)
def test_numpy_integer_arguments_are_python_ints(backend: str, method: str, args: tuple, msg: str | None) -> None:
    s = _session(backend)
    before = s.digest()
    with np.errstate(over="raise"):  # no wrapped arithmetic on the caller's integer type
        if msg is None:
            getattr(s, method)(*args)
            return
        with pytest.raises(InvalidArgument, match=msg):
            getattr(s, method)(*args)
    assert s.digest() == before and len(s) == 40


@pytest.mark.parametrize("ids", [[1, True], (3, np.True_), [np.int64(4), False]])
def test_bool_token_ids_are_refused(backend: str, ids: object) -> None:
    """A bool among ints was accepted as the token 1 or 0 (np.asarray made them int64)."""
    s = _session(backend)
    before = s.digest()
    with pytest.raises(InvalidArgument, match="bool"):
        s.append(ids)
    with pytest.raises(InvalidArgument, match="bool"):
        s.check_append(ids)
    assert s.digest() == before and len(s) == 40


@pytest.mark.parametrize("bad", [1.5, True, np.float64(3.0), "7"])
def test_prefix_token_ids_must_be_integers(backend: str, bad: object) -> None:
    s = _session(backend)
    p = s.export_prefix(16)
    forged = PrefixKV((bad, *p.tokens[1:]), p.block_size, p.blocks, p.model_id)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="prefix token ids must be integers"):
        make_kernel(backend).session(prefix=forged)
    good = PrefixKV(tuple(np.int32(t) for t in p.tokens), p.block_size, p.blocks, p.model_id)  # type: ignore[misc]
    t = make_kernel(backend).session(prefix=good)  # control: integer ids of any width are adopted
    assert all(type(x) is int for x in t.tokens) and t.tokens == list(p.tokens)


def test_generate_past_the_context_changes_nothing(backend: str) -> None:
    """generate(n) appended tokens up to the limit and then raised; it now refuses first."""
    k = Kernel.synthetic(ModelConfig.tiny(max_seq_len=48), seed=0, backend=backend, tile_size=32)
    s = k.session()
    s.append(rand_ids(20, 40))
    before = s.digest()
    with pytest.raises(ResourceExhausted, match="context of 48"):
        s.generate(9)
    assert s.digest() == before and len(s) == 40
    assert len(s.generate(8)) == 8 and len(s) == 48  # control: up to the limit is fine
