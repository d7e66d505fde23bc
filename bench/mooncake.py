"""The Mooncake FAST'25 conversation trace as a fleet routing workload (bench/fleet_routing.py).

Each line of the trace is one request: its arrival (ms), its prompt length, and its prefix as block
hashes of 512 tokens (equal ids = the same prefix KV). The trace has no text, so each hash id gets a
deterministic block of words (the same id, the same words: one stand-in token per word), a prompt is
its blocks concatenated and cut at its scaled length, and it is sent as one user message. Replayed
open loop at its timestamps, compressed. Scale: TOKENS_PER_BLOCK stand-in tokens per 512-token block
(1:32 with the stand-in's 16-token blocks: one trace block is one stand-in block, offset by the chat
template's few leading tokens), and TIME_SCALE x faster.

The committed slice (bench/data/, Apache-2.0, see its README) is the trace's first 1,500 requests;
`SOURCE` points elsewhere with fleet_routing's `--trace PATH`.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from routing_trace import SYLLABLES, Session, Workload

SOURCE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_1500.jsonl"
TRACE_BLOCK = 512
TOKENS_PER_BLOCK = 16
TIME_SCALE = 10.0


def block_words(h: int, n: int = TOKENS_PER_BLOCK) -> list[str]:
    rng = random.Random(h)
    return [rng.choice(SYLLABLES) + rng.choice(SYLLABLES) + str(rng.randrange(1000)) for _ in range(n)]


def load(path: Path, num_requests: int) -> list[dict[str, object]]:
    rows = []
    with path.open() as f:
        for i, line in enumerate(f):
            if i >= num_requests:
                break
            r = json.loads(line)
            if not isinstance(r.get("hash_ids"), list) or not isinstance(r.get("input_length"), int):
                raise SystemExit(f"{path}:{i + 1}: not a Mooncake trace line (needs hash_ids, input_length)")
            rows.append(r)
    if not rows:
        raise SystemExit(f"{path}: no requests")
    return rows


def mooncake(name: str, num_requests: int, path: Path | None = None, num_workers: int = 4) -> Workload:
    rows = load(path or SOURCE, num_requests)
    words: dict[int, list[str]] = {}
    sessions, arrivals = [], []
    t0 = float(rows[0]["timestamp"])  # type: ignore[arg-type]
    for i, r in enumerate(rows):
        ids: list[int] = r["hash_ids"]  # type: ignore[assignment]
        n = max(1, math.ceil(int(r["input_length"]) * TOKENS_PER_BLOCK / TRACE_BLOCK))  # type: ignore[call-overload]
        text: list[str] = []
        for h in ids:
            text += words.setdefault(h, block_words(h))
        sessions.append(Session(f"{name}-r{i}", "tenant0", None, ((" ".join(text[:n]), ""),), (0.0,)))
        arrivals.append((round((float(r["timestamp"]) - t0) / 1000 / TIME_SCALE, 4), i))  # type: ignore[arg-type]
    distinct = len({h for r in rows for h in r["hash_ids"]})  # type: ignore[attr-defined]
    total = sum(len(r["hash_ids"]) for r in rows)  # type: ignore[arg-type]
    span = arrivals[-1][0] * TIME_SCALE
    return Workload(
        name,
        f"Mooncake conversation trace, first {len(rows)} requests ({span:.0f} s of production traffic, "
        f"{100 * (1 - distinct / total):.0f}% of blocks reused), open loop over {num_workers} workers",
        num_workers,
        tuple(sessions),
        arrivals=tuple(arrivals),
        distinct_tokens=distinct * TOKENS_PER_BLOCK,
        scale=f"1:{TRACE_BLOCK // TOKENS_PER_BLOCK} tokens ({TOKENS_PER_BLOCK} stand-in tokens per 512-token "
        f"block), time {TIME_SCALE:g}x faster",
    )
