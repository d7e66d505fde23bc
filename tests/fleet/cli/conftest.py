"""The CLI's tests send real SIGINTs, as a terminal's Ctrl-C does, so they run with Python's own SIGINT handler.

A shell that starts a job in the background (`nohup ./dev.sh test &`, or `cmd &` in a script) starts it with SIGINT
ignored, and every process it starts inherits that: no Ctrl-C can reach them, and the CLI rightly leaves an
ignored SIGINT ignored (fleet/app/cli/sigint.py). Here the handler is Python's default for the test, and the
commands the tests start get SIGINT's default action (a handler, unlike SIG_IGN, does not survive exec), so the
tests check what a user at a terminal gets wherever the suite is started from.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def sigint_as_at_a_terminal() -> Iterator[None]:
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
