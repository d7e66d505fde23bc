"""A gate on open streams: how many a tenant and all tenants may hold, and how many bytes, with each tenant's share
of what the others leave (controller/uploads.py: blob puts and gets; controller/proxy/bodies.py: request bodies).

Used from the event loop only (no locks). A refusal is the caps' `refused` error, naming the quota and its flag.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from fleet.core.errors import ResourceExhausted


def _mib(n: int) -> str:
    return f"{n} bytes" if n < 1 << 20 else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True, slots=True)
class GateCaps:
    """What one gate bounds, and the words and flags its refusals use."""

    tenant_n: int | None  # None: no count cap (the bytes bound it)
    total_n: int | None
    tenant_bytes: int
    total_bytes: int
    share: float
    what: str  # "unfinished uploads", "open gets"
    one: str  # "upload", "get"
    flags: tuple[str, str, str, str, str]  # tenant_n, total_n, tenant_bytes, total_bytes, share
    advice: str  # what the tenant may do when its own count is full
    refused: type[ResourceExhausted]
    where: str = "the controller"  # whose budget it is, in a refusal


class StreamGate:
    """Reservations of open streams (count and bytes, per tenant and in total). Used from the event loop only
    (no locks needed)."""

    def __init__(self, caps: GateCaps) -> None:
        self.caps = caps
        self.open: Counter[str] = Counter()
        self.reserved: Counter[str] = Counter()

    @property
    def total_open(self) -> int:
        return sum(self.open.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.reserved.values())

    def _refuse(self, tenant: str, size: int) -> str | None:
        c, (f_tn, f_n, _, _, f_share) = self.caps, self.caps.flags
        if c.tenant_n is not None and self.open[tenant] >= c.tenant_n:
            return (f"tenant {tenant!r} already has {self.open[tenant]} {c.what} (quota "
                    f"{f_tn}={c.tenant_n}); {c.advice}")
        if c.total_n is not None and self.total_open >= c.total_n:
            return f"{c.where} already has {self.total_open} {c.what} (limit {f_n}={c.total_n}); retry shortly"
        if c.total_n is not None and self.open[tenant] + 1 > (share_n := self._share_n(tenant, c.total_n)):
            return (f"tenant {tenant!r} already has {self.open[tenant]} {c.what}, its share of {c.where}'s "
                    f"{share_n} ({f_share}={c.share:g} of what other tenants leave of {f_n}={c.total_n}); "
                    f"{c.advice}")
        return self._refuse_bytes(tenant, size)

    def _refuse_bytes(self, tenant: str, size: int) -> str | None:
        """Why `size` more bytes for `tenant` would break a bytes cap or share (None: they fit)."""
        c, (_, _, f_tb, f_b, f_share) = self.caps, self.caps.flags
        if self.reserved[tenant] + size > c.tenant_bytes:
            return (f"tenant {tenant!r}: this {c.one} of {_mib(size)} on top of {_mib(self.reserved[tenant])} in "
                    f"flight exceeds the quota {f_tb}={c.tenant_bytes}; finish other {c.one}s first, or raise "
                    "the quota")
        if self.total_bytes + size > c.total_bytes:
            return (f"this {c.one} of {_mib(size)} on top of {_mib(self.total_bytes)} in flight exceeds "
                    f"{c.where}'s limit {f_b}={c.total_bytes}; retry shortly")
        share = int(c.share * (c.total_bytes - (self.total_bytes - self.reserved[tenant])))
        if self.reserved[tenant] + size > share:
            return (f"tenant {tenant!r}: this {c.one} of {_mib(size)} on top of {_mib(self.reserved[tenant])} in "
                    f"flight exceeds its share of {c.where}'s {c.one} budget ({_mib(share)}: "
                    f"{f_share}={c.share:g} of what other tenants leave of "
                    f"{f_b}={c.total_bytes}); finish other {c.one}s first, or retry shortly")
        return None

    def _share_n(self, tenant: str, total_n: int) -> int:
        """How many streams `tenant` may hold: `share` of the count the other tenants leave, and at least one
        (a tenant with none is refused by the count only when all `total_n` are held).

        NOTE: without it the counts had no share: 8 tenants x 8 header-only puts (1 KiB reserved) held all 64
        slots and every other tenant was refused. With it, at the defaults (64 in all, 8 per tenant, 1/2),
        the fewest tenants that hold all 64 is 11 (7 x 8, then 4, 2, 1 and 1, each tenant's last stream taken
        when the ones before hold theirs). Rounded down without the floor of one, 10 tenants held 63 and no
        one could take the last slot.
        """
        others = self.total_open - self.open[tenant]
        if not others:  # NOTE: alone, a tenant was held to a share of the total: --max-uploads 8 gave it 4 of its 8
            return total_n
        return max(1, int(self.caps.share * (total_n - others) + 1e-9))  # 1e-9: int(0.57 * 100) is 56

    def check(self, tenant: str, size: int) -> None:
        """Refuse (the gate's error, naming the cap) what `admit` would refuse now; reserve nothing."""
        why = self._refuse(tenant, size)
        if why is not None:
            raise self.caps.refused(why)

    @contextlib.contextmanager
    def admit(self, tenant: str, size: int) -> Iterator[Held]:
        """Reserve one stream of `size` bytes for `tenant` while the block runs; refuse over a cap. Yields the
        reservation: `held(n)` shrinks it to n bytes, `held.grow(n)` grows it to n (refused over a bytes cap)."""
        self.check(tenant, size)
        self.open[tenant] += 1
        self.reserved[tenant] += size
        held = Held(self, tenant, size)
        try:
            yield held
        finally:
            self.open[tenant] -= 1
            self.reserved[tenant] -= held.size
            self.open += Counter()  # drop zero entries
            self.reserved += Counter()


class Held:
    """One admitted stream's bytes in its gate (StreamGate.admit)."""

    def __init__(self, gate: StreamGate, tenant: str, size: int) -> None:
        self.gate, self.tenant, self.size = gate, tenant, size

    def __call__(self, n: int) -> None:
        """From now on the stream holds only n bytes (at most what it holds)."""
        n = max(0, min(n, self.size))
        self.gate.reserved[self.tenant] -= self.size - n
        self.size = n

    def grow(self, n: int) -> None:
        """From now on the stream holds n bytes (at least what it holds); refused (the gate's error, naming the
        cap) if they do not fit, the reservation then unchanged."""
        more = max(0, n - self.size)
        why = self.gate._refuse_bytes(self.tenant, more)
        if why is not None:
            raise self.gate.caps.refused(why)
        self.gate.reserved[self.tenant] += more
        self.size += more
