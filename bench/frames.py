"""The one profiler behind bench/trace_request.py and bench/session_frames.py (docs/architecture.md).

While `on`, it records every Python frame of kvfleet's own code (files under fleet/, controller/,
workers/, less `skip`) entered on any thread started after `profile()` installs it:

    calls      frames entered (a coroutine resumed is the same frame, not a new call)
    functions  distinct functions, in first-entry order (file:qualname)
    deepest    the deepest stack of kvfleet frames reached (the request's call path)
    depth_at   kvfleet frames on the stack when `at` (file suffix, function name) was first entered
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class Tracer:
    def __init__(self, skip: tuple[str, ...] = (), at: tuple[str, str] | None = None) -> None:
        self.own = tuple(str(ROOT / d) + "/" for d in ("fleet", "controller", "workers"))
        self.skip, self.at = tuple(str(ROOT / d) + "/" for d in skip), at
        self.on = False
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.frames: list[Any] = []  # held, so no frame id is reused while counting
        self._seen: set[int] = set()
        self.functions: dict[str, None] = {}
        self.deepest: list[str] = []
        self.depth_at = -1

    def _mine(self, filename: str) -> bool:
        return filename.startswith(self.own) and not filename.startswith(self.skip)

    def _name(self, frame: Any) -> str:
        return f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_code.co_qualname}"

    def _stack(self, frame: Any) -> list[str]:
        out = []
        while frame is not None:
            if self._mine(frame.f_code.co_filename):
                out.append(self._name(frame))
            frame = frame.f_back
        return out[::-1]

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        code = frame.f_code
        if self.at and self.depth_at < 0 and code.co_filename.endswith(self.at[0]) and code.co_name == self.at[1]:
            self.depth_at = len(self._stack(frame.f_back))
        if not self._mine(code.co_filename):
            return
        with self._lock:
            if id(frame) in self._seen:
                return
            self._seen.add(id(frame))
            self.frames.append(frame)
            self.functions.setdefault(self._name(frame), None)
            stack = self._stack(frame)
            if len(stack) > len(self.deepest):
                self.deepest = stack

    def take(self) -> dict[str, Any]:
        """What was recorded since the last take (then starts afresh)."""
        funcs = list(self.functions)
        out = {"calls": len(self.frames), "distinct": len(funcs), "functions": funcs,
               "max_depth": len(self.deepest), "deepest": self.deepest, "depth_at": self.depth_at,
               "files": list(dict.fromkeys(f.rsplit(":", 1)[0] for f in funcs))}
        self.reset()
        return out


def profile(tracer: Tracer, fn: Callable[[], Any]) -> Any:
    """Run fn() with `tracer` on this thread and every thread started from now on."""
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        return fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
