"""Calls that change what stands behind one session name, overlapping: creates and forks of one name, a close
during a rebuild. In one fleet (threads of the Python API) and in two fleets on one store and one set of hosts
(two controllers overlapping during a leader change). Whatever the interleaving, the session that was
acknowledged is whole (its record, its host's kernel, its op log agree), the loser is refused, and a closed
session stays closed.

Each interleaving is forced: the first call of a verb to the hosts runs the other call (in another thread)
before it goes on, or once it returned, and goes on when that call has finished or waits for this fleet's
lock of the name (it then cannot go on before this one does)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from support.workers import SPEC, host_of, kill_host

from fleet.core.errors import AlreadyExists, NotFound
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import ForkOp, parse_log
from workers.fleet import KernelFleet

PARENT = "You are agent zero. Answer briefly."
PROMPT = "You are agent one, a different agent."


@pytest.fixture
def other(kfleet: KernelFleet) -> Iterator[KernelFleet]:
    """A second controller's fleet: the same store and the same kernel hosts (found by name)."""
    f = KernelFleet(kfleet.store_url, SPEC, call_timeout_s=120.0)
    yield f
    f.release()  # its hosts are the first fleet's, which stops them


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test compares
        return e


def _beside(f: KernelFleet, verb: str, key: tuple[str, str], call: Callable[[], Any], after: bool = False) -> dict[str, Any]:
    """Make `f`'s first host call of `verb` run `call` in another thread first (after=True: once the host
    answered); it goes on once `call` finished or waits for `f`'s lock of `key`. Returns `call`'s outcome
    (under "out") once it is known."""
    real, box, fired = f.nodes.call, {}, threading.Event()

    def run_other() -> None:
        th = threading.Thread(target=lambda: box.__setitem__("out", _outcome(call)))
        th.start()
        names = getattr(f, "_names", None)   # the fleet's name locks (none on the code before them)
        while th.is_alive() and not (names is not None and names.num_waiting(key) >= 2):
            th.join(0.01)
        box["thread"] = th

    def hooked(node: str, method: str, *args: Any) -> Any:
        if method != verb or fired.is_set():
            return real(node, method, *args)
        fired.set()
        if not after:
            run_other()
            return real(node, method, *args)
        answer = real(node, method, *args)
        run_other()
        return answer

    f.nodes.call = hooked  # type: ignore[method-assign]
    return box


def _finish(box: dict[str, Any]) -> Any:
    box["thread"].join(120)
    return box["out"]


def _whole(f: KernelFleet, tenant: str, sid: str) -> dict[str, Any]:
    """What stands behind the name: its record, whether its host holds it, its log, and its tokens."""
    rec = f.registry.get(tenant, sid)
    log = parse_log(f.store.oplog_read(tenant, sid))
    held = rec is not None and ray.get(host_of(f.store_url, rec.node).holds.remote(tenant, sid), timeout=60)
    f._where.pop((tenant, sid), None)
    tokens = _outcome(lambda: f.tokens(tenant, sid))
    return {"state": rec.state if rec else None, "op_id": getattr(rec, "create_op_id", None), "held": held,
            "log": [(type(o).__name__, o.op_id) for o in log], "tokens": tokens}


def _brief(now: dict[str, Any]) -> dict[str, Any]:
    return {**now, "tokens": len(now["tokens"]) if isinstance(now["tokens"], list) else now["tokens"]}


def _system(f: KernelFleet, prompt: str) -> list[int]:
    return encode_message(f.tokenizer, "system", prompt)


