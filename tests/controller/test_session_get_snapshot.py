"""GetSession answers one state of the session: its row, digest and token ids read together, never across an op.

Real parts: a controller on loopback gRPC over the shared local Ray cluster, a SQLite store, the SDK.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import ray
from support.controller import start_controller
from support.workers import SPEC, host_of

from fleet.sdk import AsyncFleetClient
from workers.spec import make_kernel

SYSTEM = "You are agent zero. Answer briefly."


def _prefill_digest(tokens: tuple[int, ...]) -> str:
    s = make_kernel(SPEC).session()
    s.append(list(tokens))
    return s.digest()


async def test_get_session_reads_row_digest_and_tokens_of_one_state(ray_cluster: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    ctl = await start_controller(url, None)
    c = AsyncFleetClient(ctl.address)
    try:
        row = await c.create_session("s1", SYSTEM)
        host = host_of(url, row.node)
        stall = host.call.remote("local", "s1", "stall", 60.0)            # the session busy (a long prefill)
        get = asyncio.ensure_future(c.get_session("s1", include_tokens=True))
        await asyncio.sleep(0.5)                                          # the read waits on the session...
        append = asyncio.ensure_future(c.append("s1", " an append queued behind the read."))
        await asyncio.sleep(0.5)                                          # ... and an append behind it
        await asyncio.to_thread(ray.get, host.call.remote("local", "s1", "unstall"))
        await asyncio.to_thread(ray.get, stall)
        got, done = await get, await append
        print(f"GetSession: row {got.row.num_tokens} tokens, {len(got.token_ids)} token ids; append -> {done.num_tokens}")
        assert got.row.num_tokens == len(got.token_ids)
        assert got.digest == _prefill_digest(got.token_ids)               # the digest is of the tokens answered
        now = await c.get_session("s1", include_tokens=True)              # a quiet read: the state after the append
        assert (now.row.num_tokens, now.digest) == (done.num_tokens, _prefill_digest(now.token_ids))
        assert now.digest != _prefill_digest(now.token_ids[:35])          # control: the two states' digests differ
    finally:
        await c.close()
        await ctl.stop(grace=1)


async def test_get_session_answers_the_row_list_sessions_answers(ray_cluster: None, tmp_path: Path) -> None:
    """A fork's GetSession names its parent and its state, as ListSessions does (the registry's record under the
    host's counts)."""
    ctl = await start_controller(f"sqlite:///{tmp_path / 'kvfleet.db'}", None)
    c = AsyncFleetClient(ctl.address)
    try:
        await c.create_session("s1", SYSTEM)
        await c.append("s1", " hello.")
        await c.fork("s1", "s1.b")
        listed = {r.session_id: r for r in await c.sessions()}
        for sid in ("s1", "s1.b"):
            got = (await c.get_session(sid)).row
            print(f"{sid}: GetSession parent={got.parent!r} state={got.state!r} hit_rate={got.hit_rate}; "
                  f"ListSessions parent={listed[sid].parent!r} state={listed[sid].state!r}")
            assert got == listed[sid]
        assert listed["s1.b"].parent == "s1" and listed["s1.b"].state == "active"  # control: not two empty rows
    finally:
        await c.close()
        await ctl.stop(grace=1)
