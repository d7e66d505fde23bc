"""A tenant's session history is bounded (--max-history-tokens-per-tenant): a session's op log keeps
every piece it appended, evicted ones included, so appending and evicting kept its KV small while its
log, its host's ledger and the store grew without end. Each append is charged its tokens plus 16 (its
op); a fork is charged its parent's history again (its log starts with a copy); closing frees it.

Real parts: a controller on loopback gRPC over the shared local Ray cluster, a SQLite store.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.controller import make_tokens, start_controller

from controller.quotas import SessionLimits
from fleet.cas import open_store
from fleet.core.errors import ResourceExhausted
from fleet.core.oplog import HISTORY_OP_CHARGE
from fleet.sdk import AsyncFleetClient

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