@pytest.mark.parametrize("first", ["create", "fork"])
def test_a_create_and_a_create_or_fork_of_one_name_in_one_fleet(kfleet: KernelFleet, tenant: str, first: str) -> None:
    """The first call (a create, or a fork) is at its host when a create of the same name comes. NOTE: before,
    the second cleared the first's `creating` record and created the session; the first, refused by the host,
    then discarded the second's acknowledged session (record, kernel, log): NotFound 'no op log' ever after."""
    kfleet.create_session(tenant, "p", PARENT)
    key = (tenant, "s")
    if first == "create":
        box = _beside(kfleet, "create_session", key, lambda: kfleet.create_session(tenant, "s", PROMPT))
        won = _outcome(lambda: kfleet.create_session(tenant, "s", PARENT + " Twice."))
    else:
        box = _beside(kfleet, "fork", key, lambda: kfleet.create_session(tenant, "s", PROMPT))
        won = _outcome(lambda: kfleet.fork(tenant, "p", "s"))
    lost = _finish(box)
    now = _whole(kfleet, tenant, "s")
    print(f"first ({first}): {won!r:.80}; second (create): {lost!r:.80}; behind the name: {_brief(now)}")
    assert isinstance(won, dict) and won["state"] == "active" and isinstance(lost, AlreadyExists)
    assert now["state"] == "active" and now["held"] and now["op_id"] == won["create_op_id"]
    if first == "create":
        assert now["log"] == [("AppendOp", won["create_op_id"])] and now["tokens"] == _system(kfleet, PARENT + " Twice.")
    else:
        assert now["log"][-1] == ("ForkOp", won["create_op_id"]) and now["tokens"] == _system(kfleet, PARENT)


@pytest.mark.parametrize("when", ["before", "after"])
def test_creates_of_one_name_in_two_controllers(kfleet: KernelFleet, other: KernelFleet, tenant: str,
                                                when: str) -> None:
    """A create in one controller reaches its host (`before`: the host has not opened it yet; `after`: it has,
    and the create is not yet acknowledged) when another controller creates the same name, whole (it takes
    the first's `creating` record for a crashed create's, as it must). The second wins; the first is refused
    and removes nothing of the second's. NOTE: before, the first discarded the second's acknowledged session
    (`before`), or wrote its own record over the second's: two creates acknowledged (`after`)."""
    key = (tenant, "s")
    box = _beside(kfleet, "create_session", key, lambda: other.create_session(tenant, "s", PROMPT), after=when == "after")
    first = _outcome(lambda: kfleet.create_session(tenant, "s", PARENT))
    second = _finish(box)
    now = _whole(kfleet, tenant, "s")
    print(f"first: {first!r:.80}; second: {second!r:.80}; behind the name: {_brief(now)}")
    assert isinstance(second, dict) and isinstance(first, AlreadyExists)
    assert now["state"] == "active" and now["held"] and now["op_id"] == second["create_op_id"]
    assert now["log"] == [("AppendOp", second["create_op_id"])] and now["tokens"] == _system(kfleet, PROMPT)


def _lose(f: KernelFleet, tenant: str, sid: str) -> None:
    """The session's host dies (Ray restarts it empty): its next call rebuilds it from its op log."""
    f.create_session(tenant, sid, PARENT)
    f.append(tenant, sid, " and then some.")
    rec = f.registry.get(tenant, sid)
    assert rec is not None
    kill_host(f.store_url, rec.node)


def test_a_close_during_a_rebuild_waits_for_it_and_stays_closed(kfleet: KernelFleet, tenant: str) -> None:
    """A close comes once the host has rebuilt the session and before the rebuild writes its record. NOTE:
    before, the rebuild wrote the closed session's record back: listed lost, with no log and no kernel behind
    it, AlreadyExists to a create of its name, NotFound to its calls."""
    _lose(kfleet, tenant, "s")
    box = _beside(kfleet, "regenerate", (tenant, "s"), lambda: kfleet.close(tenant, "s"), after=True)
    read = _outcome(lambda: kfleet.digest(tenant, "s"))   # the call that rebuilds it
    closed = _finish(box)
    now = _whole(kfleet, tenant, "s")
    print(f"the call that rebuilt it: {read!r:.60}; close: {closed!r}; behind the name: {_brief(now)}")
    assert closed is None and isinstance(read, str | NotFound)   # the call ran before the close, or after it
    assert (now["state"], now["held"], now["log"]) == (None, False, []) and isinstance(now["tokens"], NotFound)
    assert kfleet.create_session(tenant, "s", PROMPT)["state"] == "active"
    assert kfleet.tokens(tenant, "s") == _system(kfleet, PROMPT)


