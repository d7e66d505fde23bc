"""Upload admission: what unfinished blob puts may hold, per tenant and in total, and for how long.

A put buffers its chunks until the stream ends (the store writes data and metadata in one step),
so every open stream holds memory. The gate counts a put from its start (a put waiting for its header
holds a server RPC slot), reserves its announced size when its header arrives, and frees both when the
put ends, whatever the outcome:

    admit(tenant, 0) ─ header(size) ─ grow(size) ─► chunks … (progress within idle_s, then min_rate) ─► release

Invariants: the bytes reserved by a tenant never exceed `tenant_bytes`, nor `tenant_share` of what
the other tenants leave of `total_bytes` (so tenants that hold the budget always leave a share for
the next one); all reservations never exceed `total_bytes`. The number of open puts never exceeds
`tenant_uploads` per tenant, `total_uploads` overall, nor (the same rule as the bytes) `tenant_share`
of the count the other tenants leave, rounded down but at least one. Guarantee: a tenant with no
open put is refused by the count only when all `total_uploads` are held, and at the defaults (64,
8 per tenant, 1/2) no fewer than 11 tenants can hold all 64: while at most 10 tenants hold puts,
any other tenant gets one. The same holds for gets (GetLimits: 64, 8, 1/2). A refusal is
RESOURCE_EXHAUSTED naming the quota and the flag that sets it.

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
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from controller.stream_gate import GateCaps, StreamGate
from fleet.core.errors import InvalidArgument, ResourceExhausted

T = TypeVar("T")


class UploadStalled(ResourceExhausted):
    """An upload made no progress (no bytes) for `idle_s`, or fell below `min_rate`; its
    reservation is freed."""


class UploadRefused(ResourceExhausted):
    """An upload the budget of unfinished puts cannot take (a count or bytes cap, or the tenant's share)."""


class GetRefused(ResourceExhausted):
    """A GetBlob the budget of open gets cannot take (a count or bytes cap, or the tenant's share)."""


class GetStalled(ResourceExhausted):
    """A GetBlob whose client took no message for `GetLimits.idle_s`; it reads the store no further."""


@dataclass(frozen=True, slots=True)
class GetLimits:
    """Caps on open GetBlob streams (flags of `kvfleet controller`, in parentheses).

    A get holds at most one store read batch (max(1 MiB, its chunk size), at most 2 MiB) of the blob in
    Python, plus the one message gRPC is writing: its reservation is min(blob size, read batch). So the
    count caps bound memory and server RPC slots; the byte caps are equal to them for large blobs (8 x 2 MiB)
    and stay a bound if a count is raised alone.
    """

    tenant_gets: int = 8  # --max-gets-per-tenant
    total_gets: int = 64  # --max-gets
    tenant_bytes: int = 16 << 20  # --max-get-bytes-per-tenant
    total_bytes: int = 128 << 20  # --max-get-bytes
    idle_s: float = 30.0  # --get-idle-timeout: seconds the client may take no message
    tenant_share: float = 0.5  # of the bytes other tenants leave free (as --upload-tenant-share)

    def __post_init__(self) -> None:
        for name in ("tenant_gets", "total_gets", "tenant_bytes", "total_bytes"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"get limit {name} must be positive, got {getattr(self, name)}")
        if not self.idle_s > 0:
            raise InvalidArgument(f"--get-idle-timeout must be positive seconds, got {self.idle_s}")
        if not 0 < self.tenant_share <= 1:
            raise InvalidArgument(f"get tenant_share must be in (0, 1], got {self.tenant_share}")


@dataclass(frozen=True, slots=True)
class UploadLimits:
    """Caps on unfinished puts (flags of `kvfleet controller`, in parentheses); `gets`: on open gets."""

    tenant_uploads: int = 8  # --max-uploads-per-tenant
    total_uploads: int = 64  # --max-uploads
    tenant_bytes: int = 256 << 20  # --max-upload-bytes-per-tenant
    total_bytes: int = 1 << 30  # --max-upload-bytes
    idle_s: float = 30.0  # --upload-idle-timeout
    min_rate: int = 64 << 10  # --upload-min-rate: bytes a second, after the first idle_s
    tenant_share: float = 0.5  # --upload-tenant-share: of the bytes other tenants leave free
    gets: GetLimits = field(default_factory=GetLimits)  # GetBlob's gate (--max-gets*, --get-idle-timeout)

    def __post_init__(self) -> None:
        for name in ("tenant_uploads", "total_uploads", "tenant_bytes", "total_bytes", "min_rate"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"upload limit {name} must be positive, got {getattr(self, name)}")
        if not self.idle_s > 0:
            raise InvalidArgument(f"--upload-idle-timeout must be positive seconds, got {self.idle_s}")
        if not 0 < self.tenant_share <= 1:
            raise InvalidArgument(f"--upload-tenant-share must be in (0, 1], got {self.tenant_share}")


GET_FLAGS: dict[str, tuple[str, type, str]] = {  # flag -> (GetLimits field, type, help); `kvfleet controller`
    "--max-gets-per-tenant": ("tenant_gets", int, "open GetBlob streams per tenant"),
    "--max-gets": ("total_gets", int, "open GetBlob streams in total"),
    "--max-get-bytes-per-tenant": ("tenant_bytes", int, "blob bytes a tenant's open gets may hold at once"),
    "--max-get-bytes": ("total_bytes", int, "blob bytes all open gets may hold at once"),
    "--get-idle-timeout": ("idle_s", float, "seconds a GetBlob's client may take no message before it is ended"),
}


def add_get_flags(p: Any, env: Mapping[str, str]) -> None:
    """GetLimits as flags (and KVFLEET_ + the flag in capitals); defaults in --help."""
    d = GetLimits()
    for flag, (name, kind, text) in GET_FLAGS.items():
        var = "KVFLEET_" + flag[2:].upper().replace("-", "_")
        p.add_argument(flag, type=kind, default=env.get(var), dest=f"get_{name}",
                       help=f"{text} (default {getattr(d, name)}; env {var})")


def with_get_limits(config: dict[str, Any], args: Any) -> dict[str, Any]:
    """`config` (ControllerConfig keywords with an `uploads`) with the GetLimits flags given in `args`."""
    given = {}
    for flag, (name, _, _) in GET_FLAGS.items():
        value = getattr(args, f"get_{name}", None)
        if value is not None:
            if not value > 0:
                raise InvalidArgument(f"{flag} must be positive, got {value}")
            given[name] = value
    if given:
        config["uploads"] = replace(config["uploads"], gets=GetLimits(**given))
    return config


class UploadGate(StreamGate):
    """Reservations of open puts: a put's announced size, from its header until it ends."""

    def __init__(self, limits: UploadLimits) -> None:
        self.limits = limits
        super().__init__(GateCaps(limits.tenant_uploads, limits.total_uploads, limits.tenant_bytes, limits.total_bytes,
                               limits.tenant_share, "unfinished uploads", "upload",
                               ("--max-uploads-per-tenant", "--max-uploads", "--max-upload-bytes-per-tenant",
                                "--max-upload-bytes", "--upload-tenant-share"),
                               "finish or cancel one, then retry", UploadRefused))

    @property
    def uploads(self) -> Counter[str]:
        return self.open

    @property
    def total_uploads(self) -> int:
        return self.total_open


class GetGate(StreamGate):
    """Reservations of open GetBlob streams: the blob bytes a get may hold at once, from its first store read
    until it ends (read to the end, refused, stalled, or cancelled by its client).

    A stalled get (its client took no message for `idle_s`) frees its reservation at once and is counted in
    `unread` until its client has taken its status or cancelled. NOTE: gRPC Python cannot reset a server
    stream: the status waits in gRPC behind the message the client does not take (HTTP/2 flow control), with
    that message (up to a chunk) and a server RPC slot, for as long as the client keeps the call open. Before,
    the get kept its slot and bytes in the gate that long too (8 unread gets without a deadline held all of a
    tenant's 8 slots and 8 MiB for the 20 s the review waited, at --get-idle-timeout 0.3 s). A tenant with
    `tenant_gets` such calls is refused new gets until its client reads or cancels them, so one tenant's
    unread calls cannot take the server's RPC slots.
    """

    def __init__(self, limits: GetLimits) -> None:
        self.limits = limits
        self.unread: Counter[str] = Counter()
        super().__init__(GateCaps(limits.tenant_gets, limits.total_gets, limits.tenant_bytes, limits.total_bytes,
                               limits.tenant_share, "open GetBlob streams", "get",
                               ("--max-gets-per-tenant", "--max-gets", "--max-get-bytes-per-tenant",
                                "--max-get-bytes", "the fixed tenant share"),
                               "read or cancel one, then retry", GetRefused))

    def _refuse(self, tenant: str, size: int) -> str | None:
        """Stalled calls still hold a server RPC slot each: a tenant's open and unread gets together stay within
        --max-gets-per-tenant, and everyone's within --max-gets. NOTE: the unread calls alone were checked, so a
        tenant with 7 of them opened 8 more (15 held slots), and nothing bounded them across tenants."""
        mine, unread_all = self.open[tenant] + self.unread[tenant], self.total_open + sum(self.unread.values())
        if self.unread[tenant] and mine >= self.limits.tenant_gets:
            return (f"tenant {tenant!r} has {self.open[tenant]} open GetBlob streams and {self.unread[tenant]} ended "
                    f"because their client took no message for {self.limits.idle_s:g} s (--get-idle-timeout) and has "
                    f"neither read their status nor cancelled them (quota --max-gets-per-tenant="
                    f"{self.limits.tenant_gets}); cancel them")
        if self.unread and unread_all >= self.limits.total_gets:
            return (f"the controller already has {unread_all} GetBlob calls open or ended unread (limit "
                    f"--max-gets={self.limits.total_gets}); retry shortly")
        return super()._refuse(tenant, size)

    @contextlib.contextmanager
    def stalled(self, tenant: str) -> Iterator[None]:
        """Count one of `tenant`'s stalled gets in `unread` while the block (sending its status) runs."""
        self.unread[tenant] += 1
        try:
            yield
        finally:
            self.unread[tenant] -= 1
            self.unread += Counter()


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


async def written(write: Awaitable[None], idle_s: float) -> bool:
    """Start a server-stream write and wait for it on the client's clock (gRPC takes a message once the
    client's flow-control window has room, i.e. once the client reads): True when it was taken within
    `idle_s`. Else the wait is given up (False) and the message stays queued in gRPC; the caller then
    raises GetStalled, whose status gRPC sends after that message.

    NOTE: the caller used to await the pending write before it raised, so a client that set no deadline
    and never read again held the get's slot and bytes until it cancelled (review: 20 s at an idle
    timeout of 0.3 s, and the stall was never counted)."""
    task = asyncio.ensure_future(write)
    try:
        done, _ = await asyncio.wait((task,), timeout=idle_s)
    except BaseException:
        task.cancel()
        raise
    if done:
        task.result()
        return True
    task.cancel()  # our wait only: gRPC keeps the message and sends it if the client reads again
    return False


def _num_bytes(msg: object) -> int | None:
    """The bytes a message carries (0 for the header), or None for a message without progress."""
    chunk = getattr(msg, "chunk", b"")
    if chunk:
        return len(chunk)
    return 0 if getattr(msg, "WhichOneof", lambda _: None)("kind") == "header" else None
