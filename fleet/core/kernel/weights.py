"""Weights: seeded synthetic, or a local Hugging Face checkpoint (config.json + *.safetensors).

Weights are always produced in numpy float32 (Hugging Face layout: linear weights [out, in]); the
torch backend converts the same arrays, so both backends share bit-identical weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fleet.core.errors import InvalidArgument
from fleet.core.kernel.config import ModelConfig

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: np.ndarray  # [dim]
    wq: np.ndarray  # [H*hd, dim]
    wk: np.ndarray  # [KV*hd, dim]
    wv: np.ndarray  # [KV*hd, dim]
    wo: np.ndarray  # [dim, H*hd]
    bq: np.ndarray | None  # [H*hd]
    bk: np.ndarray | None  # [KV*hd]
    bv: np.ndarray | None  # [KV*hd]
    bo: np.ndarray | None  # [dim]
    mlp_norm: np.ndarray  # [dim]
    w_gate: np.ndarray  # [hidden, dim]
    w_up: np.ndarray  # [hidden, dim]
    w_down: np.ndarray  # [dim, hidden]
    b_gate: np.ndarray | None = None
    b_up: np.ndarray | None = None
    b_down: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class Weights:
    embed: np.ndarray  # [vocab, dim]
    layers: tuple[LayerWeights, ...]
    final_norm: np.ndarray  # [dim]
    lm_head: np.ndarray  # [vocab, dim] (the embedding itself when tied)
    source: str  # what produced them: the seed, or a content hash of the checkpoint's tensors (names,
    # dtypes, shapes and stored bytes); Kernel.model_id folds it in, so it must identify the values


def synthetic(cfg: ModelConfig, seed: int) -> Weights:
    """Deterministic random weights from np.random.default_rng(seed) (same in every process)."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.dim, cfg.head_dim

    def mat(out: int, inp: int) -> np.ndarray:
        w: np.ndarray = (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)
        return w

    def vec(n: int, on: bool, scale: float = 0.1, center: float = 0.0) -> np.ndarray | None:
        return (center + scale * rng.standard_normal(n)).astype(np.float32) if on else None

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    layers = []
    for _ in range(cfg.n_layers):
        layers.append(
            LayerWeights(
                attn_norm=norm(d),
                wq=mat(cfg.n_heads * hd, d),
                wk=mat(cfg.n_kv_heads * hd, d),
                wv=mat(cfg.n_kv_heads * hd, d),
                wo=mat(d, cfg.n_heads * hd),
                bq=vec(cfg.n_heads * hd, cfg.qkv_bias),
                bk=vec(cfg.n_kv_heads * hd, cfg.qkv_bias),
                bv=vec(cfg.n_kv_heads * hd, cfg.qkv_bias),
                bo=vec(d, cfg.o_bias),
                mlp_norm=norm(d),
                w_gate=mat(cfg.hidden_dim, d),
                w_up=mat(cfg.hidden_dim, d),
                w_down=mat(d, cfg.hidden_dim),
                b_gate=vec(cfg.hidden_dim, cfg.mlp_bias),
                b_up=vec(cfg.hidden_dim, cfg.mlp_bias),
                b_down=vec(d, cfg.mlp_bias),
            )
        )
    embed = rng.standard_normal((cfg.vocab_size, d)).astype(np.float32)
    final_norm = norm(d)
    lm_head = embed if cfg.tie_embeddings else mat(cfg.vocab_size, d)
    return Weights(embed, tuple(layers), final_norm, lm_head, f"synthetic:seed={seed}")


