"""The WhoAmIs of tokens the proxy does not know yet: one at a time per token, and a few at once per client address.

Anyone who reaches the proxy can send a bearer token, and nothing tells a made-up token from a valid one the proxy
has not seen: each costs the controller a WhoAmI. The tokens not known yet share one share of the proxy's RPC slots
(controller/proxy/control.py), so a flood of them cannot take a known tenant's; but a legitimate token's *first*
request waited behind the flood's WhoAmIs in that share, up to the route timeout, then got a 503.
So a client address may have at most `per_client` distinct tokens in lookup at once (4 by default); a request past
that is answered 429 at once (Retry-After), with no WhoAmI: a flood of made-up tokens from one address costs the
controller `per_client` WhoAmIs at a time, and a token sent from another address is looked up at once. Requests with
the same token share its one lookup, so a client that sends many requests with a new token (every client's token is
new after a proxy restart) is never refused by this bound; nor is a token the controller named a tenant for whose
cached answer aged out (the caller passes no address for it: controller/proxy/control.py).
An IPv6 address counts as its /64 (what one host or one subscriber is given: it may send from any address in it),
an IPv4-mapped one as its IPv4 address. NOTE: before, each IPv6 address had a bound of its own, and one client
holding a /64 sent each made-up token from another address: the flood took the controller's WhoAmIs as if there
were no bound (test_proxy_token_lookups.py).
NOTE: the address is the connection's peer. Behind a load balancer that hides the clients' addresses (an ingress,
a Service with SNAT), all the clients behind it share one address's budget: a new token's first request during a
flood from behind it gets the 429, at once, where it waited up to the route timeout for a 503 before.
Cost: none for a known token (the proxy asks its own cache first); a token not known yet pays two dict lookups.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable

from controller.proxy.errors import ProxyError
from fleet.sdk import types

PER_CLIENT = 4  # distinct tokens in lookup at once from one client address
V6_PREFIX = 64  # an IPv6 client is its /64


def client_of(address: str) -> str:
    """The client an address counts as: itself (IPv4, or not an IP address), an IPv6 address's /64."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if ip.version == 4:
        return address
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.ip_network((ip, V6_PREFIX), strict=False))


class TokenLookups:
    """The lookups in flight: token -> its WhoAmI, client address -> how many it has."""

    def __init__(self, per_client: int = PER_CLIENT) -> None:
        self.per_client = per_client
        self._pending: dict[str | None, asyncio.Future[types.Caller]] = {}
        self._by_client: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._pending)

    async def look_up(self, token: str | None, client: str | None,
                      ask: Callable[[], Awaitable[types.Caller]]) -> types.Caller:
        """`ask()`'s answer for `token`, sent by `client` (None: no address, no bound); 429 past the client's bound.
        The lookup runs to its end even when the requests waiting on it go away (it counts until then)."""
        pending = self._pending.get(token)
        if pending is None:
            pending = self._start(token, client, ask)
        return await asyncio.shield(pending)

    def _start(self, token: str | None, client: str | None,
               ask: Callable[[], Awaitable[types.Caller]]) -> asyncio.Future[types.Caller]:
        if client is not None:
            client = client_of(client)
            num = self._by_client.get(client, 0)
            if num >= self.per_client:
                raise ProxyError(429, f"{num} bearer tokens the proxy does not know yet are being checked for your "
                                      "address already; send again shortly (a made-up or mistyped token is refused)")
            self._by_client[client] = num + 1
        task = asyncio.ensure_future(ask())
        self._pending[token] = task
        task.add_done_callback(lambda t: self._done(t, token, client))
        return task

    def _done(self, task: asyncio.Future[types.Caller], token: str | None, client: str | None) -> None:
        if not task.cancelled():
            task.exception()  # NOTE: retrieved here: a lookup whose requests all went away raised to no one
        if self._pending.get(token) is task:
            del self._pending[token]
        if client is not None:
            num = self._by_client.pop(client) - 1
            if num:
                self._by_client[client] = num
