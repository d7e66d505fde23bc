"""Faults injected into a real kernel (tests only)."""

from __future__ import annotations

import os
from typing import Any


def mlp_fails_once(kernel: Any) -> None:
    """The kernel's next MLP raises once (an out-of-memory in the middle of a recompute), then works again."""
    real, calls = kernel.ops.mlp, [0]

    def flaky(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("out of memory (injected)")
        return real(*args)

    kernel.ops.mlp = flaky


def host_mlp_fails_once(host: Any) -> None:
    """(In a kernel host's process, by __ray_call__; send it with this module pickled by value.) Its kernel's next
    MLP raises once."""
    mlp_fails_once(host._loading.result()[0])


def host_exits_in_next_mlp(host: Any) -> None:
    """(In a kernel host's process, by __ray_call__; send it with this module pickled by value.) Its kernel's next
    MLP ends the process: the host dies in the middle of a prefill, and Ray restarts it empty."""
    def exit_(*args: Any) -> Any:
        os._exit(1)

    host._loading.result()[0].ops.mlp = exit_


def host_mlp_waits_for(host: Any, gate: str, most_s: float = 60.0) -> None:
    """(In a kernel host's process, by __ray_call__; send it with this module pickled by value.) Its kernel's next
    MLP waits until the file `gate` exists (at most `most_s`), then works as before: the host's answer to the call
    running it is late by as long as the test wants, whatever the machine's speed."""
    import time

    kernel = host._loading.result()[0]
    real = kernel.ops.mlp

    def held(*args: Any) -> Any:
        kernel.ops.mlp = real
        deadline = time.monotonic() + most_s
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        return real(*args)

    kernel.ops.mlp = held


def host_store_dies_at_add_ref(host: Any, redis_pid: int, n: int) -> None:
    """(In a kernel host's process, by __ray_call__; send it with this module pickled by value.) As its store takes
    its `n`-th blob reference from now on, the Redis server `redis_pid` is SIGKILLed first: that call, and every
    later one until the server is started again, fails on a real dead connection."""
    import signal

    store, calls = host.store, [0]
    real = store.add_ref

    def dies(ref: str, tenant: str, *holder: str | None) -> None:
        calls[0] += 1
        if calls[0] == n:
            store.add_ref = real
            os.kill(redis_pid, signal.SIGKILL)
        real(ref, tenant, *holder)

    store.add_ref = dies
