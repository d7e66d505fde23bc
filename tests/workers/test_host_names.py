"""A kernel host opens a session for a create or fork only while it holds none of that name: the check and
the insert run with no await between them, so of two tries one gets the name and the other is refused
(AlreadyExists), and a try that fails, or is cleaned up, removes only the session it opened. A rebuild that a
close overtook answers SessionGone, not the row of a closed session.

The host runs in this process, on one event loop, so each interleaving is forced, not hoped for."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from support.workers import SPEC

from fleet.core.errors import AlreadyExists
from fleet.core.oplog import ForkOp, parse_log
from workers.host import KernelHost
from workers.packed import pack_ops
from workers.registry import SessionRecord, SessionRegistry
from workers.session_kernel import SessionGone

PROMPT_A = [(i * 7 + 3) % 512 for i in range(40)]
PROMPT_B = [(i * 11 + 5) % 512 for i in range(40)]


def _host(tmp_path: Path) -> KernelHost:
    return KernelHost("node-a", f"sqlite:///{tmp_path / 'host.db'}", SPEC.to_dict(), threads=2)


def _log(host: KernelHost, sid: str) -> list[tuple[str, str]]:
    return [(o.op_id, type(o).__name__) for o in parse_log(host.store.oplog_read("acme", sid))]


def test_two_creates_of_one_name_one_wins_the_other_is_refused(ray_cluster: None, tmp_path: Path) -> None:
    """Both creates start before either opened the session (each awaits the kernel's load first). NOTE:
    before, both passed the check, the second replaced the first's session, and, refused by the first's log,
    its cleanup popped the session that held the name: a create acknowledged by a host that held nothing."""
    host = _host(tmp_path)

    async def loser_cleanup() -> None:  # it closes only the session it opened: not the winner's
        await host.close("acme", "s", "op-b")

    async def main() -> list[Any]:
        tries = [host.create_session("acme", "s", PROMPT_A, "op-a"), host.create_session("acme", "s", PROMPT_B, "op-b")]
        out = await asyncio.gather(*tries, return_exceptions=True)
        held = await host.holds("acme", "s")
        cleanup = await asyncio.gather(loser_cleanup(), return_exceptions=True)
        tokens = await asyncio.gather(host.call("acme", "s", "tokens"), return_exceptions=True)
        return [*out, held, *cleanup, *tokens]

    won, lost, held, cleanup, tokens = asyncio.run(main())
    print(f"first try: {won!r}; second try: {lost!r}; held: {held}; after the loser's cleanup: {tokens!r:.40}")
    assert isinstance(won, dict) and won["epoch"] == 0
    assert isinstance(lost, AlreadyExists) and held
    assert cleanup is None and tokens == PROMPT_A and _log(host, "s") == [("op-a", "AppendOp")]


def test_a_fork_and_a_create_of_one_name_and_a_retry_of_the_same_try(ray_cluster: None, tmp_path: Path) -> None:
    """A fork and a create of one name at once: the fork, first, gets it; the create is refused and its log
    check never runs. A retry of the fork (same op id: nodes.call repeats a call Ray may have run) joins it."""
    host = _host(tmp_path)

    async def main() -> list[Any]:
        await host.create_session("acme", "parent", PROMPT_A, "op-p")
        ops = pack_ops([*parse_log(host.store.oplog_read("acme", "parent")), ForkOp("parent", 1, "op-f")])
        fork = asyncio.ensure_future(host.fork("acme", ops, "s", "parent", PROMPT_A))
        while ("acme", "s") not in host.sessions and not fork.done():   # the fork first (it unpacks its log on the lane)
            await asyncio.sleep(0)
        tries = [fork, host.create_session("acme", "s", PROMPT_B, "op-c")]
        out = await asyncio.gather(*tries, return_exceptions=True)
        retried = await host.fork("acme", ops, "s", "parent", PROMPT_A)
        return [*out, retried, await host.call("acme", "s", "tokens")]

    forked, created, retried, tokens = asyncio.run(main())
    print(f"fork: {forked.get('adopted_tokens') if isinstance(forked, dict) else forked!r}; create: {created!r}")
    assert isinstance(forked, dict) and isinstance(created, AlreadyExists)
    assert isinstance(retried, dict) and retried["num_ops"] == 2 and tokens == PROMPT_A
    assert _log(host, "s") == [("op-p", "AppendOp"), ("op-f", "ForkOp")]


def test_a_create_the_record_names_replaces_an_orphan_and_its_log(ray_cluster: None, tmp_path: Path) -> None:
    """An orphan: a kernel and log a create left after its caller gave up on it and removed its record (its call
    timed out before the host ran it). The record now names a later create of the name, which replaces the orphan's
    kernel and log. NOTE: before, the host refused it (AlreadyExists) until it restarted; and with the kernel alone
    replaced, the orphan's log refused it all the same (AlreadyExists: an op log), as when the orphan wrote it after
    the fleet's claim had looked. Control: a create the record does not name is refused, the session left whole."""
    host = _host(tmp_path)
    registry = SessionRegistry(host.store)

    async def main() -> list[Any]:
        await host.create_session("acme", "s", PROMPT_A, "op-a")                   # no record names it
        registry.insert(SessionRecord("acme", "s", "node-a", create_op_id="op-b"))   # the later try's
        out: list[Any] = [await host.create_session("acme", "s", PROMPT_B, "op-b")]
        out.append(await host.call("acme", "s", "tokens"))
        out += await asyncio.gather(host.create_session("acme", "s", PROMPT_A, "op-c"), return_exceptions=True)
        return [*out, await host.call("acme", "s", "tokens")]

    created, tokens, refused, after = asyncio.run(main())
    print(f"the later create: {created!r:.60}; the one no record names: {refused!r}")
    assert isinstance(created, dict) and tokens == after == PROMPT_B and isinstance(refused, AlreadyExists)
    assert _log(host, "s") == [("op-b", "AppendOp")] and len(host.sessions) == 1


def _gate(host: KernelHost, skip: int = 0) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold the next job the host's lanes run (past the first `skip`: a fork's first unpacks its log) until the
    returned `gate` is set; `entered` is set once it waits."""
    real: Callable[[str, Callable[[], Any]], Awaitable[Any]] = host.lanes.run
    entered, gate = asyncio.Event(), asyncio.Event()
    skipped = [0]

    async def gated(tenant: str, fn: Callable[[], Any]) -> Any:
        if skipped[0] < skip:
            skipped[0] += 1
        elif not gate.is_set():
            entered.set()
            await gate.wait()
        return await real(tenant, fn)

    host.lanes.run = gated  # type: ignore[method-assign]
    return entered, gate


def test_a_rebuild_a_close_overtook_answers_session_gone(ray_cluster: None, tmp_path: Path) -> None:
    """The close comes while the rebuild replays the log (its lane job held), and waits for it. NOTE: before,
    the rebuild answered its row all the same, and the fleet wrote the closed session's record back."""
    host = _host(tmp_path)

    async def main() -> tuple[Any, bool]:
        await host.create_session("acme", "s", PROMPT_A, "op-a")
        await host.close("acme", "s")                     # the kernel is lost; its log stays
        entered, gate = _gate(host)
        rebuild = asyncio.ensure_future(host.regenerate("acme", "s", 1))
        await entered.wait()                               # the replay is under way, holding the session's lock
        rebuilt = host.sessions[("acme", "s")]
        closing = asyncio.ensure_future(host.close("acme", "s"))
        while not rebuilt.closed:
            await asyncio.sleep(0)                         # until the close marked it closed (it waits for the lock)
        gate.set()
        out = await asyncio.gather(rebuild, closing, return_exceptions=True)
        return out[0], await host.holds("acme", "s")

    answer, held = asyncio.run(main())
    print(f"the rebuild answered: {answer!r}; held: {held}")
    assert isinstance(answer, SessionGone) and not held


