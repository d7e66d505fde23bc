"""An Append whose text encodes to no tokens is refused naming the text, before anything is logged.

Found by scripts/fuzz_grpc.py: an empty text was refused by the kernel as "a piece needs >= 1 token id in [0, 512);
nothing was appended", naming token ids the caller never sent, not the text it did.

Real parts: a controller on loopback gRPC over the shared local Ray cluster, a SQLite store.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from support.controller import start_controller

from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.api.kvfleet.v1.sessions_pb2_grpc import SessionServiceStub
from fleet.cas import open_store


async def test_an_empty_text_is_refused_naming_the_text(ray_cluster: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    ctl = await start_controller(url, None)
    store = open_store(url)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = SessionServiceStub(ch)
            await stub.CreateSession(pb.CreateSessionRequest(session_id="s1", system_prompt="You are terse."))
            before = store.oplog_read("local", "s1")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Append(pb.AppendRequest(session_id="s1", text=""))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert "the message's text '' encodes to no tokens" in e.value.details(), e.value.details()
            assert store.oplog_read("local", "s1") == before  # nothing logged
            got = await stub.Append(pb.AppendRequest(session_id="s1", text=" hi"))  # control: a text with tokens
            assert got.num_tokens == len("You are terse. hi")
    finally:
        store.close()
        await ctl.stop(0)