def test_a_close_and_create_in_another_controller_during_a_rebuild(kfleet: KernelFleet, other: KernelFleet,
                                                                   tenant: str) -> None:
    """Another controller closes the session and creates its name anew once the host has rebuilt it, before
    the rebuild writes its record. The rebuild writes nothing over the new session's record and closes only
    the kernel it opened; its call then reads the new session. NOTE: before, the rebuild wrote the old
    session's record (`regenerated`, epoch 1) over the new one's."""
    _lose(kfleet, tenant, "s")

    def close_and_create() -> dict[str, Any]:
        other.close(tenant, "s")
        return other.create_session(tenant, "s", PROMPT)

    box = _beside(kfleet, "regenerate", (tenant, "s"), close_and_create, after=True)
    read = _outcome(lambda: kfleet.tokens(tenant, "s"))   # the call that rebuilds it
    created = _finish(box)
    now = _whole(kfleet, tenant, "s")
    print(f"the call that rebuilt it: {read!r:.60}; created: {created!r:.80}; behind the name: {_brief(now)}")
    assert isinstance(created, dict) and read == _system(kfleet, PROMPT)
    assert (now["state"], now["op_id"], now["held"]) == ("active", created["create_op_id"], True)
    assert now["log"] == [("AppendOp", created["create_op_id"])] and now["tokens"] == _system(kfleet, PROMPT)
    rec = kfleet.registry.get(tenant, "s")
    assert rec is not None and (rec.epoch, rec.regenerated) == (0, 0)


def test_fork_markers_carry_the_fork_op_id(kfleet: KernelFleet, tenant: str) -> None:
    """A fork's log ends with its marker, stamped with the fork's op id (what its cleanup recognises)."""
    kfleet.create_session(tenant, "p", PARENT)
    child = kfleet.fork(tenant, "p", "c")
    [*_, marker] = parse_log(kfleet.store.oplog_read(tenant, "c"))
    assert isinstance(marker, ForkOp) and marker.op_id == child["create_op_id"] and len(marker.op_id) == 32


@pytest.mark.parametrize("lost", [False, True])
def test_a_close_removes_only_the_session_it_read(kfleet: KernelFleet, other: KernelFleet, tenant: str,
                                                  lost: bool) -> None:
    """A close has read the session's record and reaches its host when another controller closes the session and
    creates its name anew (acknowledged). The first close removes nothing of the new session: not its kernel,
    log or record. `lost`: the old session was rebuilt first (its kernel's owner is a rebuild's token). NOTE:
    before, the first close removed the new session's kernel, log and record: NotFound to its creator."""
    if lost:
        _lose(kfleet, tenant, "s")
        kfleet.digest(tenant, "s")      # rebuilt
    else:
        kfleet.create_session(tenant, "s", PARENT)

    def close_and_create() -> dict[str, Any]:
        other.close(tenant, "s")
        return other.create_session(tenant, "s", PROMPT)

    box = _beside(kfleet, "close", (tenant, "s"), close_and_create)
    closed = _outcome(lambda: kfleet.close(tenant, "s"))
    created = _finish(box)
    now = _whole(kfleet, tenant, "s")
    print(f"close: {closed!r}; created: {created!r:.80}; behind the name: {_brief(now)}")
    assert closed is None and isinstance(created, dict)
    assert (now["state"], now["op_id"], now["held"]) == ("active", created["create_op_id"], True)
    assert now["log"] == [("AppendOp", created["create_op_id"])] and now["tokens"] == _system(kfleet, PROMPT)


def test_a_close_leaves_a_session_forked_anew_from_its_child(kfleet: KernelFleet, tenant: str) -> None:
    """A session `s` forked from `c`, itself a fork of an earlier `s`, carries the earlier `s`'s first op and
    fork markers: a close that read the earlier `s`'s record removes none of it. NOTE: `made_by` took any
    marker, or the first op, for the log's maker."""
    kfleet.create_session(tenant, "p", PARENT)
    old = kfleet.fork(tenant, "p", "s")
    stored = kfleet.registry.read(tenant, "s")
    assert stored is not None
    kfleet.fork(tenant, "s", "c")
    kfleet.close(tenant, "s")
    new = kfleet.fork(tenant, "c", "s")
    kfleet._discard(stored)            # the earlier close, late: it read the earlier `s`'s record
    now = _whole(kfleet, tenant, "s")
    print(f"behind the name: {_brief(now)}")
    assert ("ForkOp", old["create_op_id"]) in now["log"] and now["log"][-1] == ("ForkOp", new["create_op_id"])
    assert (now["state"], now["op_id"], now["held"]) == ("active", new["create_op_id"], True)
