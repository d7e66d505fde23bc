"""A tenant's session history is bounded (--max-history-tokens-per-tenant): a session's op log keeps
every piece it appended, evicted ones included, so appending and evicting kept its KV small while its
log, its host's ledger and the store grew without end. Each append is charged its tokens plus 16 (its
op); a fork is charged its parent's history again (its log starts with a copy); closing frees it.

Real parts: a controller on loopback gRPC over the shared local Ray cluster, a SQLite store.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
import ray
from support.controller import make_tokens, start_controller
from support.proxy_fleet import until

from controller.quotas import SessionLimits
from fleet.api.kvfleet.v1 import sessions_pb2, sessions_pb2_grpc
from fleet.app.cli.session import render_sessions
from fleet.cas import open_store
from fleet.core.errors import ResourceExhausted
from fleet.core.oplog import HISTORY_OP_CHARGE
from fleet.sdk import AsyncFleetClient
from workers.placement import RAY_NAMESPACE, fleet_scope, host_name

SYSTEM = "You are agent zero. Answer briefly."   # 35 tokens (byte tokenizer)
IDS = [(i * 7 + 300) % 512 for i in range(200)]
CHARGE = len(IDS) + HISTORY_OP_CHARGE            # 216 per append of IDS
CAP = 35 + HISTORY_OP_CHARGE + 4 * CHARGE        # the create and four appends: 915


async def _cycle(c: AsyncFleetClient, sid: str) -> None:
    """Append IDS and evict them: the session's KV is back where it was, its log 216 longer."""
    r = await c.append(sid, IDS)
    assert r.piece is not None
    await c.evict(sid, r.piece.piece_id)


def _logged(url: str, tenant: str, sid: str) -> int:
    """What the session's op log holds, as the quota charges it (read from the store)."""
    store = open_store(url)
    try:
        return sum(len(op["tokens"]) + HISTORY_OP_CHARGE for op in store.oplog_read(tenant, sid)
                   if op["op"] == "append")
    finally:
        store.close()


async def test_appending_and_evicting_stops_at_the_tenants_history_quota(ray_cluster: None, tmp_path: Path) -> None:
    tokens, url = make_tokens(tmp_path), f"sqlite:///{tmp_path / 'kvfleet.db'}"
    limits = SessionLimits(max_kv_bytes_per_tenant=0, max_history_tokens_per_tenant=CAP)
    ctl = await start_controller(url, tokens, sessions=limits)
    a, b = AsyncFleetClient(ctl.address, tokens.a), AsyncFleetClient(ctl.address, tokens.b)
    try:
        await a.create_session("s1", SYSTEM)
        for _ in range(4):
            await _cycle(a, "s1")                                     # exactly at the quota: 915
        assert _logged(url, "acme", "s1") == CAP
        with pytest.raises(ResourceExhausted, match=r"--max-history-tokens-per-tenant 915\b.*longest: s1 \(915\)"):
            await a.append("s1", IDS)                                 # NOTE: before, nothing bounded the log
        with pytest.raises(ResourceExhausted, match="--max-history-tokens-per-tenant"):
            await a.fork("s1", "s1.b")                                # a fork copies its parent's 915
        row = (await a.get_session("s1")).row
        assert row.num_tokens == 35 and _logged(url, "acme", "s1") == CAP   # refused: nothing logged
        assert row.history_tokens == CAP                              # shown: GetSession, ListSessions, session ls
        assert {r.session_id: r.history_tokens for r in await a.sessions()} == {"s1": CAP}
        table = render_sessions(await a.sessions())
        assert "history" in [c.header for c in table.columns] and "915" in str(table.columns[5]._cells[0])
        await b.create_session("b1", SYSTEM)                          # another tenant is not affected
        await _cycle(b, "b1")
        await a.close_session("s1")                                   # closing frees its history
        await a.create_session("s2", SYSTEM)
        await _cycle(a, "s2")
    finally:
        for x in (a, b):
            await x.close()
        await ctl.stop(grace=1)

    ctl = await start_controller(url, tokens, sessions=limits)       # a new controller, same store
    a = AsyncFleetClient(ctl.address, tokens.a)
    try:                                                              # the ledger is rebuilt from the logs
        for _ in range(3):
            await _cycle(a, "s2")
        assert _logged(url, "acme", "s2") == CAP
        with pytest.raises(ResourceExhausted, match="--max-history-tokens-per-tenant"):
            await a.append("s2", [1])                                 # one token and its op: 17 more
    finally:
        await a.close()
        await ctl.stop(grace=1)


