"""The per-node KV budget flag of the session fleet (shared by `kvfleet controller` and `up`).

Each Ray node holds at most `--node-kv-bytes` of KV: its radix cache's blocks plus its sessions'
private blocks (workers/supervisor.py `used_bytes`). Placement skips a node whose budget is spent;
when no node has room, creating a session is RESOURCE_EXHAUSTED (workers/placement.py)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from workers.placement import NODE_KV_BYTES


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 (bytes of KV one Ray node may hold)")
    return value


def add_node_flags(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """--node-kv-bytes (env KVFLEET_NODE_KV_BYTES)."""
    try:
        default = _positive((env or {}).get("KVFLEET_NODE_KV_BYTES", str(NODE_KV_BYTES)))
    except argparse.ArgumentTypeError as e:
        p.error(f"KVFLEET_NODE_KV_BYTES: {e}")
    p.add_argument("--node-kv-bytes", type=_positive, default=default,
                   help=f"KV bytes one Ray node may hold for sessions (cached blocks + private blocks); a node past it "
                        f"takes no new session, and with none left a create is RESOURCE_EXHAUSTED (default {NODE_KV_BYTES})")
