"""A SessionKernel with no Ray: the numpy kernel and the byte tokenizer, its lanes on the calling thread."""

from __future__ import annotations

from typing import Any

from fleet.core.kernel import ByteTokenizer
from workers.session_kernel import SessionKernel
from workers.spec import KernelSpec, make_kernel


async def inline(tenant: str, fn: Any) -> Any:  # the host's lanes, on the calling thread
    return fn()


def inline_session(store: Any, session_id: str = "s1", lane: Any = inline) -> SessionKernel:
    """Tenant acme's session `session_id` over `store`; `lane` runs its kernel work (default: at once)."""
    kernel = make_kernel(KernelSpec(block_size=16))
    return SessionKernel("acme", session_id, kernel, ByteTokenizer(kernel.config.vocab_size), store, lane)
