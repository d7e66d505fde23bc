"""vLLM 0.33.0's KV-event structs (vllm/distributed/kv_events.py), for byte-exact encoding.

The outer batch is a positional array; each event is a map tagged "type" = vLLM's class name, with
fields in declaration order and defaulted fields omitted when equal to their default. The classes carry a
Vllm prefix (their tags stay vLLM's names) so they are not confused with the controller's decoded events
(controller.vllm.events) or the radix tree's page events (fleet.core.radix.events).
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


_ENC = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[Any], dp_rank: int | None = 0) -> bytes:
    """msgspec.msgpack.Encoder().encode(KVEventBatch(ts, events, dp_rank)), as vLLM publishes."""
    return _ENC.encode(EventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))
