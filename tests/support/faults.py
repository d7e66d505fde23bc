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
