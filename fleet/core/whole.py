"""One whole-number argparse `type` for every flag that takes a count or a size, refused with argparse's usage error
(exit 2) outside its range. Pure (argparse only).

NOTE: before, `--count -1` drew one frame and stopped as if it were 1, `--num-cpus -2` started Ray and ended in its
ValueError traceback, and `--sim-workers -1` ran as 0 (found by review); three parsers of the same shape had grown.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def whole(low: int = 0, high: int | None = None, zero_means: str = "") -> Callable[[str], int]:
    """An argparse `type` taking a whole number in [low, high] (no upper bound where high is None); `zero_means` is
    said in the refusal where 0 is allowed and means something ("until Ctrl-C")."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if high is not None and not low <= n <= high:
            raise argparse.ArgumentTypeError(f"{n}: expected {low} to {high}")
        if n < low:
            least = f"{low} ({zero_means})" if low == 0 and zero_means else str(low)
            raise argparse.ArgumentTypeError(f"{n}: give {least} or more")
        return n

    return parse
