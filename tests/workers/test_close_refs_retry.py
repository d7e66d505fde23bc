"""A close, or a fork, cut off by a store outage half-way through its blob references, then retried, leaves each blob
exactly the references of the sessions that log it: none given back twice (the other sessions' stay), none left over
(the blob is collected once its last session closes). Real Ray, real redis-server killed in the middle."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.workers import SPEC

from fleet.app.redis_server import RedisServer
from fleet.core.errors import NotFound, Unavailable
from workers.fleet import KernelFleet

LATER = 10 * 365 * 86400.0  # every lease has long run out


@pytest.fixture
def rfleet(ray_cluster: None, redis_url: str) -> Iterator[KernelFleet]:
    f = KernelFleet(redis_url, SPEC, call_timeout_s=120.0)
    yield f
    f.shutdown()


def _store_dies_at_drop(store: Any, srv: RedisServer, n: int) -> list[str]:
    """The Redis server is SIGKILLed as the fleet gives back its `n`-th reference (that call then fails on a real
    dead connection); the refs whose drop was asked, in order."""
    drop, asked = store.drop_ref, []

    def dies(ref: str, tenant: str, *holder: str | None) -> None:
        asked.append(ref)
        if len(asked) == n:
            srv.kill()
        drop(ref, tenant, *holder)

    store.drop_ref = dies
    return asked


def test_a_close_cut_off_half_way_and_retried_gives_no_reference_back_twice(
        rfleet: KernelFleet, redis_server: RedisServer, tenant: str) -> None:
    # before: the close gave back r1's reference, died at r2's, kept the log; its retry gave back both again, so r1
    # stood at 0 references while the parent's log held it: GC collected it and the parent never rebuilt again
    store = rfleet.store
    r1, r2 = store.put(b'{"weather": "sunny"}', tenant), store.put(b'{"weather": "rain"}', tenant)
    rfleet.create_session(tenant, "a", "You are agent zero.")
    rfleet.add_tool_result(tenant, "a", r1)
    rfleet.add_tool_result(tenant, "a", r2)
    rfleet.fork(tenant, "a", "b")                                   # both logs hold r1 and r2
    assert [store.stat(r, tenant).refs for r in (r1, r2)] == [2, 2]
    asked = _store_dies_at_drop(store, redis_server, 2)
    with pytest.raises(Unavailable):
        rfleet.close(tenant, "b")
    assert sorted(asked) == sorted([r1, r2])                        # the second given back as Redis died
    del store.drop_ref                                              # the store's own again
    redis_server.start()
    rfleet.close(tenant, "b")                                       # the caller retries
    with pytest.raises(NotFound):
        rfleet.info(tenant, "b")
    # first: r1 at 0 (given back twice). Then the cut-off close deleted b's log first, and the reference to r2 it
    # never gave back stayed for good: [1, 2], r2 never collected. Now the retry gives back what b still holds
    # (the store names each reference's session), and nothing twice
    assert [store.stat(r, tenant).refs for r in (r1, r2)] == [1, 1]
    assert store.gc(now=time.time() + LATER) == 0                   # first: 1 (r1 collected)
    rfleet.release_session(tenant, "a")                             # idle: rebuilt from its log on its next call
    assert len(rfleet.pieces(tenant, "a")) == 3                     # first: NotFound (r1 could not be fetched)
    rfleet.close(tenant, "a")
    assert store.gc(now=time.time() + LATER) == 2                   # then: 1 (r2 kept its reference for good)


def test_a_close_gives_back_each_reference_once(rfleet: KernelFleet, tenant: str) -> None:
    # the control: the same close, uncut, leaves exactly the parent's references, and closing it frees the blobs
    store = rfleet.store
    r1, r2 = store.put(b'{"weather": "sunny"}', tenant), store.put(b'{"weather": "rain"}', tenant)
    rfleet.create_session(tenant, "a", "You are agent zero.")
    rfleet.add_tool_result(tenant, "a", r1)
    rfleet.add_tool_result(tenant, "a", r2)
    rfleet.fork(tenant, "a", "b")
    rfleet.close(tenant, "b")
    assert [store.stat(r, tenant).refs for r in (r1, r2)] == [1, 1]
    rfleet.close(tenant, "a")
    assert [store.stat(r, tenant).refs for r in (r1, r2)] == [0, 0]
    assert store.gc(now=time.time() + LATER) == 2


def test_a_fork_cut_off_half_way_through_its_references_takes_none_from_its_parent(
        rfleet: KernelFleet, redis_server: RedisServer, tenant: str) -> None:
    # before: the fork wrote the child's log, took r1's reference and died at r2's; the cleanup (the retried fork's
    # claim of the name) gave back a reference for every tool result of that log, r2's too, which it never took:
    # the parent's r2 stood at 0 references once the child closed, and GC collected it under the parent
    import ray
    import ray.cloudpickle
    import support.faults

    ray.cloudpickle.register_pickle_by_value(support.faults)  # the host's process cannot import tests/support
    store = rfleet.store
    r1, r2 = store.put(b'{"weather": "sunny"}', tenant), store.put(b'{"weather": "rain"}', tenant)
    rfleet.create_session(tenant, "a", "You are agent zero.")
    rfleet.add_tool_result(tenant, "a", r1)
    rfleet.add_tool_result(tenant, "a", r2)
    host = rfleet.hosts[rfleet.registry.get(tenant, "a").node]
    assert redis_server.proc is not None
    ray.get(host.__ray_call__.remote(support.faults.host_store_dies_at_add_ref, redis_server.proc.pid, 2))
    with pytest.raises(Unavailable):
        rfleet.fork(tenant, "a", "b")
    redis_server.kill()                                             # reaped (the host's kill left it a zombie)
    redis_server.start()
    rfleet.fork(tenant, "a", "b")                                   # the caller retries: the name's claim cleans up
    rfleet.close(tenant, "b")
    # first: r2 at 0. Then the cut-off fork's reference on r1, which it could not give back (the store was down),
    # stayed for good: [2, 1], r1 never collected. Now it is b's: the retried fork takes it again as b's (nothing
    # more), and b's close gives it back
    assert [store.stat(r, tenant).refs for r in (r1, r2)] == [1, 1]
    assert store.gc(now=time.time() + LATER) == 0                   # first: 1 (r2 collected)
    rfleet.release_session(tenant, "a")
    assert len(rfleet.pieces(tenant, "a")) == 3                     # first: NotFound (r2 could not be fetched)
    rfleet.close(tenant, "a")
    assert store.gc(now=time.time() + LATER) == 2                   # then: 1 (r1 kept its reference for good)
