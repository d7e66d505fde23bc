"""Local references: the same ops replayed in this process, to compare digests and logits with."""

from __future__ import annotations

from typing import Any

from fleet.context import SessionContext
from workers.host import AdoptingContext
from workers.spec import KernelSpec, make_kernel, make_tokenizer

SPEC = KernelSpec(block_size=16)


def replay_locally(ops: list[dict[str, Any]], store: Any = None, tenant: str = "default") -> SessionContext:
    kernel = make_kernel(SPEC)
    return AdoptingContext.replay(ops, kernel, make_tokenizer(kernel), lambda ref: store.get(ref, tenant), tenant)


def prefilled(system_prompt: str) -> SessionContext:
    """A session that prefilled its system prompt itself (no adopted blocks)."""
    kernel = make_kernel(SPEC)
    ctx = SessionContext.new(kernel, make_tokenizer(kernel))
    ctx.add_system(system_prompt)
    return ctx
