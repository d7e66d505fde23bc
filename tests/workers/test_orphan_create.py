"""A create or fork whose host call timed out, and that the host ran after the fleet gave up on it, leaves a kernel
no record names (an orphan): the fleet's cleanup (close by the try's op id, its log, its record) ran before the
host opened the kernel, as when the host was still loading its weights past the call timeout (close does not wait
for the load). A later create or fork of the same name on that host replaces the orphan (its kernel and its log)
instead of being refused, because the registry names the later try, not the orphan. A session the registry names
is never replaced (the control).

The timeout is made by hand (the call under test raises Unavailable, as nodes.call does past its timeout, before
the host is asked) and the host then runs the call itself: a real host, a real registry, the fleet's own cleanup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import ray
from support.workers import SPEC, host_of

from fleet.core.errors import AlreadyExists, Unavailable
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import parse_log
from workers.fleet import KernelFleet


def _late(f: KernelFleet, verb: str) -> Any:
    """Make the next `verb` call to a host time out before the host runs it; returns a function that runs it on
    the host then (the late arrival) and gives the fleet its calls back."""
    real, box = f.nodes.call, {}

    def timed_out(node: str, method: str, *args: Any) -> Any:
        if method == verb and not box:
            box["call"] = (node, args)
            raise Unavailable(f"a worker did not answer within {f.call_timeout_s:.0f}s")
        return real(node, method, *args)

    def arrive() -> Any:
        f.nodes.call = real  # type: ignore[method-assign]
        node, args = box["call"]
        return ray.get(getattr(host_of(f.store_url, node), verb).remote(*args), timeout=120)

    f.nodes.call = timed_out  # type: ignore[method-assign]
    return arrive


def _ops(f: KernelFleet, tenant: str, sid: str) -> list[tuple[str, str]]:
    return [(type(o).__name__, o.op_id) for o in parse_log(f.store.oplog_read(tenant, sid))]


def _held(f: KernelFleet, tenant: str) -> list[str]:
    [node] = f.hosts
    return sorted(r["session"] for r in ray.get(host_of(f.store_url, node).rows.remote(tenant), timeout=60))


@pytest.mark.parametrize("verb", ["create_session", "fork"])
def test_a_name_a_timed_out_try_left_a_kernel_under_is_not_blocked(kfleet: KernelFleet, tenant: str,
                                                                   verb: str) -> None:
    """NOTE: before, the host refused the later try (AlreadyExists: it held a kernel of that name) until it
    restarted, though no record named that kernel."""
    f = kfleet
    f.create_session(tenant, "p", "You are the parent.")
    arrive = _late(f, verb)
    with pytest.raises(Unavailable):
        f.fork(tenant, "p", "s") if verb == "fork" else f.create_session(tenant, "s", "You are agent one.")
    arrive()                                                 # the host runs the try after the fleet gave up on it
    orphan = _ops(f, tenant, "s")
    assert f.registry.get(tenant, "s") is None and "s" in _held(f, tenant) and orphan   # control: an orphan
    row = f.fork(tenant, "p", "s") if verb == "fork" else f.create_session(tenant, "s", "You are agent two.")
    ops = _ops(f, tenant, "s")
    print(f"{verb}: orphan's log {orphan}; the later try's log {ops}; held {_held(f, tenant)}")
    assert row["state"] == "active" and ops[-1][1] == row["create_op_id"] != orphan[-1][1]
    assert len(ops) == len(orphan) and _held(f, tenant) == ["p", "s"]
    want = f.tokens(tenant, "p") if verb == "fork" else encode_message(f.tokenizer, "system", "You are agent two.")
    assert f.tokens(tenant, "s") == want


def test_a_create_never_replaces_a_session_the_registry_names(kfleet: KernelFleet, tenant: str) -> None:
    """The control: a create with another op id reaching the host of an acknowledged session (one the fleet's
    claim would refuse; here sent to the host directly) is refused, and the session stays whole."""
    f = kfleet
    f.create_session(tenant, "s", "You are agent one.")
    tokens, ops = f.tokens(tenant, "s"), _ops(f, tenant, "s")
    [node] = f.hosts
    with pytest.raises(AlreadyExists):
        ray.get(host_of(f.store_url, node).create_session.remote(tenant, "s", [1, 2, 3], "another-op"), timeout=120)
    assert f.tokens(tenant, "s") == tokens and _ops(f, tenant, "s") == ops and _held(f, tenant) == ["s"]


def test_a_full_host_closes_an_orphan_no_later_try_replaced(ray_cluster: None, tmp_path: Path, tenant: str) -> None:
    """An orphan whose name is never created again held its slot until the host restarted: a full host is skipped by
    placement, so a create of another name found no room (ResourceExhausted). Now a full host asked for room reads
    its sessions' records and closes the kernels no record names (the control: the session with a record stays)."""
    f = KernelFleet(f"sqlite:///{tmp_path / 'full.db'}", SPEC, call_timeout_s=120.0, node_max_sessions=2)
    try:
        f.create_session(tenant, "p", "You are the parent.")
        arrive = _late(f, "create_session")
        with pytest.raises(Unavailable):
            f.create_session(tenant, "s", "You are agent one.")
        arrive()
        assert f.registry.get(tenant, "s") is None and _held(f, tenant) == ["p", "s"]  # full, one slot an orphan's
        row = f.create_session(tenant, "q", "You are agent two.")   # NOTE: before, ResourceExhausted
        assert row["state"] == "active" and _held(f, tenant) == ["p", "q"]
        assert not _ops(f, tenant, "s")  # the orphan's log went with it
        assert f.tokens(tenant, "p") == encode_message(f.tokenizer, "system", "You are the parent.")
    finally:
        f.shutdown()
