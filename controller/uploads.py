"""Upload admission: what unfinished blob puts may hold, per tenant and in total, and for how long.

A put buffers its chunks until the stream ends (the store writes data and metadata in one step),
so every open stream holds memory. The gate reserves a put's announced size when its header
arrives and frees it when the put ends, whatever the outcome:

    header(size) ─ admit(tenant, size) ─► chunks … (each must make progress within idle_s) ─► release

Invariants: the bytes reserved by a tenant never exceed `tenant_bytes`, all reservations never
exceed `total_bytes`, and the number of open puts never exceeds `tenant_uploads` per tenant and
`total_uploads` overall. A refusal is RESOURCE_EXHAUSTED naming the quota and the flag that sets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fleet.errors import InvalidArgument, ResourceExhausted

T = TypeVar("T")


class UploadStalled(ResourceExhausted):
    """An upload made no progress (no bytes) for `idle_s`; its reservation is freed."""


@dataclass(frozen=True, slots=True)
class UploadLimits:
    """Caps on unfinished puts (flags of `kvfleet controller`, in parentheses)."""

    tenant_uploads: int = 8  # --max-uploads-per-tenant
    total_uploads: int = 64  # --max-uploads
    tenant_bytes: int = 256 << 20  # --max-upload-bytes-per-tenant
    total_bytes: int = 1 << 30  # --max-upload-bytes
    idle_s: float = 30.0  # --upload-idle-timeout

    def __post_init__(self) -> None:
        for name in ("tenant_uploads", "total_uploads", "tenant_bytes", "total_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"upload limit {name} must be positive, got {getattr(self, name)}")
        if not self.idle_s > 0:
            raise InvalidArgument(f"--upload-idle-timeout must be positive seconds, got {self.idle_s}")


def _mib(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


class UploadGate:
    """Reservations of open puts. Used from the event loop only (no locks needed)."""

    def __init__(self, limits: UploadLimits) -> None:
        self.limits = limits
        self.uploads: Counter[str] = Counter()
        self.reserved: Counter[str] = Counter()

    @property
    def total_uploads(self) -> int:
        return sum(self.uploads.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.reserved.values())

    def _refuse(self, tenant: str, size: int) -> str | None:
        lim = self.limits
        if self.uploads[tenant] >= lim.tenant_uploads:
            return (f"tenant {tenant!r} already has {self.uploads[tenant]} unfinished uploads (quota "
                    f"--max-uploads-per-tenant={lim.tenant_uploads}); finish or cancel one, then retry")
        if self.total_uploads >= lim.total_uploads:
            return (f"the controller already has {self.total_uploads} unfinished uploads (limit "
                    f"--max-uploads={lim.total_uploads}); retry shortly")
        if self.reserved[tenant] + size > lim.tenant_bytes:
            return (f"tenant {tenant!r}: this upload of {_mib(size)} on top of {_mib(self.reserved[tenant])} in "
                    f"flight exceeds the quota --max-upload-bytes-per-tenant={lim.tenant_bytes} "
                    "; finish other uploads first, or raise the quota")
        if self.total_bytes + size > lim.total_bytes:
            return (f"this upload of {_mib(size)} on top of {_mib(self.total_bytes)} in flight exceeds the "
                    f"controller's limit --max-upload-bytes={lim.total_bytes}; retry shortly")
        return None

    @contextlib.contextmanager
    def admit(self, tenant: str, size: int) -> Iterator[None]:
        """Reserve one upload of `size` bytes for `tenant` while the block runs; refuse over a cap."""
        why = self._refuse(tenant, size)
        if why is not None:
            raise ResourceExhausted(why)
        self.uploads[tenant] += 1
        self.reserved[tenant] += size
        try:
            yield
        finally:
            self.uploads[tenant] -= 1
            self.reserved[tenant] -= size
            self.uploads += Counter()  # drop zero entries
            self.reserved += Counter()


async def progressing(items: AsyncIterator[T], *, idle_s: float) -> AsyncIterator[T]:
    """Yield from `items`, raising UploadStalled when no message with bytes came for `idle_s` seconds.

    NOTE: only a message with bytes (len > 0) resets the clock, so a stream of empty chunks stalls too.
    """
    last = time.monotonic()
    it = aiter(items)
    while True:
        left = idle_s - (time.monotonic() - last)
        try:
            msg = await asyncio.wait_for(anext(it), timeout=max(left, 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise UploadStalled(f"upload made no progress for {idle_s:g} s (no bytes received; limit "
                                "--upload-idle-timeout); nothing was stored, send the chunks without pausing") from None
        if _has_bytes(msg):
            last = time.monotonic()
        yield msg


def _has_bytes(msg: object) -> bool:
    chunk = getattr(msg, "chunk", b"")
    return bool(chunk) or getattr(msg, "WhichOneof", lambda _: None)("kind") == "header"
