"""A KV-event stream that fails says why in the log, once per cause and 10 s, never once per message.

A batch that did not decode, an unknown event type, a message of the wrong shape, a batch of another DP rank or a
gap replay could not repair each drops the rank's index; before, only a metric counted it, and an operator whose
vLLM spoke a format this controller does not know saw a worker routed COLD with nothing in the log saying why.
Real Router, a real PUB socket the test writes (support/kv_flood.live_stream).
"""

from __future__ import annotations

import logging

import msgspec
import pytest
from support.kv_flood import live_stream


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "KV events of" in r.getMessage()]


async def test_each_failed_batch_is_a_log_line_naming_the_worker_and_the_cause(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    async with live_stream(tmp_path) as live:
        epoch = live.r.worker("w0").ranks[0].epoch
        await live.send_payload(b"\xc1\xc1 not msgpack")
        await live.send_payload(msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}], 0]))
        await live.send_payload(_stored(1, dp_rank=3))
        lines = _lines(caplog)
        assert live.r.worker("w0").ranks[0].epoch == epoch + 3  # control: each one dropped the index
        assert len(lines) == 3, lines
        assert "worker w0 rank 0" in lines[0] and "decode_error at seq 1" in lines[0] and "malformed" in lines[0]
        assert "unknown_event_type at seq 2" in lines[1] and "'BlockMoved'" in lines[1]
        assert "seq 3 is a batch of data_parallel_rank 3" in lines[2]


async def test_a_flood_of_bad_batches_is_one_line(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    async with live_stream(tmp_path) as live:
        for _ in range(30):
            await live.send_payload(_stored(1, block_size="16"))
        lines = _lines(caplog)
        assert len(lines) == 1 and "block_size" in lines[0], lines  # the decode error names the field


def _stored(h: int, *, dp_rank: int = 0, block_size: object = 16) -> bytes:
    """A one-hash BlockStored batch as vLLM encodes it, but for the fields given."""
    ev = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [],
          "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([1.0, [ev], dp_rank])
