"""vLLM-compatible block-hash chains (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py).

    digest_i = H((digest_{i-1} if i > 0 else NONE_HASH, tuple(tokens[i*B:(i+1)*B]), extra_i or None))
    NONE_HASH = H(seed), seed = PYTHONHASHSEED if deployed, else "vllm-none-hash"
    external_i = int.from_bytes(digest_i, "big") & (2**64 - 1)     # what KV events carry

`extra_i` = ("lora", name, path) on every block, then ("cache_salt", salt) on block 0 only: the domain-tagged
keys of the vLLM releases this project follows (HashConfig.extra_format "tagged"). vLLM releases before the tags
hashed the plain strings its events publish, (lora_name, salt) ("untagged"); a worker's self-calibration on a
salted block 0 tells which one it runs (controller/vllm/rank_events.py).
The chain continues with the FULL digest; events carry only the low 64 bits, so an event's
parent hash cannot continue a chain (we keep the full digests we computed).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import cbor2

from fleet.core.errors import InvalidArgument

DEFAULT_SEED = "vllm-none-hash"
ALGOS = ("sha256", "sha256_cbor")
EXTRA_FORMATS = ("tagged", "untagged")  # how a block's extra keys are hashed (module doc)
MASK64 = (1 << 64) - 1


def _sha256_pickle(x: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(x: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    """The digest function vLLM picks for `--prefix-caching-hash-algo` (sha256 family only)."""
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    raise InvalidArgument(f"hash algo {algo!r} cannot be recomputed outside the worker; use sha256 or sha256_cbor")


@lru_cache(maxsize=64)
def none_hash(algo: str = "sha256", seed: str | None = None) -> bytes:
    """NONE_HASH = H(seed); seed defaults to "vllm-none-hash" (PYTHONHASHSEED unset)."""
    return hash_fn(algo)(DEFAULT_SEED if seed is None else seed)


def to_external(digest: bytes) -> int:
    """The low 64 bits of a digest, as vLLM publishes it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1."""
    return int.from_bytes(digest, "big") & MASK64


def normalize(h: bytes | int) -> int:
    """An event hash (uint64 or raw digest bytes) as the 64-bit key the index uses."""
    if isinstance(h, bool):
        raise InvalidArgument("block hash must be int or bytes, got bool")
    if isinstance(h, int):
        if not 0 <= h <= MASK64:
            raise InvalidArgument(f"int block hash out of uint64 range: {h}")
        return h
    if isinstance(h, bytes | bytearray) and len(h) >= 8:
        return to_external(bytes(h))
    raise InvalidArgument(f"block hash must be uint64 or >= 8 bytes, got {h!r:.40}")


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How one worker hashes blocks: algo, NONE_HASH seed, hash block size B and its extra keys' form."""

    algo: str = "sha256"
    seed: str | None = None
    block_size: int = 16
    extra_format: str = "tagged"

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise InvalidArgument(f"hash algo must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        if self.extra_format not in EXTRA_FORMATS:
            raise InvalidArgument(f"extra_format must be one of {', '.join(EXTRA_FORMATS)}, got {self.extra_format!r}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise InvalidArgument(f"block_size must be a positive int, got {self.block_size!r}")


def block_extra(index: int, lora: tuple[str, str] | None, cache_salt: str | None,
                extra_format: str = "tagged") -> tuple[Any, ...] | None:
    """extra_i for block `index`: ("lora", name, path) on every block, ("cache_salt", s) on block 0; "untagged":
    the adapter's name on every block, then a non-empty salt on block 0, plain strings (module doc)."""
    if extra_format == "untagged":
        plain = [lora[0]] if lora is not None else []
        if cache_salt and index == 0:
            plain.append(cache_salt)
        return tuple(plain) or None
    keys: list[tuple[Any, ...]] = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    if cache_salt is not None and index == 0:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) or None


def hash_block(cfg: HashConfig, parent: bytes | None, tokens: Sequence[int], extra: Any = None) -> bytes:
    """One chain step: H((parent or NONE_HASH, tuple(tokens), extra or None))."""
    h = hash_fn(cfg.algo)
    return h((parent if parent is not None else none_hash(cfg.algo, cfg.seed), tuple(tokens), extra or None))


def chain(cfg: HashConfig, token_ids: Sequence[int], *, lora: tuple[str, str] | None = None,
          cache_salt: str | None = None, parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
    """Full digests of every full block of `token_ids` (a partial tail block is not hashed).

    Args:
        cfg: the worker's hash configuration.
        token_ids: tokens starting at block `start_block` of the request.
        lora: (lora_name, lora_path) when the request runs under an adapter.
        cache_salt: folded into block 0 only.
        parent: full digest of the block before `start_block` (None at block 0).
        start_block: index of the first block in `token_ids` (matters for the salt).
    """
    B = cfg.block_size
    out: list[bytes] = []
    for i in range(len(token_ids) // B):
        extra = block_extra(start_block + i, lora, cache_salt, cfg.extra_format)
        parent = hash_block(cfg, parent, token_ids[i * B:(i + 1) * B], extra)
        out.append(parent)
    return out


def external_chain(cfg: HashConfig, token_ids: Sequence[int], **kw: Any) -> list[int]:
    """`chain` projected to the 64-bit hashes that KV events carry."""
    return [to_external(d) for d in chain(cfg, token_ids, **kw)]


def calibrates(cfg: HashConfig, token_ids: Sequence[int], first_hash: bytes | int, *,
               cache_salt: str | None = None) -> bool:
    """Self-calibration on a parentless BlockStored: does block 0 recompute (with its salt, if salted)?"""
    if len(token_ids) < cfg.block_size:
        return False
    extra = block_extra(0, None, cache_salt, cfg.extra_format)
    return to_external(hash_block(cfg, None, token_ids[:cfg.block_size], extra)) == normalize(first_hash)
