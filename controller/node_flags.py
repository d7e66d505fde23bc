"""The per-node budget flags of the session fleet (shared by `kvfleet controller` and `up`).

Each Ray node's kernel host holds at most `--node-kv-bytes` of KV (its radix cache's blocks plus its
sessions' private blocks, workers/host_slots.py `used_bytes`) and at most `--node-max-sessions` sessions.
Placement skips a node whose budget is spent; when no node has room, creating a session is
RESOURCE_EXHAUSTED (workers/placement.py)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from fleet.core.whole import whole
from workers.placement import NODE_KV_BYTES, NODE_MAX_SESSIONS

_positive = whole(1)


def _from_env(p: argparse.ArgumentParser, env: Mapping[str, str] | None, name: str, default: int) -> int:
    try:
        return _positive((env or {}).get(name, str(default)))
    except argparse.ArgumentTypeError as e:
        p.error(f"{name}: {e}")


def add_node_flags(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """--node-kv-bytes (env KVFLEET_NODE_KV_BYTES) and --node-max-sessions (env KVFLEET_NODE_MAX_SESSIONS)."""
    default = _from_env(p, env, "KVFLEET_NODE_KV_BYTES", NODE_KV_BYTES)
    p.add_argument("--node-kv-bytes", type=_positive, default=default,
                   help=f"KV bytes one Ray node may hold for sessions (cached blocks + private blocks); a node past it "
                        f"takes no new session, and with none left a create is RESOURCE_EXHAUSTED (default {NODE_KV_BYTES})")
    most = _from_env(p, env, "KVFLEET_NODE_MAX_SESSIONS", NODE_MAX_SESSIONS)
    p.add_argument("--node-max-sessions", type=_positive, default=most,
                   help=f"sessions one Ray node's kernel host may hold; a full host takes no new session "
                        f"(default {NODE_MAX_SESSIONS})")
