"""Pinning a math library's thread count for the kernel's work, held by callers that overlap.

The thread counts of BLAS and torch are process-wide. A kernel host runs several sessions of one kernel at once,
each on a lane thread (workers/lanes.py), and each forward pass pins the count for its duration (`ops.limit()`).
Each used to save the count it found and restore it on exit: with two passes overlapping, the first to finish
restored the caller's count while the other still ran (unpinned: 2 threads where the kernel's is 1), and the
last to finish restored the pinned count it had found, for good (the caller's 2 became 1).

`ThreadPin.hold(n)` counts its holders instead: the first pins (saving the caller's settings), the last restores
them. Overlapping holders of another count (two kernels of different `threads` in one process) re-pin to their own
count while they hold it; the settings saved by the first holder are restored when the last one leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class ThreadPin:
    """Process-wide pin of one library's settings: `pin(n)` applies thread count `n` and returns what it replaced
    (opaque), `restore(saved)` puts that back."""

    def __init__(self, pin: Callable[[int], Any], restore: Callable[[Any], None]) -> None:
        self._pin, self._restore = pin, restore
        self._lock = threading.Lock()
        self._holders = 0
        self._saved: Any = None

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        """Run the body with the library pinned to `n` threads; the caller's settings come back after the last
        overlapping holder leaves."""
        with self._lock:
            saved = self._pin(n)
            if self._holders == 0:
                self._saved = saved
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._restore(self._saved)
                    self._saved = None

    @property
    def holders(self) -> int:
        return self._holders
