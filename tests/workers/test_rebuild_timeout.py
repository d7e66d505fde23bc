"""A rebuild whose call times out (a replay longer than call_timeout_s) settles: the host finishes the
replay it started and later calls of the same loss join it, or find it done, instead of starting the
whole replay over on every call (which, with a replay longer than the timeout, never ended).

Counts, not times: the host's replays (its `stats()["replays"]`), the session kernel kept (its
`last_active`, stamped when a host opens it), the record's state and epoch, digests."""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray
from support.workers import host_of

from fleet.core.errors import Unavailable
from workers.fleet import KernelFleet

SYSTEM = "You are agent zero. Answer briefly."
IDS = [(i * 7 + 300) % 512 for i in range(4000)]


def _history(f: KernelFleet, tenant: str, sid: str, cycles: int, mode: str = "exact") -> None:
    """A long log that leaves a short session: `cycles` x (append 4,000 ids, then a 1-id output, then
    evict the 4,000 ids with `mode`). A reposition eviction with survivors leaves KV that is not a
    function of the tokens, so such a log is replayed op by op: all 4,000 x `cycles` ids again."""
    f.create_session(tenant, sid, SYSTEM)
    for i in range(cycles):
        piece = f.append_output(tenant, sid, IDS).result.piece_id
        f.append_output(tenant, sid, [i % 512])
        f.evict(tenant, sid, piece, mode=mode)
    f.append(tenant, sid, " and then?")


@pytest.mark.slow
def test_a_regeneration_computes_what_the_session_holds_not_its_history(kfleet: KernelFleet, tenant: str) -> None:
    """A released session's next call replays its log's ledger and computes its final tokens once:
    24,000 ids appended and evicted exactly are not computed again. Control: the same history with
    reposition evictions, which a regeneration must replay op by op, computes them all."""
    for sid, mode in (("exact", "exact"), ("repo", "reposition")):
        _history(kfleet, tenant, sid, cycles=6, mode=mode)
    digests = {sid: kfleet.digest(tenant, sid) for sid in ("exact", "repo")}
    held = {sid: kfleet.info(tenant, sid)["tokens"] for sid in ("exact", "repo")}
    for sid in ("exact", "repo"):
        kfleet.release_session(tenant, sid)                   # the idle reaper: the next call regenerates
    info = {sid: kfleet.info(tenant, sid) for sid in ("exact", "repo")}
    print(f"held {held}; computed by the regeneration: "
          f"{ {sid: row['prefilled_tokens'] for sid, row in info.items()} }")
    assert {sid: kfleet.digest(tenant, sid) for sid in ("exact", "repo")} == digests
    assert info["exact"]["prefilled_tokens"] == held["exact"]     # NOTE: before, 24,000 + what it holds
    assert info["repo"]["prefilled_tokens"] > 6 * len(IDS)        # control: op by op, every id again
    assert info["exact"]["replayed_ops"] == info["repo"]["replayed_ops"] == 2 + 3 * 6


def _replays(f: KernelFleet, node: str) -> int:
    return int(ray.get(host_of(f.store_url, node).stats.remote(), timeout=60).get("replays", -1))


def _gave_up(f: KernelFleet, tenant: str, sid: str) -> dict[str, Any]:
    """What a rebuild whose call timed out leaves: the record lost (one epoch up), and the host, which
    went on replaying after its caller stopped waiting, holding the session rebuilt at that epoch.
    Returns the host's row of it."""
    rec = f.registry.get(tenant, sid)
    assert rec is not None
    rec.lose()
    f.registry.save(rec)
    row: dict[str, Any] = ray.get(host_of(f.store_url, rec.node).regenerate.remote(tenant, sid, rec.epoch),
                                  timeout=120)
    assert row["epoch"] == rec.epoch
    return row


