"""A batch stamped with no time (NaN or infinite) is a decode error; an infinite stamp no longer lifts a restart's fence
(regression).

Found by the KV-event fuzz audit (scripts/fuzz_kv_events.py): vLLM stamps each batch with `time.time()`, and the
controller reads the stamp as the worker's clock: once a look finds the worker restarted, the rank's fence "reset"
keeps the old publisher's batches (still queued on our socket) out of the index, and a batch stamped at or after the
new process's start lifts it. A batch stamped +inf passed that check whatever process sent it, so the old stream's
next store was indexed and its prompt routed WARM to the restarted, empty worker. A real Router (SQLite) whose worker's
HTTP is the `kvfleet sim-vllm` stand-in (restarted in place: a new start time) and whose events come from a real PUB.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from support.kv_flood import live_stream

from controller.vllm.events import EventDecodeError, decode_batch
from fleet.app.testkit.sim_vllm import wire
from fleet.core.block_hash import HashConfig, external_chain

CFG = HashConfig("sha256", None, 16)
ENC = msgspec.msgpack.Encoder()


def _stored(tokens: list[int]) -> Any:
    return wire.VllmBlockStored(block_hashes=external_chain(CFG, tokens), parent_block_hash=None, token_ids=tokens,
                                block_size=16, lora_id=None, medium="GPU", lora_name=None)


@pytest.mark.parametrize("ts", [math.inf, -math.inf, math.nan])
def test_a_batch_stamped_with_no_time_is_a_decode_error(ts: float) -> None:
    with pytest.raises(EventDecodeError, match="stamp"):
        decode_batch(ENC.encode([ts, [], 0]))
    assert decode_batch(ENC.encode([time.time(), [], 0])).events == ()  # control: a time decodes


async def test_an_infinite_stamp_does_not_lift_a_restarts_fence(tmp_path: Path) -> None:
    async with live_stream(tmp_path) as live:
        w = live.r.worker("w0")
        old, new = list(range(100, 132)), list(range(500, 532))
        await live.send([_stored(old)])
        assert (await live.r.route(old, "m")).verdict == "WARM"
        sim = live.sim
        assert sim is not None
        while int(time.time()) == int(sim.engine.start_time):  # /metrics gives the start time in whole seconds
            await asyncio.sleep(0.05)
        sim.restart()  # its cache is empty now
        await live.until(lambda: w.ranks[0].fence == "reset", "the restart was never seen")
        assert (await live.r.route(old, "m")).verdict == "COLD"

        # the old publisher's stream goes on (queued before the restart): one batch stamped with a finite time
        # before the new start (control), then one stamped +inf, each storing the old prompt again
        await live.send_payload(wire.encode_batch(1.0, [_stored(old)], 0))
        assert w.ranks[0].fence == "reset" and (await live.r.route(old, "m")).verdict == "COLD"
        await live.send_payload(wire.encode_batch(math.inf, [_stored(old)], 0))
        print(f"after the +inf batch: fence {w.ranks[0].fence!r}, {live.blocks()} blocks")
        assert (await live.r.route(old, "m")).verdict == "COLD"  # before the fix: WARM 32, the fence lifted

        # control: the new publisher's stream (its seq from 0) lifts the fence, and what it stores routes WARM
        live.seq = 0
        await live.send_payload(wire.encode_batch(time.time(), [_stored(new)], 0))
        await live.until(lambda: w.ranks[0].fence == "", "the new publisher never lifted the fence")
        assert (await live.r.route(new, "m")).verdict == "WARM"
        assert (await live.r.route(old, "m")).verdict == "COLD"
