"""A tool result's op logged although its write raised keeps its blob's reference (real redis-server, the reply
to the log write lost on a real connection reset by tests/support/lossy_relay.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from support.lossy_relay import LossyRelay

from fleet.cas import open_store
from fleet.core.errors import ResourceExhausted, Unavailable
from fleet.core.oplog import AppendOp
from workers.session_kernel import SessionKernel
from workers.spec import KernelSpec, make_kernel

LATER = 10 * 365 * 86400.0  # every lease has long run out


def _lossy_log_write(store: Any, relay: LossyRelay) -> None:
    """The store's next op log write goes out with the relay armed: Redis applies it, its reply is lost."""
    write = store.oplog_append

    def armed(*args: Any) -> int:
        relay.armed = True
        return int(write(*args))

    store.oplog_append = armed


@pytest.mark.parametrize("lost", [True, False])
def test_a_tool_result_logged_behind_a_lost_reply_keeps_its_reference(redis_url: str, lost: bool) -> None:
    # before: the write's Unavailable gave the reference back although the log held the op; GC then collected the
    # blob, and the session's rebuild from that log could never fetch it
    host, port = redis_url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    relay = LossyRelay((host, int(port)), reset_after_s=0.3)
    try:
        with open_store(f"redis://{relay.address}/0") as store, open_store(redis_url) as direct:
            actor = SessionKernel("acme", "s1", make_kernel(KernelSpec(block_size=16)), None, store, None)  # type: ignore[arg-type]  # its store step only
            ref = store.put(b"tool output whose log write's reply is lost", "acme")
            op = AppendOp(1, "tool_result", "acme", ref=ref, num_tokens=9, op_id="turn-3")
            if lost:
                _lossy_log_write(store, relay)
                with pytest.raises(Unavailable):
                    actor._write(op)
                assert relay.resets == 1
            else:  # the control: the same write, answered
                actor._write(op)
            assert [e["ref"] for e in direct.oplog_read("acme", "s1")] == [ref]  # the log holds it either way
            assert direct.stat(ref, "acme").refs == 1                          # before (lost): 0
            assert direct.gc(now=time.time() + LATER) == 0                     # before (lost): 1, the blob gone
            assert direct.get(ref, "acme").startswith(b"tool output")
    finally:
        relay.close()


def test_a_log_write_that_did_not_land_gives_the_reference_back(redis_url: str) -> None:
    # the other side: a write Redis refused (out of memory: nothing written, reads still served) keeps no reference
    import redis

    admin = redis.Redis.from_url(redis_url)
    with open_store(redis_url) as store:
        actor = SessionKernel("acme", "s1", make_kernel(KernelSpec(block_size=16)), None, store, None)  # type: ignore[arg-type]  # its store step only
        ref = store.put(b"tool output whose log write is refused", "acme")
        write = store.oplog_append

        def full(*args: Any) -> int:
            admin.config_set("maxmemory", 1)  # the reference taken: Redis full for the log write alone
            try:
                return int(write(*args))
            finally:
                admin.config_set("maxmemory", 0)

        store.oplog_append = full
        with pytest.raises(ResourceExhausted):
            actor._write(AppendOp(1, "tool_result", "acme", ref=ref, num_tokens=9))
        assert store.oplog_read("acme", "s1") == [] and store.stat(ref, "acme").refs == 0
