"""Yield points in kernel work, so a scheduler can share the CPU between the callers of one process.

A kernel host runs many tenants' sessions on a few threads of one process, and the numpy kernel holds the
interpreter lock for much of its work: a thread's share of the CPU is about one over the threads running.
So a tenant with three jobs on three threads took three quarters of it, and another tenant's 1,000-token
append beside them ran 6.5x slower than alone. A scheduler cannot preempt a thread, but the kernel can ask
it, at points where stopping costs nothing, whether this thread should wait: `checkpoint()`, called once per
layer of every tile group (a prefill chunk or one decoded token). The caller that runs the work installs the
question for its thread (`paced`); without one, a checkpoint does nothing.

    with paced(lambda: share.checkpoint("acme")):
        session.append(ids)       # may wait at a layer boundary while another tenant catches up

Pure core: the hook is a plain callable, and waiting in it changes only when the work runs, never its
bits (the order of every operation is the same).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def checkpoint() -> None:
    """Let this thread's scheduler (if any) make it wait here."""
    hook = getattr(_local, "hook", None)
    if hook is not None:
        hook()


@contextmanager
def paced(hook: Callable[[], None]) -> Iterator[None]:
    """Run the block with `hook` as this thread's checkpoint."""
    prev = getattr(_local, "hook", None)
    _local.hook = hook
    try:
        yield
    finally:
        _local.hook = prev
