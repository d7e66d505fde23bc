"""An op id is one call's: a retry of it is answered (replayed), a different call under it is refused
(ALREADY_EXISTS), by the kernel host and, at the tenant's quota, by the controller itself (`_logged`).

Real parts only: a controller on loopback gRPC over the shared local Ray cluster, a SQLite store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.controller import start_controller

from controller.quotas import SessionLimits
from fleet.cas import open_store
from fleet.core.errors import AlreadyExists, ResourceExhausted
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import call_fingerprint
from fleet.sdk import AsyncFleetClient
from workers.spec import KernelSpec, make_kernel

SYSTEM = "You are agent zero. Answer briefly."   # 35 tokens (byte tokenizer)
REUSED = "op_id 'X' was already used for a different call"


def _servicer(ctl: Any) -> Any:
    """The controller's session service (controller/sessions.py)."""
    from controller.sessions import Sessions

    return next(h.__self__ for h in ctl.ctx.on_stop if isinstance(getattr(h, "__self__", None), Sessions))


def _bytes_per_token() -> int:
    k = make_kernel(KernelSpec(block_size=16))
    return int(k.block_bytes // k.block_size)


async def test_an_op_id_reused_for_another_call_is_refused_below_and_at_the_quota(
        ray_cluster: None, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kvfleet.db'}"
    limits = SessionLimits(max_kv_bytes_per_tenant=44 * _bytes_per_token(), idle_ttl_s=0)
    ctl = await start_controller(url, None, sessions=limits)
    c = AsyncFleetClient(ctl.address)
    try:
        await c.create_session("s1", SYSTEM)
        first = await c.append("s1", " hello", op_id="X")             # 41 of 44
        # below the quota, the host refuses them (before: OK, replayed=True, and the generate answered the
        # message's 6 ids as its output)
        with pytest.raises(AlreadyExists, match=REUSED):
            await c.append("s1", "hi!", op_id="X")
        with pytest.raises(AlreadyExists, match=REUSED):
            await c.generate("s1", 2, op_id="X")
        ids = await c.generate("s1", 3, op_id="g1")                   # 44 of 44: full
        with pytest.raises(ResourceExhausted):
            await c.append("s1", [5], op_id="new")                     # control: the quota is spent
        # at the quota, the controller answers a retry from the log (`_logged`) and refuses another call
        again = await c.append("s1", " hello", op_id="X")
        assert (again.replayed, again.piece, again.op_index) == (True, first.piece, first.op_index)
        assert await c.generate("s1", 3, op_id="g1") == ids
        with pytest.raises(AlreadyExists, match=REUSED):
            await c.append("s1", "hi!", op_id="X")                    # before: OK, replayed=True
        with pytest.raises(AlreadyExists, match="op_id 'g1' was already used for a different call"):
            await c.generate("s1", 2, op_id="g1")
        sessions = _servicer(ctl)                                     # its own check, as the host's
        assert await sessions._run("local", sessions._logged, "local", "s1", "X",
                                   call_fingerprint("append_message", encode_message(sessions.fleet.tokenizer, "user", " hello"),
                                                    "user"))
        with pytest.raises(AlreadyExists, match=REUSED):
            await sessions._run("local", sessions._logged, "local", "s1", "X", call_fingerprint("generate", 2))
        assert not await sessions._run("local", sessions._logged, "local", "s1", "Y", call_fingerprint("generate", 2))
        log = open_store(url).oplog_read("local", "s1")
        assert [op.get("op_id") for op in log][1:] == ["X", "g1"]
        assert (await c.get_session("s1")).row.num_tokens == 44
    finally:
        await c.close()
        await ctl.stop(grace=1)
