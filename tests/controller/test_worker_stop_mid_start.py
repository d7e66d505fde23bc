"""A worker stopped while it starts opens no ZMQ socket after its stop: stop() closes the streams it sees, and a start
that went on past it opened the rest, which nothing closed; the router's context then waited for them for good on
its stop (Context.term: a controller's stop hung in a CI run, a worker being resumed from the store as it stopped).
The real Router and a `kvfleet sim-vllm` worker; the start is held in its first look at the worker."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq
from support.one_worker import one_worker

from controller.vllm.watcher import Worker


@pytest.mark.parametrize("held", ["discover", "reconcile_once"])
async def test_a_worker_stopped_while_it_starts_leaves_no_socket_open(tmp_path, monkeypatch, held: str) -> None:
    async with one_worker(tmp_path, 64) as (r, sim):
        spec = r._workers["w0"].spec
        gate, entered = asyncio.Event(), asyncio.Event()
        real = getattr(Worker, held)

        async def hold(self: Worker) -> None:
            entered.set()
            await gate.wait()
            await real(self)

        monkeypatch.setattr(Worker, held, hold)
        ctx = r._zctx
        assert ctx is not None
        before = {s for s in ctx._sockets if not s.closed}
        w = r._new_worker(dataclasses.replace(spec, name="w1"), None)  # the same stand-in, watched a second time
        start = asyncio.create_task(w.start(catch_up=False))
        await asyncio.wait_for(entered.wait(), 10)
        await w.stop()  # before its streams exist
        gate.set()
        await asyncio.wait_for(start, 10)
        opened = {s for s in ctx._sockets if not s.closed} - before
        await w.stop()  # (the streams a start opened past its stop, stopped now, so that the router's stop ends)
        assert not opened, f"{len(opened)} sockets left open"  # before: the rank's SUB, which nothing closed


@pytest.mark.timeout(30)  # before: stop never returned (Context.term waits for the socket), ended by this bound
async def test_the_routers_stop_ends_with_a_socket_of_its_context_still_held(tmp_path) -> None:
    """A socket of the router's context still held by a coroutine the stop does not own (a worker resumed from the
    store, awaiting its catch-up replay's DEALER) is closed by the stop, which returns."""
    async with one_worker(tmp_path, 64) as (r, _):
        assert r._zctx is not None
        held = r._zctx.socket(zmq.DEALER)
    assert held.closed
