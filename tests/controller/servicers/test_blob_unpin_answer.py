"""UnpinBlob's answer comes from the unpin itself: GC collecting the blob right after it does not turn an unpin that
happened into NOT_FOUND (a real controller over gRPC on loopback, over SQLite and the tests' real Redis)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.controller import make_tokens, start_controller

from fleet.cas import open_store
from fleet.core.errors import NotFound
from fleet.sdk import NO_RETRY, AsyncFleetClient


def _gc_right_after(store: Any, verb: str) -> None:
    """The store's `verb`, then a real GC run: the collection lands between the verb's store call and anything the
    servicer reads after it (the instance attribute shadows the method for this store only)."""
    real = getattr(store, verb)

    def then_gc(ref: str, tenant: str) -> Any:
        out = real(ref, tenant)
        store.gc()
        return out

    setattr(store, verb, then_gc)


async def test_an_unpin_then_a_collection_answers_the_unpin(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    with open_store(url, lease_s=0.0) as s:  # its lease runs out at once: only the pin keeps it
        ref = s.put(b"a tool output pinned once", "acme")
        s.pin(ref, "acme")
    ctl = await start_controller(url, tok, gc_interval_s=0)
    try:
        _gc_right_after(ctl.ctx.store, "unpin")
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
            meta = await c.unpin_blob(ref)  # before: NotFound, though the pin was dropped
            assert (meta.ref, meta.pins, meta.refs) == (ref, 0, 0)
            with pytest.raises(NotFound):  # the control: GC did collect it, right after the unpin
                await c.stat_blob(ref)
    finally:
        await ctl.stop(0)


async def test_a_pin_then_a_collection_keeps_the_blob(url: str, tmp_path: Path) -> None:
    # the control on the other verb: a pinned blob survives the same GC, and PinBlob answers its pins
    tok = make_tokens(tmp_path)
    with open_store(url, lease_s=0.0) as s:
        ref = s.put(b"a tool output pinned now", "acme")
    ctl = await start_controller(url, tok, gc_interval_s=0)
    try:
        _gc_right_after(ctl.ctx.store, "pin")
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
            assert (await c.pin_blob(ref)).pins == 1
            assert (await c.stat_blob(ref)).pins == 1
    finally:
        await ctl.stop(0)