def test_a_rebuild_its_caller_gave_up_on_is_joined_not_started_over(kfleet: KernelFleet, tenant: str) -> None:
    _history(kfleet, tenant, "s", cycles=2)
    digest = kfleet.digest(tenant, "s")
    node = kfleet.registry.get(tenant, "s").node              # type: ignore[union-attr]
    kfleet.release_session(tenant, "s")                       # the idle reaper
    row = _gave_up(kfleet, tenant, "s")
    info = kfleet.info(tenant, "s")                           # the next call
    print(f"a rebuild finished after its caller gave up; the next call kept its kernel: "
          f"{info['last_active'] == row['last_active']}; host replays {_replays(kfleet, node)}")
    assert info["last_active"] == row["last_active"]          # NOTE: before, it replayed the whole log again
    assert _replays(kfleet, node) == 1
    rec = kfleet.registry.get(tenant, "s")
    assert rec is not None and (rec.state, rec.epoch, rec.regenerated) == ("regenerated", 1, 1)
    assert kfleet.digest(tenant, "s") == digest and kfleet.num_regenerations == 1
    # reconcile settles a lost record whose host holds it rebuilt (before: skipped, left lost)
    row = _gave_up(kfleet, tenant, "s")                       # a second loss, epoch 2
    assert kfleet.reconcile() == 1
    rec = kfleet.registry.get(tenant, "s")
    assert rec is not None and (rec.state, rec.epoch, rec.regenerated) == ("regenerated", 2, 2)
    assert _replays(kfleet, node) == 2 and kfleet.info(tenant, "s")["last_active"] == row["last_active"]
    # control: a later loss (another epoch), with no rebuild of it under way, is a replay of its own
    kfleet.release_session(tenant, "s")
    assert kfleet.digest(tenant, "s") == digest
    assert _replays(kfleet, node) == 3 and kfleet.info(tenant, "s")["last_active"] != row["last_active"]
    rec = kfleet.registry.get(tenant, "s")
    assert rec is not None and (rec.state, rec.epoch) == ("regenerated", 3)


@pytest.mark.slow
def test_a_replay_longer_than_the_call_timeout_settles(kfleet: KernelFleet, tenant: str) -> None:
    """The auditor's case end to end: a session released, then called with a call timeout far below
    its replay. Every call that times out used to start another full replay (the record stayed
    lost); now the first one's replay runs to its end, the calls that follow join it, and the
    session is usable again after one replay."""
    _history(kfleet, tenant, "slow", cycles=12, mode="reposition")  # ~48,000 ids replayed, 57 tokens held
    digest = kfleet.digest(tenant, "slow")
    node = kfleet.registry.get(tenant, "slow").node           # type: ignore[union-attr]
    kfleet.release_session(tenant, "slow")
    kfleet.nodes.call_timeout_s = kfleet.call_timeout_s = 0.5
    timeouts, answer, said = 0, None, []
    deadline = time.monotonic() + 120                         # a bound on the loop, not a measurement
    while answer is None and time.monotonic() < deadline:
        try:
            answer = kfleet.digest(tenant, "slow")
        except Unavailable as e:
            timeouts += 1
            said.append(str(e))
            time.sleep(0.5)
    kfleet.nodes.call_timeout_s = kfleet.call_timeout_s = 120.0
    rec = kfleet.registry.get(tenant, "slow")
    print(f"calls timed out before the rebuild settled: {timeouts}; host replays: {_replays(kfleet, node)}; "
          f"record {rec.state if rec else None} at epoch {rec.epoch if rec else None}")
    assert timeouts >= 1                                      # control: the replay outlasted a call
    # NOTE: the caller was told "a worker did not answer within 0s": not which session, nor that a retry joins it
    assert "session 'slow'" in said[0] and "retry the call" in said[0], said[0]
    assert answer == digest                                   # NOTE: before, every call timed out, forever
    assert _replays(kfleet, node) == 1
    assert rec is not None and (rec.state, rec.epoch, rec.regenerated) == ("regenerated", 1, 1)
