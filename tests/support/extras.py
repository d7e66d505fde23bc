"""Tests of an optional layer skip where its extra is not installed (a plain venv), and fail instead under
`./dev.sh test`, which installs every extra and sets KVFLEET_TEST_EXTRAS=all: there, a missing extra is a
broken install, never a silent skip."""

from __future__ import annotations

import os

import pytest

from fleet.core.quarantine.encoder import INSTALL_HINT, missing_modules


def require_encoder() -> None:
    """Call at module level of a test module that needs the encoder layer."""
    missing = missing_modules()
    if not missing:
        return
    msg = f"the encoder layer needs {', '.join(missing)} ({INSTALL_HINT})"
    if os.environ.get("KVFLEET_TEST_EXTRAS") == "all":
        pytest.fail(f"{msg}, and KVFLEET_TEST_EXTRAS=all says every extra is installed", pytrace=False)
    pytest.skip(msg, allow_module_level=True)