def read_safetensors(
    path: Path, digests: dict[str, Future[bytes]] | None = None, pool: ThreadPoolExecutor | None = None
) -> dict[str, np.ndarray]:
    """Read one .safetensors file into float32 numpy arrays (bf16/fp16 widened exactly).

    With `digests` (and `pool`), each tensor's stored bytes are hashed as they are read (one pass over the
    file, the hashing on `pool`'s threads): `digests[name]` = sha256 of name, dtype, shape and bytes.
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    n = int(np.frombuffer(raw[:8].tobytes(), dtype="<u8")[0])
    header = json.loads(raw[8 : 8 + n].tobytes())
    base, out = 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _ST_DTYPES:
            raise InvalidArgument(f"{path.name}: tensor {name} has unsupported dtype {meta['dtype']}")
        lo, hi = meta["data_offsets"]
        stored = raw[base + lo : base + hi]
        if digests is not None:  # hashed from the mapping (page cache): no second copy held for the pool
            head = f"{name}|{meta['dtype']}|{list(meta['shape'])}|".encode()
            digests[name] = pool.submit(_sha256, head, stored) if pool else _done(_sha256(head, stored))
        arr = np.frombuffer(stored.tobytes(), dtype=_ST_DTYPES[meta["dtype"]])
        if meta["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr.astype(np.float32).reshape(meta["shape"])
    return out


def _sha256(head: bytes, data: np.ndarray) -> bytes:
    h = hashlib.sha256(head)
    h.update(data.data)  # hashlib drops the GIL for large buffers: pool threads hash in parallel
    return h.digest()


def _done(d: bytes) -> Future[bytes]:
    f: Future[bytes] = Future()
    f.set_result(d)
    return f


def load_pretrained(path: Path, cfg: ModelConfig) -> Weights:
    """Weights of a Llama/Qwen2/Mistral checkpoint directory (all *.safetensors files in it).

    `source` is "hf:" + a sha256 over every tensor's name, dtype, shape and stored bytes (in name order,
    whatever the sharding), computed while the files are read: two checkpoints get the same source only
    when they store the same tensors bit for bit (a bf16 and an fp16 save of one model differ).
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidArgument(f"{path}: no *.safetensors files (only safetensors checkpoints are supported)")
    t: dict[str, np.ndarray] = {}
    digests: dict[str, Future[bytes]] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as pool:
        for f in files:
            t.update(read_safetensors(f, digests, pool))
        h = hashlib.sha256()
        for name in sorted(digests):
            h.update(digests[name].result())
    get = _getter(t, path)
    layers = tuple(_layer(get, t, f"model.layers.{i}.") for i in range(cfg.n_layers))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_embeddings or "lm_head.weight" not in t else t["lm_head.weight"]
    return Weights(embed, layers, get("model.norm.weight"), lm_head, f"hf:{h.hexdigest()[:32]}")


def _getter(t: dict[str, np.ndarray], path: Path):  # type: ignore[no-untyped-def]
    def get(name: str) -> np.ndarray:
        if name not in t:
            raise InvalidArgument(f"{path}: checkpoint lacks tensor {name!r}")
        return t[name]

    return get


def _layer(get, t: dict[str, np.ndarray], p: str) -> LayerWeights:  # type: ignore[no-untyped-def]
    a, m = p + "self_attn.", p + "mlp."
    return LayerWeights(
        attn_norm=get(p + "input_layernorm.weight"),
        wq=get(a + "q_proj.weight"),
        wk=get(a + "k_proj.weight"),
        wv=get(a + "v_proj.weight"),
        wo=get(a + "o_proj.weight"),
        bq=t.get(a + "q_proj.bias"),
        bk=t.get(a + "k_proj.bias"),
        bv=t.get(a + "v_proj.bias"),
        bo=t.get(a + "o_proj.bias"),
        mlp_norm=get(p + "post_attention_layernorm.weight"),
        w_gate=get(m + "gate_proj.weight"),
        w_up=get(m + "up_proj.weight"),
        w_down=get(m + "down_proj.weight"),
        b_gate=t.get(m + "gate_proj.bias"),
        b_up=t.get(m + "up_proj.bias"),
        b_down=t.get(m + "down_proj.bias"),
    )
