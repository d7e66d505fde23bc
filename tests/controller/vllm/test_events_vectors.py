"""Every vLLM KV-event vector decodes to the right index state (map, legacy array, replay)."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import pytest
import zmq
import zmq.asyncio
from support.vllm_vectors import frames, load

from controller.index import PrefixIndex, tier_of
from controller.metrics import Metrics
from controller.vllm.calibration import verdict
from controller.vllm.events import BlockStored, EventDecodeError, UnknownEventType, decode_batch, parse_seq
from controller.vllm.subscriber import Subscriber
from fleet.core.block_hash import HashConfig, normalize

V = load()
KEY = ("w", 0)


def _ref_state(decoded_events: list[dict]) -> dict[tuple, set[int]]:
    """Independent reference: apply the JSON events in order to plain sets."""
    tiers: dict[tuple, set[int]] = {}
    for e in decoded_events:
        if e["type"] == "AllBlocksCleared":
            tiers.clear()
            continue
        hs = {normalize(bytes.fromhex(h["$bytes_hex"])) if isinstance(h, dict) else h for h in e["block_hashes"]}
        t = tier_of(e.get("group_idx"), e.get("medium"))
        if e["type"] == "BlockStored":
            tiers.setdefault(t, set()).update(hs)
        else:
            tiers.get(t, set()).difference_update(hs)
    return {k: v for k, v in tiers.items() if v}


def _index_state(idx: PrefixIndex) -> dict[tuple, set[int]]:
    return {k: set(v) for k, v in idx.rank(KEY).tiers.items() if v}


@pytest.mark.parametrize("v", V["vectors"] + V["legacy_vectors"], ids=lambda v: v["name"])
def test_vector_decodes_to_index_state(v: dict) -> None:
    topic, seq_f, payload = frames(v)
    assert topic.decode() == v["topic"] and parse_seq(seq_f) == v["seq"]
    batch = decode_batch(payload)
    assert batch.data_parallel_rank == v["decoded"]["data_parallel_rank"]
    assert [type(e).__name__ for e in batch.events] == [e["type"] for e in v["decoded"]["events"]]
    idx = PrefixIndex()
    for e in batch.events:
        idx.apply(KEY, e)
    expected = _ref_state(v["decoded"]["events"])
    assert _index_state(idx) == expected
    print(v["name"], "->", {f"{k[0]}/{k[1]}": len(s) for k, s in expected.items()})


def test_named_vectors_end_state() -> None:
    by = {v["name"]: v for v in V["vectors"] + V["legacy_vectors"]}
    H = [b["external_int"] for b in V["main_chain"]]

    def gpu(name: str) -> set[int]:
        idx = PrefixIndex()
        for e in decode_batch(frames(by[name])[2]).events:
            idx.apply(KEY, e)
        return idx.resident(KEY)

    assert gpu("stored_root_chain") == set(H[:3])
    assert gpu("mixed_batch") == {H[0], H[1]}           # everything before AllBlocksCleared is void
    assert gpu("legacy_mixed_batch") == {H[0], H[1]}
    assert gpu("cpu_tier") == set()                     # CPU tier never counts as warm
    assert gpu("bytes_hashes") == {H[0]}                # raw digests normalise to the same 64-bit keys
    assert gpu("all_cleared") == set() and gpu("empty_batch") == set()


def test_a_store_that_left_null_blocks_out_is_indexed_but_no_calibration_evidence() -> None:
    """vLLM's block pool leaves null blocks (outside a sliding window, Mamba align mode) out of block_hashes but not
    out of token_ids (vllm#44451). NOTE: this vector was a decode error (1 hash of block size 16 but 48 tokens): the
    batch was dropped and the rank invalidated; and, decoded, its first hash was taken for block 0's and failed
    calibration. Controls: tokens that are no whole number of blocks, or fewer than the hashes name, still raise."""
    by = {v["name"]: v for v in V["vectors"]}
    H = [b["external_int"] for b in V["main_chain"]]
    (ev,) = decode_batch(frames(by["stored_null_blocks_skipped"])[2]).events
    assert isinstance(ev, BlockStored) and ev.block_hashes == (H[2],) and len(ev.token_ids) == 48
    assert not ev.covers_tokens()
    idx = PrefixIndex()
    idx.apply(KEY, ev)
    assert set(idx.rank(KEY).tiers[(1, "GPU")]) == {H[2]}
    cfg = HashConfig("sha256", None, 16)
    assert verdict(cfg, ev) == (cfg, None)
    (root,) = decode_batch(frames(by["stored_root_chain"])[2]).events  # control: an aligned block 0 calibrates
    assert isinstance(root, BlockStored) and root.covers_tokens() and verdict(cfg, root) == (cfg, True)
    for hashes, tokens in ((1, 47), (2, 16)):  # 47: no whole number of blocks; 16 for 2 hashes of 16: too few
        bad = {"type": "BlockStored", "block_hashes": [7, 8][:hashes], "parent_block_hash": None,
               "token_ids": list(range(tokens)), "block_size": 16, "lora_id": None, "medium": "GPU",
               "lora_name": None}
        with pytest.raises(EventDecodeError):
            decode_batch(msgspec.msgpack.encode([1.0, [bad], 0]))


def test_unknown_type_and_malformed_frames_raise() -> None:
    good = frames(V["vectors"][0])[2]
    unknown = msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}], 0])
    with pytest.raises(UnknownEventType):
        decode_batch(unknown)
    with pytest.raises(UnknownEventType):
        decode_batch(msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]], 0]))
    for junk in (b"", b"\x00", good[:40], msgspec.msgpack.encode({"ts": 1}),
                 msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}], 0])):
        with pytest.raises(EventDecodeError):
            decode_batch(junk)
    with pytest.raises(EventDecodeError):
        parse_seq(b"\x00\x01")
    assert parse_seq(bytes(8) + b"\x07" * 16) == 0  # 24-byte seq frame: first 8 bytes count


class _Sink:
    def __init__(self) -> None:
        self.seq, self.batches, self.invalid = -1, [], []

    def last_seq(self) -> int:
        return self.seq

    def on_batch(self, seq, batch) -> None:
        self.seq = seq
        self.batches.append((seq, batch))

    def on_invalidate(self, reason, seq) -> None:
        self.invalid.append(reason)


@pytest.mark.parametrize("legacy", [False, True], ids=["3-frame(>=0.26)", "2-frame(older)"])
async def test_replay_exchange(legacy: bool) -> None:
    rep = V["replay"]
    replies = [[base64.b64decode(f) for f in r] for r in rep["reply_frames_b64_v0_26_plus"]]
    end = [base64.b64decode(f) for f in rep["end_marker_frames_b64_v0_26_plus"]]
    if legacy:
        replies = [[r[0], r[2], r[3]] for r in replies]
        end = [end[0], end[2], end[3]]
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[list[bytes]] = []

    async def serve() -> None:
        req = await router.recv_multipart()
        seen.append(req[1:])
        for r in replies + [end]:
            await router.send_multipart([req[0], *r])

    task = asyncio.create_task(serve())
    sink = _Sink()
    sub = Subscriber(ctx, "tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}", sink, Metrics())
    got = await sub.replay(4)
    await task
    assert seen == [[base64.b64decode(f) for f in rep["request_frames_b64"]]]
    assert got is not None and [s for s, _ in got] == [4, 5, 6]
    idx = PrefixIndex()
    for _, p in got:
        for e in decode_batch(p).events:
            idx.apply(KEY, e)
    H = [b["external_int"] for b in V["main_chain"]]
    assert idx.resident(KEY) == {H[0], H[1]}  # replayed removals, clear, then re-stores in order
    router.close(0)
    ctx.term()


def test_a_batch_sent_as_a_map_decodes_as_the_same_batch_sent_as_an_array() -> None:
    """vLLM's releases send the batch as a positional array; one upstream revision dropped array_like from the batch
    as it did from the events (then: "Expected `array`, got `object`", every batch refused, the worker COLD)."""
    events = [{"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None, "token_ids": list(range(32)),
               "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}, {"type": "AllBlocksCleared"}]
    as_array = decode_batch(msgspec.msgpack.encode([1.5, events, 0]))
    as_map = decode_batch(msgspec.msgpack.encode({"ts": 1.5, "events": events, "data_parallel_rank": 0}))
    assert as_map == as_array and len(as_map.events) == 2
    with pytest.raises(EventDecodeError):   # control: a map that is not a batch is still refused
        decode_batch(msgspec.msgpack.encode({"ts": "x", "events": 3}))
