"""Store GC as an operation: the leader collects expired blobs on a schedule (and after a restart),
only the leader does, and operators drive pins and GC over gRPC (PinBlob / UnpinBlob / CollectGarbage)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from support.controller import make_tokens, start_controller
from support.waits import wait_until

from controller.main import config_from, parse_args
from controller.store_gc import GcConfig
from fleet.cas import open_store
from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from fleet.sdk import NO_RETRY, FleetClient


def _seed(url: str) -> tuple[str, str]:
    """An expired unreferenced blob, a pinned one, and the op log of a session named like a blob
    key (`x:m:y`, issue #13: it made Redis GC raise for every tenant)."""
    with open_store(url, lease_s=0.0) as s:  # leases run out at once
        gone, kept = s.put(b"expired tool output", "acme"), s.put(b"pinned tool output", "bravo")
        s.pin(kept, "bravo")
        s.oplog_append("acme", "x:m:y", {"op": "append", "tokens": [1, 2]})
    return gone, kept


def _gc_sample(ctl, name: str, labels: dict[str, str] | None = None) -> float:
    return ctl.ctx.metrics.registry.get_sample_value(name, labels or {}) or 0.0


async def test_leader_collects_expired_blobs_on_its_schedule(url: str, tmp_path: Path) -> None:
    gone, kept = _seed(url)
    ctl = await start_controller(url, make_tokens(tmp_path), gc_interval_s=0.1)
    try:
        await wait_until(lambda: _gc_sample(ctl, "kvfleet_store_gc_runs_total", {"outcome": "ok"}) >= 2, "two gc runs")
        store = ctl.ctx.store
        assert not store.exists(gone, "acme") and store.exists(kept, "bravo")
        assert store.oplog_read("acme", "x:m:y") == [{"op": "append", "tokens": [1, 2]}]
        assert _gc_sample(ctl, "kvfleet_store_gc_collected_blobs_total") == 1.0
        assert _gc_sample(ctl, "kvfleet_store_gc_runs_total", {"outcome": "error"}) == 0.0
        assert _gc_sample(ctl, "kvfleet_store_gc_last_success_timestamp_seconds") > 0
    finally:
        await ctl.stop(0)
    assert not ctl.ctx.store_gc.running


async def test_only_the_leader_collects(redis_url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    leader = await start_controller(redis_url, tok, leader_election=True, leader_ttl_s=5.0, gc_interval_s=0.05)
    await wait_until(lambda: leader.ctx.leader, "the first controller leads")
    standby = await start_controller(redis_url, tok, leader_election=True, leader_ttl_s=5.0, gc_interval_s=0.05)
    try:
        runs = _gc_sample(leader, "kvfleet_store_gc_runs_total", {"outcome": "ok"})
        await wait_until(lambda: _gc_sample(leader, "kvfleet_store_gc_runs_total", {"outcome": "ok"}) >= runs + 3,
                     "the leader keeps collecting")
        assert not standby.ctx.leader and not standby.ctx.store_gc.running
        assert _gc_sample(standby, "kvfleet_store_gc_runs_total", {"outcome": "ok"}) == 0.0
    finally:
        await standby.stop(0)
        await leader.stop(0)


async def test_pin_unpin_and_collect_over_grpc(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    gone, kept = _seed(url)
    ctl = await start_controller(url, tok, gc_interval_s=0)  # no schedule: the RPC alone collects
    try:
        await asyncio.to_thread(_pins_and_gc, ctl.address, tok, gone, kept)
        assert _gc_sample(ctl, "kvfleet_store_gc_collected_blobs_total") == 1.0
    finally:
        await ctl.stop(0)


def _pins_and_gc(address: str, tok, gone: str, kept: str) -> None:
    with FleetClient(address, token=tok.a, retry=NO_RETRY) as a, \
         FleetClient(address, token=tok.b, retry=NO_RETRY) as b, \
         FleetClient(address, token=tok.op, retry=NO_RETRY) as op:
        assert a.pin_blob(gone).pins == 1                       # acme pins its expired blob: it survives
        assert op.collect_garbage() == 0 and a.stat_blob(gone).pins == 1
        assert op.pin_blob(gone, tenant="acme").pins == 2       # an operator pins another tenant's blob
        with pytest.raises(NotFound) as other:                  # a tenant cannot, nor tell it exists
            b.pin_blob(gone, tenant="acme")
        never = hashlib.sha256(b"never stored").hexdigest()
        with pytest.raises(NotFound) as missing:                # bravo's own missing blob: the same answer
            b.pin_blob(never)
        assert str(other.value).replace(gone, "<ref>") == str(missing.value).replace(never, "<ref>")
        with pytest.raises(PermissionDenied, match="operator role"):
            a.collect_garbage()
        with pytest.raises(InvalidArgument, match="malformed ref"):
            a.pin_blob("not-a-ref")
        assert a.unpin_blob(gone).pins == 1 and op.unpin_blob(gone, tenant="acme").pins == 0
        with pytest.raises(FailedPrecondition, match="pins is already 0"):
            a.unpin_blob(gone)
        assert op.collect_garbage() == 1                        # unpinned, lease run out: collected
        with pytest.raises(NotFound):
            a.stat_blob(gone)
        assert b.stat_blob(kept).pins == 1                      # bravo's pinned blob stays


def test_gc_interval_flag() -> None:
    args = parse_args(["--gc-interval", "30"], {})
    assert config_from(args, {}).gc_interval_s == 30.0
    assert config_from(parse_args([], {}), {}).gc_interval_s == GcConfig().interval_s
    assert config_from(parse_args([], {"KVFLEET_GC_INTERVAL": "0"}), {}).gc_interval_s == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(InvalidArgument, match="--gc-interval"):
            config_from(parse_args(["--gc-interval", bad], {}), {})


def test_a_bad_gc_interval_env_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """KVFLEET_GC_INTERVAL=abc is argparse's usage error naming the flag (before: a ValueError
    traceback out of parse_args)."""
    with pytest.raises(SystemExit) as exit_:
        parse_args([], {"KVFLEET_GC_INTERVAL": "abc"})
    assert exit_.value.code == 2 and "--gc-interval: invalid float value: 'abc'" in capsys.readouterr().err


def test_kvfleet_up_takes_gc_interval() -> None:
    """`kvfleet up --gc-interval` reaches the stack's ControllerConfig; a bad one is refused, naming it."""
    from controller.config import ControllerConfig
    from fleet.app.cli.up import controller_overrides
    from fleet.app.cli.up import parse as up_parse

    def cfg(argv: list[str]) -> ControllerConfig:
        return ControllerConfig(listen="127.0.0.1:0", store_url="sqlite:///unused.db",
                                **controller_overrides(up_parse(argv)))

    assert cfg(["--gc-interval", "7.5"]).gc_interval_s == 7.5
    assert cfg(["--gc-interval", "0"]).gc_interval_s == 0.0
    assert cfg([]).gc_interval_s == GcConfig().interval_s
    for bad in ("-1", "nan"):
        with pytest.raises(InvalidArgument, match="--gc-interval"):
            controller_overrides(up_parse(["--gc-interval", bad]))


async def test_gc_prunes_quarantine_records_past_their_ttl(url: str) -> None:
    """A GC run prunes the "recent quarantines" records no request carried for record_ttl_s, and any
    record that cannot be read (it would fail every ListQuarantines); fresh records and verdicts stay. Records of
    the layout before (every tenant's in one namespace) are pruned alike, and the fresh one moves to its tenant's."""
    import json
    import time

    from controller.metrics import Metrics
    from controller.quarantine_records import SEEN_NS, TENANTS_NS, seen_ns
    from controller.store_gc import StoreGc
    from controller.verdicts import OPERATOR_NS

    now = time.time()
    with open_store(url) as s:
        rec = {"tenant": "acme", "reasons": ["x"], "source": "detector", "action": "refuse", "num_seen": 1}
        s.kv_put(TENANTS_NS, "acme", b"")
        for ns, key in ((seen_ns("acme"), ""), (SEEN_NS, "acme/")):
            s.kv_put(ns, key + "a" * 64, json.dumps({**rec, "ref": "a" * 64, "first_seen": now - 100,
                                                     "last_seen": now - 100}).encode())
            s.kv_put(ns, key + "damaged", b"{not json")
        s.kv_put(seen_ns("acme"), "b" * 64, json.dumps({**rec, "ref": "b" * 64, "first_seen": now - 5,
                                                        "last_seen": now - 5}).encode())
        s.kv_put(SEEN_NS, "acme/" + "c" * 64, json.dumps({**rec, "ref": "c" * 64, "first_seen": now - 5,
                                                          "last_seen": now - 5}).encode())
        s.kv_put(OPERATOR_NS, "a" * 64, json.dumps({"verdict": "QUARANTINED", "reasons": ["op"]}).encode())
        gc = StoreGc(s, Metrics(), GcConfig(0), record_ttl_s=60.0)
        await gc.run_once()
        assert sorted(s.kv_scan(seen_ns("acme"))) == ["b" * 64, "c" * 64]  # the old ones and the damaged ones went
        assert s.kv_scan(SEEN_NS) == {}                                    # the fresh one of the layout before moved
        assert s.kv_get(OPERATOR_NS, "a" * 64) is not None            # the verdict itself stays
        # control: a TTL longer than the record's age keeps it
        await StoreGc(s, Metrics(), GcConfig(0), record_ttl_s=3600.0).run_once()
        assert sorted(s.kv_scan(seen_ns("acme"))) == ["b" * 64, "c" * 64]
