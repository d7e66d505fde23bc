"""vLLM's sleep-mode operation series: `vllm:sleep_mode_operations_in_flight{operation}` and the count of
`vllm:sleep_mode_operation_duration_seconds{operation}` (reference §4).

vLLM's frontend wraps its /sleep, /wake_up and /release_kv_cache_memory handlers alike: the operation's gauge is
raised when the handler starts and lowered once the engine has answered (a /sleep with mode=wait: once its drain is
done), and the duration is observed then, an operation that failed included. Both families are created on the first
such call, the gauge with a 0 for each of the three operations; the histogram has a series only for an operation
observed at least once. Labels: `operation` alone (the frontend's, no `engine` or `model_name`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

OPERATIONS = ("sleep", "release_kv_cache_memory", "wake")


@dataclass(slots=True)
class SleepOps:
    in_flight: dict[str, int] = field(default_factory=dict)  # empty: not created yet (absent != 0)
    done: dict[str, int] = field(default_factory=dict)  # the histogram's _count per operation
    total_s: dict[str, float] = field(default_factory=dict)  # its _sum (wall seconds)

    @contextmanager
    def record(self, op: str) -> Iterator[None]:
        """Around one handler: in flight while it runs, counted once it has ended (raised or not)."""
        assert op in OPERATIONS, op
        if not self.in_flight:
            self.in_flight = dict.fromkeys(OPERATIONS, 0)
        self.in_flight[op] += 1
        started = time.perf_counter()
        try:
            yield
        finally:
            self.in_flight[op] -= 1
            self.done[op] = self.done.get(op, 0) + 1
            self.total_s[op] = self.total_s.get(op, 0.0) + time.perf_counter() - started
