"""NameLocks: one lock per session name, in one process.

KernelFleet holds a session's lock while it changes what stands behind the name (its record, kernel and
op log): a create or fork, a close, a release, a rebuild. Two such calls of one name in one process never
interleave, so a create that loses to another never clears the winner's session, and a close waits for a
rebuild instead of running under it. Calls of other names do not wait. Writers in other processes (a second
controller during a leader change) are kept apart by the registry's compare-and-set (workers/registry.py)
and the kernel host's check-and-insert (workers/host_slots.py `_insert`) instead.

A name's lock lives while someone holds or waits for it (so a fleet that saw a million names keeps none),
and every caller of one name gets the same lock while it lives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class _Entry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    num_users: int = 0  # callers holding or waiting for `lock`


class NameLocks:
    """Locks by key, each created on first use and dropped when its last user leaves."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[tuple[str, str], _Entry] = {}

    @contextmanager
    def hold(self, key: tuple[str, str]) -> Iterator[None]:
        """Hold `key`'s lock for the block (not reentrant: a holder that asks again waits for itself)."""
        with self._guard:
            entry = self._entries.setdefault(key, _Entry())
            entry.num_users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.num_users -= 1
                if entry.num_users == 0:
                    del self._entries[key]

    def num_waiting(self, key: tuple[str, str]) -> int:
        """Callers holding or waiting for `key`'s lock (0 when none)."""
        with self._guard:
            entry = self._entries.get(key)
            return entry.num_users if entry is not None else 0
