"""Short temp dirs for the tests' own local Rays, removed when the test session ends.

A Ray's socket paths must fit 107 bytes, so its temp dir cannot live under pytest's tmp_path; these are made
under the system temp dir instead. Each run used to leave every one of them (and the Ray session inside) behind:
tens of them per run, about 200 KB each. `tests/conftest.py` removes them all at the end of the session.
"""

from __future__ import annotations

import shutil
import tempfile

_made: list[str] = []


def short_tmpdir(prefix: str) -> str:
    """A new temp dir with a short path, removed at the end of the test session."""
    d = tempfile.mkdtemp(prefix=prefix)
    _made.append(d)
    return d


def remove_all() -> None:
    while _made:
        shutil.rmtree(_made.pop(), ignore_errors=True)
