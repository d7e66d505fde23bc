"""A git worktree of another revision for the length of a block: the benchmarks that run an earlier tree
beside this one (in its own process, same machine, same run) check it out here and remove it after."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached checkout of `rev`, removed when the block ends (however it ends)."""
    with tempfile.TemporaryDirectory(prefix="kvf-baseline-") as tmp:
        wt = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(wt), rev], cwd=ROOT, check=True, capture_output=True)
        try:
            yield wt
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, capture_output=True)