def _refs(host: KernelHost, ref: str) -> int:
    return int(host.store.stat(ref, "acme").refs)


def test_a_retried_fork_restores_the_child_once(ray_cluster: None, tmp_path: Path) -> None:
    """A retry of a fork (same op id) joins the first try: while its restore runs (the lane job held), and once
    it is done and the child logged an op of its own. Neither writes the child's log again nor takes the
    parent's blob references twice. NOTE: before, each retry restored the child again: the op logged since
    was dropped from its log, and every retry added a reference to the parent's tool result (never given back)."""
    host = _host(tmp_path)

    async def main() -> tuple[list[int], list[Any], list[tuple[str, str]], list[int]]:
        ref = host.store.put(b"some tool output, clean", "acme")
        await host.create_session("acme", "parent", PROMPT_A, "op-p")
        await host.call("acme", "parent", "add_tool_result", ref, "op-t")
        ops = pack_ops([*parse_log(host.store.oplog_read("acme", "parent")), ForkOp("parent", 2, "op-f")])
        tokens = await host.call("acme", "parent", "tokens")
        refs = [_refs(host, ref)]
        entered, gate = _gate(host, skip=1)
        first = asyncio.ensure_future(host.fork("acme", ops, "c", "parent", tokens))
        await entered.wait()                               # the first try's restore is under way
        joined = asyncio.ensure_future(host.fork("acme", ops, "c", "parent", tokens))
        await asyncio.sleep(0.05)
        gate.set()
        out = list(await asyncio.gather(first, joined, return_exceptions=True))
        refs.append(_refs(host, ref))
        await host.call("acme", "c", "append_message", [5, 6, 7], "user", "op-m")
        out.append(await host.fork("acme", ops, "c", "parent", tokens))   # once done: answered from the child
        refs.append(_refs(host, ref))
        return refs, out, _log(host, "c"), (await host.call("acme", "c", "tokens"))[-3:]

    refs, out, log, end = asyncio.run(main())
    print(f"refs: {refs}; answers: {[o.get('num_ops') if isinstance(o, dict) else o for o in out]}; log: {log}")
    assert refs == [1, 2, 2] and all(isinstance(o, dict) for o in out)
    assert [o["num_ops"] for o in out] == [3, 3, 4] and end == [5, 6, 7]
    assert [op_id for op_id, _ in log] == ["op-p", "op-t", "op-f", "op-m"]


