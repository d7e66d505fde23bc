"""Decoding vLLM KV-event batches (vllm/distributed/kv_events.py) with msgspec.

Wire shape: the batch is a positional array `[ts, [event, ...], data_parallel_rank]`; each event
is a map tagged by "type" (vLLM >= 0.24) or, in the legacy encoding (<= 0.23), a positional
array whose first element is the tag. Both are decoded by tag; unknown fields are ignored, an
unknown event *type* raises `UnknownEventType` (the watcher invalidates the worker rather than
skip it), anything else malformed raises `EventDecodeError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

from fleet.core.block_hash import normalize
from fleet.core.errors import InvalidArgument

KNOWN_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
Hash = bytes | int


class EventDecodeError(InvalidArgument):
    """A KV-event frame that does not decode as a vLLM KVEventBatch."""


class UnknownEventType(EventDecodeError):
    """A well-formed event whose tag this controller does not know."""


# map encoding (vLLM >= 0.24): tag key "type", fields by name
class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


# legacy array encoding (vLLM <= 0.23): ["BlockStored", f1, f2, ...], trailing defaults omitted
class _ArrStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _RawMapBatch(msgspec.Struct):
    """The batch as a map: not what vLLM's releases send (a positional array), but one upstream revision dropped
    array_like from the batch as it did from the events; read too, as both event shapes are."""
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_MAP_BATCH = msgspec.msgpack.Decoder(_RawMapBatch)
_MAP = msgspec.msgpack.Decoder(_MapStored | _MapRemoved | _MapCleared)
_ARR = msgspec.msgpack.Decoder(_ArrStored | _ArrRemoved | _ArrCleared)
_ANY = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    # the KV group's kind and sliding window (vLLM >= 0.33; None before): how the index matches a hybrid model's
    # groups (controller/index.py)
    kind: str | None = None
    window: int | None = None

    def covers_tokens(self) -> bool:
        """Its hashes name its tokens block for block: hash i is the block of token_ids[i*B:(i+1)*B].

        False where vLLM left null blocks out: BlockPool.cache_full_blocks skips a null block (a sliding-window
        group's blocks outside the window, a Mamba group's in align mode) in block_hashes and extra_keys but not
        in token_ids, which span every new block (vllm#44451). Such an event names GPU-resident hashes all the
        same, but which of its token blocks each one hashes, it does not say: no calibration evidence."""
        return len(self.token_ids) == len(self.block_hashes) * self.block_size


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    # Never decoded: the watcher sets it on the clear that lifts a "clear" fence, the one a forgetting verb
    # of this controller queued (fleet/core/rank_state.py). The index, the demand ledger and the block-pool
    # shadow were dropped when that verb ran, and nothing was routed there while it ran, so every route the
    # shadow has seen since came after this clear: it must not forget them (controller/router.py).
    awaited: bool = False


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None


def _is_map(raw: bytes) -> bool:
    b = raw[0] if raw else 0
    return 0x80 <= b <= 0x8F or b in (0xDE, 0xDF)


def _tag_of(raw: bytes) -> Any:
    try:
        obj = _ANY.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # NOTE: see decode_batch
        return None
    if isinstance(obj, dict):
        return obj.get("type")
    if isinstance(obj, list) and obj:
        return obj[0]
    return None


def _convert(ev: Any) -> Event:
    if isinstance(ev, _MapStored | _ArrStored):
        # vLLM's block pool sends whole blocks of tokens: block_size per hash, or more where it left null blocks
        # out of the hashes but not out of the tokens (BlockStored.covers_tokens); its offloading connector's
        # placeholder sends none (token_ids=[], block_size 0). NOTE: a one-hash event used to pass with any number
        # of tokens (30M held the loop and 677 MiB; the message's byte bound, budget.refusal, now refuses those).
        n = len(ev.token_ids)
        if n and (ev.block_size <= 0 or n % ev.block_size or n < len(ev.block_hashes) * ev.block_size):
            raise EventDecodeError(f"BlockStored with {len(ev.block_hashes)} hashes of block size {ev.block_size} "
                                   f"but {n} tokens")
        parent = None if ev.parent_block_hash is None else normalize(ev.parent_block_hash)
        return BlockStored(tuple(normalize(h) for h in ev.block_hashes), parent, tuple(ev.token_ids), ev.block_size,
                           ev.medium, ev.lora_name, None if ev.extra_keys is None else tuple(ev.extra_keys),
                           ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
    if isinstance(ev, _MapRemoved | _ArrRemoved):
        return BlockRemoved(tuple(normalize(h) for h in ev.block_hashes), ev.medium, ev.group_idx)
    return AllBlocksCleared()


def decode_event(raw: bytes) -> Event:
    """Decode one event (map or legacy array) by its tag."""
    dec = _MAP if _is_map(raw) else _ARR
    try:
        ev = dec.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        tag = _tag_of(raw)
        if isinstance(tag, str) and tag not in KNOWN_TYPES:
            raise UnknownEventType(f"unknown KV event type {tag!r}") from e
        raise EventDecodeError(f"malformed KV event: {e}") from e
    try:
        return _convert(ev)
    except EventDecodeError:
        raise
    except InvalidArgument as e:
        # NOTE: a hash that is no hash (normalize: a bytes hash under 8 bytes, a negative int) raised InvalidArgument,
        # which the subscriber did not take for a decode error: the batch's seq was never taken, every later message
        # was a gap whose replay raised again, and the rank ingested nothing while vLLM's replay buffer held it
        raise EventDecodeError(f"malformed KV event: {e}") from e


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a KVEventBatch payload (third frame of a PUB message).

    Raises:
        UnknownEventType: an event tag outside BlockStored/BlockRemoved/AllBlocksCleared.
        EventDecodeError: anything else that is not a valid batch.
    """
    try:
        b: _RawBatch | _RawMapBatch = _BATCH.decode(payload)
    except msgspec.ValidationError as e:
        if "got `object`" not in str(e):
            raise EventDecodeError(f"malformed KV event batch: {e}") from e
        try:
            b = _MAP_BATCH.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError) as e2:
            raise EventDecodeError(f"malformed KV event batch: {e2}") from e2
        except Exception as e2:  # as below
            raise EventDecodeError(f"malformed KV event batch: {e2!r}") from e2
    except msgspec.DecodeError as e:
        raise EventDecodeError(f"malformed KV event batch: {e}") from e
    except Exception as e:  # msgspec raises plain errors on some truncated inputs
        raise EventDecodeError(f"malformed KV event batch: {e!r}") from e
    if not math.isfinite(b.ts):
        # NOTE: vLLM stamps a batch with time.time(); the stamp is read as the worker's clock (a restart's fence "reset"
        # lifts at a batch stamped at or after the new process's start), and a +inf stamp lifted it from any batch: the
        # old publisher's queued stores were indexed, and routed WARM to the restarted worker's empty cache
        raise EventDecodeError(f"malformed KV event batch: stamp {b.ts} is no time")
    try:
        events = tuple(decode_event(bytes(r)) for r in b.events)
    except EventDecodeError:
        raise
    except Exception as e:
        # NOTE: an event nested just short of the recursion limit passed the batch's decode (its events are Raw) and
        # raised RecursionError in the event's: at 984 lists deep (an unknown tag's field, read again for the tag),
        # that escaped the subscriber as a traceback and the batch's seq was never taken (with vLLM's replay, each
        # later message a gap whose replay hands back the same batch, which raises again)
        raise EventDecodeError(f"malformed KV event: {e!r:.200}") from e
    return EventBatch(b.ts, events, b.data_parallel_rank)


END_SEQ = (1 << 64) - 1  # the replay stream's end marker (vLLM sends (-1).to_bytes(8, signed=True))
MAX_SEQ = (1 << 63) - 2  # vLLM's seq is a non-negative int64 counter; seq + 1 must still fit


def parse_seq(frame: bytes, *, allow_end: bool = False) -> int:
    """The seq frame: >= 8 bytes, first 8 big-endian (a 24-byte frame also carries a publisher id).

    Raises:
        EventDecodeError: a short frame, or a seq no vLLM publisher can send (> MAX_SEQ; the end
            marker only where `allow_end`, i.e. in a replay reply). NOTE: one such frame used to
            be applied and persisted, and its seq + 1 overflowed every later int64 use of it.
    """
    if len(frame) < 8:
        raise EventDecodeError(f"seq frame of {len(frame)} bytes (need >= 8)")
    seq = int.from_bytes(frame[:8], "big")
    if seq > MAX_SEQ and not (allow_end and seq == END_SEQ):
        raise EventDecodeError(f"seq {seq} is outside vLLM's range [0, {MAX_SEQ}]")
    return seq
