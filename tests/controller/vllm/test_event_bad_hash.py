"""A block hash that decodes as msgpack but is no hash (a bytes hash shorter than 8 bytes, a negative int) is a
decode error of its batch: counted, logged once, the rank's index dropped, and the stream goes on (regression).

Found by review: the hash check (fleet/core/block_hash.normalize) raised InvalidArgument, which the subscriber did
not take for a decode error. The batch's seq was never taken, so each later live message was a gap whose replay
handed back the same batch and raised again: the rank never ingested another batch while the bad one stayed in
vLLM's replay buffer (10,000 batches), every message stepped its epoch and logged a traceback, the decode-error
counter stayed 0, and the tail poll's raise marked the whole worker (every rank) down.
Real stand-in (`kvfleet sim-vllm`: its PUB and its replay ROUTER), real Router.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from support.one_worker import one_worker, synced

from controller.vllm.events import EventDecodeError, decode_batch
from fleet.app.testkit.sim_vllm import wire


def _stored(h: bytes | int) -> wire.VllmBlockStored:
    return wire.VllmBlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                                medium="GPU", lora_name=None)


@pytest.mark.parametrize("bad", [b"abc", -1], ids=["short_bytes", "negative_int"])
def test_a_hash_that_is_no_hash_is_a_decode_error(bad: bytes | int) -> None:
    with pytest.raises(EventDecodeError, match="malformed KV event"):
        decode_batch(wire.encode_batch(0.0, [_stored(bad)], 0))
    assert decode_batch(wire.encode_batch(0.0, [_stored(b"abcdefgh")], 0)).events  # control: 8 bytes is a hash


async def test_a_batch_with_a_bad_hash_is_dropped_and_the_stream_goes_on(tmp_path: Path) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        w, pub = r.worker("w0"), sim.publisher
        assert pub is not None

        def value(name: str) -> float:
            return r.metrics.registry.get_sample_value(name) or 0.0

        pub.publish([wire.VllmBlockRemoved(block_hashes=[7], medium="GPU")])
        await synced(r, sim)
        epoch, errors = w.ranks[0].epoch, value("kvfleet_kv_event_decode_errors_total")
        bad = pub.publish([_stored(b"abc")])
        for i in range(3):
            pub.publish([_stored(1 << 40 | i)])
            await asyncio.sleep(0.05)
        await synced(r, sim)  # before the fix: the rank stayed at the seq before the bad batch
        await asyncio.sleep(0.3)  # a few tail polls (every 0.1 s)
        print(f"bad batch at seq {bad}: rank at seq {w.ranks[0].seq} of {pub.seq - 1}, epoch +{w.ranks[0].epoch - epoch}"
              f", decode errors +{value('kvfleet_kv_event_decode_errors_total') - errors:.0f}")
        assert w.ranks[0].seq == pub.seq - 1 and w.ranks[0].epoch == epoch + 1
        assert value("kvfleet_kv_event_decode_errors_total") == errors + 1
        assert r.index.num_blocks(("w0", 0)) == 3  # the batches after the bad one were applied
        assert [(row.phase, row.serving) for row in r.workers()][0][1] is True  # not marked down