def test_a_fork_whose_restore_a_close_overtook_writes_nothing(ray_cluster: None, tmp_path: Path) -> None:
    """The child is closed while its fork's restore waits for a lane (its job held), and its close stopped waiting
    (timed out). The restore then writes no log and takes no blob reference. NOTE: before, it wrote the child's
    log after the fleet had deleted it (an orphan no record names) and took the parent's blob references for good."""
    host = _host(tmp_path)

    async def main() -> tuple[Any, list[tuple[str, str]], int]:
        ref = host.store.put(b"some tool output, clean", "acme")
        await host.create_session("acme", "parent", PROMPT_A, "op-p")
        await host.call("acme", "parent", "add_tool_result", ref, "op-t")
        ops = pack_ops([*parse_log(host.store.oplog_read("acme", "parent")), ForkOp("parent", 2, "op-f")])
        entered, gate = _gate(host, skip=1)
        fork = asyncio.ensure_future(host.fork("acme", ops, "c"))   # no sharing: the restore replays the log
        await entered.wait()
        await host.sessions[("acme", "c")].close(timeout_s=0.01)    # a close that gave up waiting
        gate.set()
        [out] = await asyncio.gather(fork, return_exceptions=True)
        return out, _log(host, "c"), _refs(host, ref)

    out, log, refs = asyncio.run(main())
    print(f"the fork answered: {out!r}; the child's log: {log}; refs: {refs}")
    assert isinstance(out, SessionGone) and log == [] and refs == 1
