"""A stack whose start is cancelled while Ray starts (ray.init cannot be interrupted: it runs in a thread) waits
for it and stops the Ray it started before the cancellation goes on (fleet/app/testkit/stack.py _start_ray).

NOTE: before, the cancelled start returned at once and left the Ray being started to the process's exit (and,
for an owned Ray, its agents to the watchdog, a few seconds after it). Ray itself is faked here: what is
checked is the order of the calls.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

import fleet.app.testkit.stack as stack_mod
from fleet.app.testkit.stack import StackConfig


async def test_a_start_cancelled_while_ray_starts_stops_the_ray_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    started, go = threading.Event(), threading.Event()

    def init_ray(address: str | None, num_cpus: int | None = None, own_tree: bool = False) -> bool:
        calls.append(f"init {own_tree}")
        started.set()
        go.wait(10)
        calls.append("init done")
        return True

    monkeypatch.setattr(stack_mod, "init_ray", init_ray)
    monkeypatch.setattr(stack_mod, "stop_ray", lambda own_tree: calls.append(f"stop {own_tree}"), raising=False)
    cfg = StackConfig(store_url="sqlite:///unused.db", state_dir=".", own_ray_tree=True)
    task = asyncio.ensure_future(stack_mod.start_stack(cfg))
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    threading.Timer(0.2, go.set).start()  # ray.init ends after the cancellation
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == ["init True", "init done", "stop True"]
