"""Loader for the shared vLLM KV-event vectors (the reference JSON travels with the tests)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any


def vectors_path() -> Path:
    """A verbatim copy of the design's reference/vllm-kv-event-vectors.json."""
    return Path(__file__).resolve().parents[1] / "controller" / "vllm" / "data" / "vllm-kv-event-vectors.json"


def load() -> dict[str, Any]:
    return json.loads(vectors_path().read_text())


def frames(v: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(x) for x in v["frames_b64"]]


def unhex(x: Any) -> Any:
    """JSON -> Python: {'$bytes_hex': ..} -> bytes, every list -> tuple (as vLLM hashes tuples)."""
    if isinstance(x, dict) and "$bytes_hex" in x:
        return bytes.fromhex(x["$bytes_hex"])
    if isinstance(x, list):
        return tuple(unhex(i) for i in x)
    return x
