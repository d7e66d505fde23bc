"""Ctrl-C that ends a command as interrupted, even where C code it landed in turned it into another error.

An extension module's init that a SIGINT interrupts can replace the KeyboardInterrupt with an error of its own, and
the KeyboardInterrupt is lost: numpy's, interrupted while it imports `datetime`, raises `ImportError: PyCapsule_Import
could not import module "datetime"`. `kvfleet witness` interrupted at that moment printed that traceback and exited 1
where it should print one line and exit 130 (fleet/app/cli/main.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def sigint_as_interrupt() -> Iterator[None]:
    """Within it, a Ctrl-C ends the block in KeyboardInterrupt, whatever error it became (kept as the cause), and
    even if that error was caught inside (an optional import's `except ImportError`).

    Only where SIGINT has Python's default handler, and only in the main thread: asyncio.run installs its own
    handler only over the default one, so a block that runs an event loop must not be inside it, and a command's
    own handler is left alone. The default handler is back when the block ends."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    seen = False

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal seen
        seen = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except Exception as e:
        if seen:
            raise KeyboardInterrupt from e
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if seen:  # caught inside, as another error: the command must not go on as if no Ctrl-C had come
        raise KeyboardInterrupt
