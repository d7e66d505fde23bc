"""Self-calibration: does a worker's parentless block 0 recompute with the hash config we predict it with?

Pure. `verdict(cfg, ev)` reads one BlockStored and says what it proves about `cfg` (docs/lifecycle.md, "Hashing and
tenants"): True or False, the config to predict the worker with from now on (a salted block 0 may show the worker's
vLLM hashes the other form of extra keys), or None where the event is no evidence.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from controller.index import tier_of
from controller.vllm.events import BlockStored
from fleet.core.block_hash import EXTRA_FORMATS, HashConfig, calibrates


def verdict(cfg: HashConfig, ev: BlockStored) -> tuple[HashConfig, bool | None]:
    """(the config to predict the worker with, what `ev` proves: True, False, or None: no evidence).

    Only the GPU pool's own events (medium GPU or None, with their tokens) are evidence: a KV connector's (vLLM's
    OffloadingConnector: medium "CPU", parent None, token_ids [], block_size 0 or its own offloaded block size)
    hashes nothing here and is never matched. NOTE: one such event used to fail calibration: the rank's index was
    dropped and the worker stayed COLD until a new prompt's block 0 came. A block size other than the config's is
    a failure; a parentless, LoRA-free block 0 whose extra keys are none or one salt is recomputed, where the
    event's hashes name its tokens block for block (BlockStored.covers_tokens)."""
    if not evidence(ev):
        return cfg, None
    if ev.block_size != cfg.block_size:
        return cfg, False
    if ev.parent_block_hash is not None or ev.lora_name is not None or not ev.block_hashes or not ev.covers_tokens():
        return cfg, None  # NOTE: a store that left null blocks out failed here: its first hash is no block 0's
    salt = _block0_salt(ev.extra_keys)
    if salt is False:
        return cfg, None
    return _recomputed(cfg, ev, salt if isinstance(salt, str) else None)


def evidence(ev: BlockStored) -> bool:
    """The GPU pool's own event, with its tokens: what calibrates, and what may give a worker's block size (the
    watcher's, when it could not read it from the worker)."""
    return tier_of(ev.group_idx, ev.medium)[1] == "GPU" and bool(ev.token_ids)


def _recomputed(cfg: HashConfig, ev: BlockStored, salt: str | None) -> tuple[HashConfig, bool]:
    """Block 0 recomputes with `cfg`; a salted one that does not, but does with the other form of extra keys, tells
    which form the worker's vLLM hashes (fleet.core.block_hash: domain-tagged, or the plain strings of releases
    before the tags), and that config is returned. NOTE: with the tagged form alone, a vLLM of the untagged kind
    failed every salted block 0 (and the proxy salts every request with its tenant's salt): the worker's index was
    dropped at each, and it was never WARM."""
    if calibrates(cfg, ev.token_ids, ev.block_hashes[0], cache_salt=salt):
        return cfg, True
    if not salt:
        return cfg, False
    other = dataclasses.replace(cfg, extra_format=next(f for f in EXTRA_FORMATS if f != cfg.extra_format))
    if calibrates(other, ev.token_ids, ev.block_hashes[0], cache_salt=salt):
        return other, True
    return cfg, False


def _block0_salt(extra_keys: tuple[Any, ...] | None) -> str | None | bool:
    """Block 0's cache salt from a parentless BlockStored's extra keys: None when block 0 has no
    extra key, the salt when its only key is one string (vLLM publishes ("cache_salt", s) as (s,)),
    False when its keys are anything else (multimodal, prompt embeds: not recomputable here)."""
    k = extra_keys[0] if extra_keys else None
    if k is None:
        return None
    if isinstance(k, list | tuple) and len(k) == 1 and isinstance(k[0], str):
        return str(k[0])
    return False
