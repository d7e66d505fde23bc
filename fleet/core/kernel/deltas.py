"""The measured max|d| of a session's stored rows against what the prefill path computes for them
(fleet/core/kernel/session.py's witnesses and its reposition eviction's `exact` report)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fleet.core.kernel.types import K_POST, K_RAW, max_abs_delta


def rope_delta(ops: Any, rows: Any, lo: int) -> float:
    """max|K - RoPE(Kraw)| of rows [3, L, KV, m, hd] of positions lo.., the rotation by the prefill path's
    `ops.rope_rows`."""
    return max_abs_delta(ops.to_numpy(rows[K_POST]), ops.to_numpy(ops.rope_rows(rows[K_RAW], lo)))


def layer0_delta(ops: Any, rows: Any, lo: int, tokens: list[int], memo: bool = True) -> float:
    """max|stored - recomputed| of layer 0 of rows [3, L, KV, m, hd] holding `tokens` at positions lo..;
    memo: take each id's projection from the kernel's layer-0 memo (False: recompute it)."""
    with ops.limit():
        ref = ops.layer0(np.asarray(tokens, np.int64), lo, memo)  # 3 x [KV, m, hd]
    return max(max_abs_delta(ops.to_numpy(rows[i, 0]), ops.to_numpy(r)) for i, r in enumerate(ref))
