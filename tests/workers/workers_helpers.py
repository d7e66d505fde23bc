"""Local references: the same ops replayed in this process, to compare digests and logits with."""

from __future__ import annotations

from typing import Any

from fleet.kernel import Session
from workers.host import SessionHost
from workers.spec import KernelSpec, make_kernel

SPEC = KernelSpec(block_size=16)


def replay_locally(spec: KernelSpec, ops: list[dict[str, Any]]) -> Session:
    host = SessionHost(make_kernel(spec))
    host.replay(ops)
    assert host.session is not None
    return host.session
