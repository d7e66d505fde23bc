"""The controller's store threads when two tenants flood them: a third tenant's blob call takes the next thread
that frees, not a place behind the flooders' queued calls.

Real controller, real gRPC on loopback, real SQLite store; the flooders' store calls are held in their threads
(a semaphore in front of the real call) so the order in which calls start is exact, not a matter of timing.
NOTE: before, each tenant could have three quarters of the threads (3 of 4) submitted whatever the others held:
acme ran 3, bravo ran 1 and queued 2 more in the executor's first-come queue, and carol's StatBlob waited behind
them: the thread acme's call freed went to bravo's queued call, not to carol's.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
from support.controller import make_tokens, md, start_controller, store_url
from support.waits import wait_until

from controller.auth import mint_token
from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.sdk import NO_RETRY, AsyncFleetClient

FLOODERS = ("acme", "bravo")


class _HeldStore:
    """The real store; a flooder's `stat` waits for a permit first. Records the tenant of each stat that starts."""

    def __init__(self, store: Any) -> None:
        self._store, self.permits, self._lock = store, threading.Semaphore(0), threading.Lock()
        self.started: list[str] = []
        self.waiting = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def stat(self, ref: str, tenant: str) -> Any:
        with self._lock:
            self.started.append(tenant)
            self.waiting += tenant in FLOODERS
        if tenant in FLOODERS:
            self.permits.acquire()
        return self._store.stat(ref, tenant)


def _callers(ctl: Any, tenant: str) -> int:
    """The tenant's blob calls holding or waiting for a store thread."""
    share = ctl.ctx.store_lanes._shares.get(tenant)
    return 0 if share is None else int(share.users)


async def test_a_third_tenant_gets_the_next_free_store_thread_while_two_tenants_flood(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    carol = mint_token(tok.file, "carol", "tenant")
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, store_threads=4)
    try:
        refs = {}
        for name, t in (("acme", tok.a), ("bravo", tok.b), ("carol", carol)):
            async with AsyncFleetClient(ctl.address, token=t, retry=NO_RETRY) as c:
                refs[name] = (await c.put_blob(f"{name}'s blob".encode())).ref
        held = ctl.ctx.store = _HeldStore(ctl.ctx.store)
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = BlobServiceStub(ch)

            def stat(name: str, token: str) -> Any:
                return asyncio.ensure_future(stub.StatBlob(blobs_pb2.StatBlobRequest(ref=refs[name]),
                                                           metadata=md(token), timeout=60))
            flood = [stat("acme", tok.a) for _ in range(6)]
            await wait_until(lambda: held.waiting == 3, "acme's 3 stats running")
            flood += [stat("bravo", tok.b) for _ in range(6)]
            await wait_until(lambda: held.waiting == 4, "bravo's first stat running")
            # bravo's other calls are queued where the controller queues them, then carol's behind them (polled: a
            # fixed 0.3 s each can fall short on a loaded machine, and a call not queued yet is not chosen next)
            await wait_until(lambda: _callers(ctl, "bravo") == 6, "bravo's other calls queued")
            third = stat("carol", carol)
            await wait_until(lambda: _callers(ctl, "carol") == 1, "carol's call queued")
            assert held.started == ["acme"] * 3 + ["bravo"], held.started  # every thread held, carol waits
            held.permits.release()  # one of the flooders' calls ends: its thread is free
            await wait_until(lambda: len(held.started) == 5, "the next stat started")
            nxt = held.started[4]
            held.permits.release(len(flood))
            answers = await asyncio.gather(*flood, third)
    finally:
        await ctl.stop(0)
    assert all(a.meta.ref for a in answers)  # control: every call answered
    assert nxt == "carol", held.started  # before: "bravo" (its call queued in the executor before carol's)
