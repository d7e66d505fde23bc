"""The operator's ListSessions refuses a tenant name no tenant can have, naming the field and the rule.

Found beside scripts/fuzz_grpc.py's ListQuarantines finding: the name only filtered the registry's records, so an
operator listing 'a b' or 'a/b' got an empty listing, as for a tenant without sessions (every kernel node was asked for
its rows of it too).

Real parts: a controller on loopback gRPC over the shared local Ray cluster, a SQLite store.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from support.controller import make_tokens, md, start_controller

from fleet.api.kvfleet.v1 import sessions_pb2 as pb
from fleet.api.kvfleet.v1.sessions_pb2_grpc import SessionServiceStub


async def test_an_operators_listing_refuses_a_tenant_name_no_tenant_can_have(ray_cluster: None, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(f"sqlite:///{tmp_path / 'kvfleet.db'}", tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = SessionServiceStub(ch)
            await stub.CreateSession(pb.CreateSessionRequest(session_id="s1", system_prompt="You are terse."),
                                     metadata=md(tok.a))
            for bad in ("a b", "a/b", "x" * 65, "acme\n"):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.ListSessions(pb.ListSessionsRequest(tenant=bad), metadata=md(tok.op))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, e.value.details())
                assert "invalid tenant" in e.value.details() and "1-64 characters" in e.value.details(), \
                    (bad, e.value.details())
            # the control: a tenant's name lists its sessions
            named = await stub.ListSessions(pb.ListSessionsRequest(tenant="acme"), metadata=md(tok.op))
            assert [(r.tenant, r.session_id) for r in named.sessions] == [("acme", "s1")]
    finally:
        await ctl.stop(0)
