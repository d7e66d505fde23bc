"""Child processes that end with the process that started them (Linux), however it ends."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def dies_with_parent() -> Callable[[], None] | None:
    """A Popen preexec_fn that has the child SIGTERMed when this process ends, however it ends (a SIGKILL
    too): Linux's PR_SET_PDEATHSIG. None elsewhere (the replay's finally block still stops the child).

    NOTE: the death signal follows the thread that forks: call Popen from a thread that lives as long as
    the child (the event loop's). libc's prctl is looked up here, before the fork, so the child runs no
    import and no dlopen between fork and exec (preexec_fn and threads: only async-signal-safe-ish work)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the prctl: nothing would signal us
            os._exit(1)

    return arm