async def test_a_retry_of_a_logged_append_is_answered_at_the_history_quota(ray_cluster: None,
                                                                          tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    limits = SessionLimits(max_kv_bytes_per_tenant=0, max_history_tokens_per_tenant=35 + HISTORY_OP_CHARGE + CHARGE)
    ctl = await start_controller(url, None, sessions=limits)
    c = AsyncFleetClient(ctl.address)
    try:
        await c.create_session("s", SYSTEM)
        first = await c.append("s", IDS, op_id="op-1")                # exactly at the quota
        again = await c.append("s", IDS, op_id="op-1")                # the client's retry: answered, not applied
        assert again.replayed and again.piece == first.piece and again.num_tokens == first.num_tokens
        with pytest.raises(ResourceExhausted, match="--max-history-tokens-per-tenant"):
            await c.append("s", IDS, op_id="op-2")                    # control: a new op is refused
    finally:
        await c.close()
        await ctl.stop(grace=1)



async def test_a_fork_racing_an_append_is_charged_what_its_log_holds(ray_cluster: None, tmp_path: Path) -> None:
    """The parent's actor is stalled, an append is queued on it, then a fork: the fork reserves the parent's
    history before the append is counted, but its log copies the append. Each session is charged what its
    log holds once the calls end, so with the quota set to exactly that, one more token is refused (before,
    the child and every fork of it were charged 4,016 too little, and it was accepted)."""
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    big = 35 + HISTORY_OP_CHARGE + 20 * CHARGE - 19 * HISTORY_OP_CHARGE      # p after the append: 4,067
    limits = SessionLimits(max_kv_bytes_per_tenant=0, max_history_tokens_per_tenant=3 * big)
    ctl = await start_controller(url, None, sessions=limits)
    c = AsyncFleetClient(ctl.address)
    try:
        await c.create_session("p", SYSTEM)
        [node] = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        host = ray.get_actor(host_name(node, fleet_scope(url)), namespace=RAY_NAMESPACE)
        stalled = host.call.remote("local", "p", "stall", 3.0)
        await asyncio.sleep(0.5)                                       # the stall holds p's lock first
        app = asyncio.ensure_future(c.append("p", IDS * 20))           # 4,000 ids, queued behind it
        await asyncio.sleep(0.5)
        await c.fork("p", "c")                                         # reserved before the append landed
        await app
        await c.fork("c", "c0")
        ray.get(stalled, timeout=30)
        assert [_logged(url, "local", s) for s in ("p", "c", "c0")] == [big] * 3    # the logs: the quota, exactly
        with pytest.raises(ResourceExhausted, match="--max-history-tokens-per-tenant"):
            await c.append("c0", [1])                                  # NOTE: before, accepted
    finally:
        await c.close()
        await ctl.stop(grace=1)


async def test_an_append_whose_call_timed_out_is_charged(ray_cluster: None, tmp_path: Path) -> None:
    """The controller's fleet call gives up (Unavailable) while the host still logs the append. The append is
    charged all the same, so with the quota at exactly what the logs hold one more token is refused (before: it
    was never charged, and accepted). Raw gRPC, no retry: the SDK's client retries the op until the host answers
    it from its log, and that answer resyncs the ledger, so a test through it held without the charge."""
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    big = 35 + HISTORY_OP_CHARGE + 20 * CHARGE - 19 * HISTORY_OP_CHARGE
    limits = SessionLimits(max_kv_bytes_per_tenant=0, max_history_tokens_per_tenant=big + 35 + HISTORY_OP_CHARGE)
    ctl = await start_controller(url, None, sessions=limits)
    ch = grpc.aio.insecure_channel(ctl.address)
    s = sessions_pb2_grpc.SessionServiceStub(ch)

    def append(sid: str, ids: list[int], op_id: str = "") -> Awaitable[sessions_pb2.AppendResponse]:
        return s.Append(sessions_pb2.AppendRequest(session_id=sid, token_ids=sessions_pb2.TokenIds(ids=ids),
                                                   op_id=op_id))

    try:
        for sid in ("p", "q"):
            await s.CreateSession(sessions_pb2.CreateSessionRequest(session_id=sid, system_prompt=SYSTEM))
        nodes = ctl.ctx.kernel_fleet.nodes                             # type: ignore[attr-defined]
        nodes.call_timeout_s = 0.02                                    # stands for a call queued past 60 s
        cut = await _code(append("p", IDS * 20, "op-1"))
        nodes.call_timeout_s = 120.0
        await until(lambda: asyncio.sleep(0, _logged(url, "local", "p")), lambda n: n == big, timeout=20.0)  # logged
        assert cut == "UNAVAILABLE" and _logged(url, "local", "p") == big
        assert await _code(append("q", [1])) == "RESOURCE_EXHAUSTED"   # NOTE: before, accepted
        r = await append("p", IDS * 20, "op-1")                        # control: the retry, answered from the log
        assert r.replayed
        assert await _code(append("q", [1])) == "RESOURCE_EXHAUSTED"   # and the ledger, resynced, still refuses
    finally:
        await ch.close()
        await ctl.stop(grace=1)


def _slowed(fleet: object, name: str, when: Callable[..., bool], delay_s: float = 0.6) -> None:
    """`fleet.<name>` (a KernelFleet call, run in the tenant's lane thread) takes `delay_s` longer when `when(*args)`."""
    real = getattr(fleet, name)

    def slow(*args: object, **kw: object) -> object:
        if when(*args):
            time.sleep(delay_s)
        return real(*args, **kw)

    setattr(fleet, name, slow)


async def _code(aw: Awaitable[object]) -> str:
    try:
        await aw
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def test_a_create_its_client_gave_up_on_still_counts_against_the_sessions_quota(
        ray_cluster: None, tmp_path: Path) -> None:
    """The client's deadline passes while the controller's lane thread is creating the session; the thread goes
    on and creates it. NOTE: the ledger dropped it at the cancel, so the next create passed the quota (the
    review: 4 sessions held against a quota of 2). Now the reservation stays until the create ends."""
    ctl = await start_controller(f"sqlite:///{tmp_path / 'kvfleet.db'}", None,
                                 sessions=SessionLimits(max_sessions_per_tenant=2))
    ch = grpc.aio.insecure_channel(ctl.address)
    s = sessions_pb2_grpc.SessionServiceStub(ch)
    try:
        assert await _code(s.CreateSession(sessions_pb2.CreateSessionRequest(session_id="s0", system_prompt=SYSTEM))) == "OK"
        _slowed(ctl.ctx.kernel_fleet, "create_session", lambda *a: "c0" in a)
        cut = await _code(s.CreateSession(sessions_pb2.CreateSessionRequest(session_id="c0", system_prompt=SYSTEM),
                                          timeout=0.2))
        meanwhile = await _code(s.CreateSession(sessions_pb2.CreateSessionRequest(session_id="c1",
                                                                                  system_prompt=SYSTEM)))
        async def held_now() -> list[str]:
            return sorted(r["session"] for r in ctl.ctx.kernel_fleet.list_sessions(True, "local"))

        held = await until(held_now, lambda h: "c0" in h, timeout=20.0)  # c0's thread finishes (a fixed 1 s can fall short)
        after = await _code(s.CreateSession(sessions_pb2.CreateSessionRequest(session_id="c2", system_prompt=SYSTEM)))
        print(f"cut short: {cut}; meanwhile: {meanwhile}; held {held}; after: {after}")
        assert cut == "DEADLINE_EXCEEDED" and held == ["c0", "s0"]
        assert meanwhile == after == "RESOURCE_EXHAUSTED"  # before: c1 created too, 3 held against 2
    finally:
        await ch.close()
        await ctl.stop(grace=1)


async def test_an_append_its_client_gave_up_on_still_counts_against_the_kv_quota(
        ray_cluster: None, tmp_path: Path) -> None:
    """NOTE: on a cancel only the history was kept charged; the append's tokens, which its host went on to hold,
    were released, and the tenant's next append passed the KV quota (the review: +78% over it)."""
    from controller.kernel_placement import DEFAULT_SPEC
    from workers.spec import KernelSpec, make_kernel

    k = make_kernel(KernelSpec.from_dict(DEFAULT_SPEC).on_cpu())
    per_token, n = k.block_bytes // k.block_size, 1500
    ctl = await start_controller(f"sqlite:///{tmp_path / 'kvfleet.db'}", None, sessions=SessionLimits(
        max_kv_bytes_per_tenant=per_token * (n + 200), max_history_tokens_per_tenant=0))
    ch = grpc.aio.insecure_channel(ctl.address)
    s = sessions_pb2_grpc.SessionServiceStub(ch)
    ids = [(7 * i) % 200 + 1 for i in range(n)]
    try:
        for sid in ("k0", "k1"):
            await s.CreateSession(sessions_pb2.CreateSessionRequest(session_id=sid, system_prompt="You are k."))
        _slowed(ctl.ctx.kernel_fleet, "append_output", lambda *a: "k0" in a)
        cut = await _code(s.Append(sessions_pb2.AppendRequest(session_id="k0", token_ids=sessions_pb2.TokenIds(ids=ids),
                                                              op_id="big"), timeout=0.2))

        async def held_now() -> dict[str, int]:
            return {r["session"]: r["tokens"] for r in ctl.ctx.kernel_fleet.list_sessions(True, "local")}

        # the host applies it (a fixed 1.5 s wait once fell short on a loaded machine: k0 still held 10 tokens)
        held = await until(held_now, lambda h: h.get("k0", 0) > n, timeout=20.0)
        other = await _code(s.Append(sessions_pb2.AppendRequest(session_id="k1",
                                                                token_ids=sessions_pb2.TokenIds(ids=ids))))
        print(f"cut short: {cut}; held {held}; another {n}-token append: {other}")
        assert cut == "DEADLINE_EXCEEDED"
        assert other == "RESOURCE_EXHAUSTED"  # before: OK, 3,032 tokens held against a quota of 1,700
    finally:
        await ch.close()
        await ctl.stop(grace=1)
