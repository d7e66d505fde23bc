"""Log lines that a broken peer can repeat many times a second, each kind at most once per interval.

A worker whose KV-event stream fails keeps failing with every batch: each failure is worth a line naming the
worker and the cause (NOTE: they only stepped a metric, and a worker routed COLD with no line saying why), but
not thousands of lines. Each key (a cause) logs at most once per `every_s`; the next line that does log says how
many were held back since the last one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

LOG_EVERY_S = 10.0


class RateLog:
    """Lines of one source (a stream, a worker), each key at most once per `every_s` seconds; the ones held back
    are counted in the next line of that key."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when last logged, lines held back since)

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        at, held = self._last.get(key, (-self.every_s, 0))
        if now - at < self.every_s:
            self._last[key] = (at, held + 1)
            return
        self._last[key] = (now, 0)
        self.logger.log(level, msg + (f" ({held} more like it since the last such line)" if held else ""), *args,
                        exc_info=exc_info)
