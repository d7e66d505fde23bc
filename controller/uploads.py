"""Upload admission: what unfinished blob puts may hold, per tenant and in total, and for how long.

A put buffers its chunks until the stream ends (the store writes data and metadata in one step),
so every open stream holds memory. The gate reserves a put's announced size when its header
arrives and frees it when the put ends, whatever the outcome:

    header(size) ─ admit(tenant, size) ─► chunks … (progress within idle_s, then min_rate) ─► release

Invariants: the bytes reserved by a tenant never exceed `tenant_bytes`, nor `tenant_share` of what
the other tenants leave of `total_bytes` (so tenants that hold the budget always leave a share for
the next one); all reservations never exceed `total_bytes`, and the number of open puts never
exceeds `tenant_uploads` per tenant and `total_uploads` overall. A refusal is RESOURCE_EXHAUSTED
naming the quota and the flag that sets it.

Time: an upload's clock runs only while the server waits for the client's next message: time the
server spends on its own work (a store thread it waits for, the store write) is never the client's
(issue #28 item 3). On that clock, the upload must send bytes at least every `idle_s`, and after
the first `idle_s` it must average `min_rate` bytes a second: an upload of N bytes has at most
idle_s + N / min_rate seconds of the client's time. One byte per idle period used to count as
progress, and four tenants trickling so held the global budget indefinitely (issue #31 item 3).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TypeVar

from fleet.core.errors import InvalidArgument, ResourceExhausted

T = TypeVar("T")


class UploadStalled(ResourceExhausted):
    """An upload made no progress (no bytes) for `idle_s`, or fell below `min_rate`; its
    reservation is freed."""


class UploadRefused(ResourceExhausted):
    """An upload the budget of unfinished puts cannot take (a count or bytes cap, or the tenant's share)."""


@dataclass(frozen=True, slots=True)
class UploadLimits:
    """Caps on unfinished puts (flags of `kvfleet controller`, in parentheses)."""

    tenant_uploads: int = 8  # --max-uploads-per-tenant
    total_uploads: int = 64  # --max-uploads
    tenant_bytes: int = 256 << 20  # --max-upload-bytes-per-tenant
    total_bytes: int = 1 << 30  # --max-upload-bytes
    idle_s: float = 30.0  # --upload-idle-timeout
    min_rate: int = 64 << 10  # --upload-min-rate: bytes a second, after the first idle_s
    tenant_share: float = 0.5  # --upload-tenant-share: of the bytes other tenants leave free

    def __post_init__(self) -> None:
        for name in ("tenant_uploads", "total_uploads", "tenant_bytes", "total_bytes", "min_rate"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"upload limit {name} must be positive, got {getattr(self, name)}")
        if not self.idle_s > 0:
            raise InvalidArgument(f"--upload-idle-timeout must be positive seconds, got {self.idle_s}")
        if not 0 < self.tenant_share <= 1:
            raise InvalidArgument(f"--upload-tenant-share must be in (0, 1], got {self.tenant_share}")


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
        share = int(lim.tenant_share * (lim.total_bytes - (self.total_bytes - self.reserved[tenant])))
        if self.reserved[tenant] + size > share:
            return (f"tenant {tenant!r}: this upload of {_mib(size)} on top of {_mib(self.reserved[tenant])} in "
                    f"flight exceeds its share of the controller's upload budget ({_mib(share)}: "
                    f"--upload-tenant-share={lim.tenant_share:g} of what other tenants leave of "
                    f"--max-upload-bytes={lim.total_bytes}); finish other uploads first, or retry shortly")
        return None

    @contextlib.contextmanager
    def admit(self, tenant: str, size: int) -> Iterator[None]:
        """Reserve one upload of `size` bytes for `tenant` while the block runs; refuse over a cap."""
        why = self._refuse(tenant, size)
        if why is not None:
            raise UploadRefused(why)
        self.uploads[tenant] += 1
        self.reserved[tenant] += size
        try:
            yield
        finally:
            self.uploads[tenant] -= 1
            self.reserved[tenant] -= size
            self.uploads += Counter()  # drop zero entries
            self.reserved += Counter()


async def progressing(items: AsyncIterator[T], *, idle_s: float, min_rate: float = 0.0) -> AsyncIterator[T]:
    """Yield from `items` on the client's clock (it runs only while waiting for the next message,
    never while the consumer holds a message); raise UploadStalled when no message with bytes came
    for `idle_s` of it, or when, past the first `idle_s`, the bytes fall below `min_rate` a second
    (0: no rate).

    NOTE: only a message with bytes (len > 0) resets the idle clock, so a stream of empty chunks
    stalls too; the header counts as progress, not as bytes.
    """
    waited = idle = 0.0  # seconds waiting on the client: in all, and since the last bytes
    got = 0
    it = aiter(items)
    while True:
        left = idle_s - idle
        if min_rate:
            left = min(left, idle_s + got / min_rate - waited)
        t0 = time.monotonic()
        try:
            msg = await asyncio.wait_for(anext(it), timeout=max(left, 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            waited += time.monotonic() - t0
            if idle + time.monotonic() - t0 >= idle_s:
                raise UploadStalled(f"upload made no progress for {idle_s:g} s (no bytes received; limit "
                                    "--upload-idle-timeout); nothing was stored, send the chunks without pausing"
                                    ) from None
            raise UploadStalled(f"upload fell below the minimum rate of {min_rate:g} bytes/s ({got} bytes in "
                                f"{waited:.1f} s of waiting on the client; limit --upload-min-rate, after the first "
                                f"--upload-idle-timeout={idle_s:g} s); nothing was stored") from None
        dt = time.monotonic() - t0
        waited, idle = waited + dt, idle + dt
        n = _num_bytes(msg)
        if n is not None:
            idle, got = 0.0, got + n
        yield msg


def _num_bytes(msg: object) -> int | None:
    """The bytes a message carries (0 for the header), or None for a message without progress."""
    chunk = getattr(msg, "chunk", b"")
    if chunk:
        return len(chunk)
    return 0 if getattr(msg, "WhichOneof", lambda _: None)("kind") == "header" else None
