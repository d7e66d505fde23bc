"""bench/mooncake_bound.py fresh_reuse: the share of prompt blocks reusable only from a block first seen within the
window, on a hand-made trace whose answer is known."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from mooncake_bound import fresh_reuse  # noqa: E402

ROWS = [
    {"timestamp": 0, "hash_ids": [1, 2]},
    {"timestamp": 100, "hash_ids": [1, 2, 3]},  # 1, 2 first seen 100 ms before
    {"timestamp": 10_000, "hash_ids": [1, 9]},  # 1 first seen 10 s before; 9 new
    {"timestamp": 10_050, "hash_ids": [9, 1]},  # 9 first seen 50 ms before; then 1, old
]


def test_fresh_reuse_counts_only_the_leading_run_and_only_blocks_first_seen_within_the_window() -> None:
    total = 2 + 3 + 2 + 2
    assert fresh_reuse(ROWS, 500) == (2 + 1) / total  # row 2's 1 and 2; row 4's 9 (its 1 is old)
    assert fresh_reuse(ROWS, 20_000) == (2 + 1 + 2) / total  # every reusable block is fresh then
    assert fresh_reuse(ROWS, 0) == 0.0
