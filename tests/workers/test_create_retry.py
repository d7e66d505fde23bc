"""A CreateSession tried again after its host died (nodes.call retries it on the restarted host; the
fleet retries a NodeGone on a survivor) logs the system prompt once: the retry carries the first try's
op id, and the host drops the log that try left instead of logging the prompt a second time (the
doubled log regenerated a session of twice the tokens, or none at all past the context)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import ray
from support.workers import host_of, kill_host

from fleet.core.errors import AlreadyExists
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import num_tokens, parse_log
from workers.fleet import KernelFleet, NodeGone


def _prompt(n: int) -> str:
    return "".join(chr(97 + (i * 7) % 26) for i in range(n))


def _system_ops(f: KernelFleet, tenant: str, sid: str) -> list[tuple[str, str, int | None]]:
    return [(o.kind, o.op_id, o.length) for o in parse_log(f.store.oplog_read(tenant, sid))]  # type: ignore[union-attr]


def test_a_create_retried_on_the_restarted_host_logs_its_prompt_once(kfleet: KernelFleet, tenant: str) -> None:
    """The retry nodes.call makes, made by hand: the same create (same op id) on the restarted host,
    whose first try logged the system op before the host died."""
    kfleet.create_session(tenant, "warm", "hi")
    [node] = kfleet.hosts
    host = host_of(kfleet.store_url, node)
    tokens = encode_message(kfleet.tokenizer, "system", _prompt(300))
    ray.get(host.create_session.remote(tenant, "s1", tokens, "create-1"), timeout=120)
    digest = ray.get(host.call.remote(tenant, "s1", "digest"), timeout=60)
    kill_host(kfleet.store_url, node)                         # died before the fleet had its answer
    ray.get(host.create_session.remote(tenant, "s1", tokens, "create-1"), timeout=120)   # the retry
    ops = _system_ops(kfleet, tenant, "s1")
    print(f"op log after the retried create: {ops}")
    assert ops == [("system", "create-1", 300)]              # NOTE: before, the system op twice
    assert ray.get(host.call.remote(tenant, "s1", "digest"), timeout=60) == digest
    row = ray.get(host.regenerate.remote(tenant, "s1", 1), timeout=120)
    assert row["tokens"] == 300 and ray.get(host.call.remote(tenant, "s1", "digest"), timeout=60) == digest
    # control: another create's log (another op id) is never dropped nor added to
    kill_host(kfleet.store_url, node)
    with pytest.raises(AlreadyExists, match="op log"):
        ray.get(host.create_session.remote(tenant, "s1", tokens, "create-2"), timeout=120)
    assert _system_ops(kfleet, tenant, "s1") == [("system", "create-1", 300)]


def test_a_host_killed_while_it_prefills_a_new_session_logs_the_prompt_once(kfleet: KernelFleet,
                                                                          tenant: str) -> None:
    """The auditor's case end to end: the host is killed once the system op is logged, while the
    prompt's prefill runs; nodes.call retries the create on the restarted host."""
    kfleet.create_session(tenant, "warm", "hi")              # host up, kernel loaded
    [node] = kfleet.hosts
    host = host_of(kfleet.store_url, node)
    prompt = _prompt(6000)                                    # twice that is past the 8,192-token context
    for attempt in range(3):
        sid = f"s{attempt}"
        killed: list[int] = []

        def killer(sid: str = sid, killed: list[int] = killed) -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if kfleet.store.oplog_read(tenant, sid):     # write-ahead: logged, prefill under way
                    ray.kill(host, no_restart=False)
                    killed.append(1)
                    return
                time.sleep(0.005)

        th = threading.Thread(target=killer)
        th.start()
        kfleet.create_session(tenant, sid, prompt)
        th.join(60)
        assert killed
        before = kfleet.num_regenerations
        info = kfleet.info(tenant, sid)
        if kfleet.num_regenerations == before:               # the kill landed during the create: retried
            break
    else:
        pytest.fail("the host was killed after the create each time (3 tries), never during its prefill")
    ops = _system_ops(kfleet, tenant, sid)
    print(f"killed during the create's prefill; op log: {[(k, i[:8], n) for k, i, n in ops]}")
    assert len(ops) == 1 and ops[0][0] == "system" and ops[0][2] == 6000   # NOTE: before, twice (12,000 tokens)
    assert info["tokens"] == 6000
    digest = kfleet.digest(tenant, sid)
    kfleet.release_session(tenant, sid)                      # the idle reaper: the next call regenerates
    assert kfleet.digest(tenant, sid) == digest and kfleet.info(tenant, sid)["tokens"] == 6000
    [row] = [r for r in kfleet.list_sessions(tenant=tenant) if r["session"] == sid]
    assert (row["state"], row["epoch"]) == ("regenerated", 1)


def test_a_create_retried_on_a_survivor_after_node_gone_logs_its_prompt_once(
        kfleet: KernelFleet, tenant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """KernelFleet's own retry: the host logged the system op, then its node 'left' (NodeGone); the
    create goes to a survivor (here the same node: a one-node cluster) with the same op id."""
    kfleet.create_session(tenant, "warm", "hi")
    [node] = kfleet.hosts
    real_call, real_place = kfleet.nodes.call, kfleet.nodes.place
    tries: list[str] = []

    def call(n: str, method: str, *args: Any) -> Any:
        out = real_call(n, method, *args)
        if method == "create_session":
            tries.append(args[-1])
            if len(tries) == 1:                               # logged and built, then its node is gone
                real_call(n, "close", args[0], args[1])       # (the kernel goes with it; the log stays)
                raise NodeGone(f"node {n} has left the cluster")
        return out

    monkeypatch.setattr(kfleet.nodes, "call", call)
    monkeypatch.setattr(kfleet.nodes, "place", lambda t, tok, exclude="", **_: node if exclude else real_place(t, tok))
    row = kfleet.create_session(tenant, "s1", _prompt(300))
    ops = _system_ops(kfleet, tenant, "s1")
    print(f"create tried {len(tries)} times (op ids equal: {len(set(tries)) == 1}); op log: {ops}")
    assert len(tries) == 2 and row["state"] == "active"
    assert [(k, n) for k, _, n in ops] == [("system", 300)]  # NOTE: before, twice, under two op ids
    assert num_tokens(parse_log(kfleet.store.oplog_read(tenant, "s1"))) == kfleet.info(tenant, "s1")["tokens"] == 300
