"""Whole-number flags: 0 or more, refused with argparse's usage error (exit 2) otherwise.

NOTE: before, `--count -1` drew one frame and stopped as if it were 1, `--num-cpus -2` started Ray and ended in its
ValueError traceback, and `--sim-workers -1` ran as 0 (found by review).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole(what_zero_means: str = "") -> Callable[[str], int]:
    """An argparse `type` taking a whole number >= 0; `what_zero_means` is said in the refusal ("until Ctrl-C")."""
    zero = f"0 ({what_zero_means})" if what_zero_means else "0"

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if n < 0:
            raise argparse.ArgumentTypeError(f"{n}: give {zero} or more")
        return n

    return parse
