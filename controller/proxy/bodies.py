"""What the request bodies in flight may hold in the proxy, per tenant and in all.

Every request holds its body from its headers until its answer ends: the JSON object, the encoded copy
sent to the worker (about three times the body in all), and while it is tokenized and routed its token ids
too (about twelve times the body for the moment of the route: a list of Python ints). Unbounded, one
tenant's concurrent requests of 8 MiB each could hold all of the proxy's memory, and before the proxy
knew who sent them (the body was read before the token was checked).

So a request's caller is known first (401 before its body is read), then its body's announced size
(Content-Length, or --max-body-bytes when it is sent chunked) is reserved until its answer ends, under
the same rules as the controller's uploads (controller/uploads.py): at most `max_inflight_bytes_per_tenant`
per tenant, `max_inflight_bytes` in all, and no tenant more than half of what the other tenants leave. Past
a bound: 429 naming the flag, with Retry-After.
"""

from __future__ import annotations

from controller.proxy.config import ProxyConfig
from controller.stream_gate import GateCaps, StreamGate
from fleet.core.errors import ResourceExhausted


class BodiesRefused(ResourceExhausted):
    """A request whose body the proxy's budget of bodies in flight cannot take (`local`: the proxy's own refusal,
    controller/proxy/errors.py from_fleet)."""

    local = True


class BodyGate(StreamGate):
    """Reservations of the request bodies in flight (the count of requests is bounded by their bytes only)."""

    def __init__(self, cfg: ProxyConfig) -> None:
        super().__init__(GateCaps(None, None, cfg.max_inflight_bytes_per_tenant, cfg.max_inflight_bytes, 0.5,
                               "requests in flight", "request",
                               ("", "", "--max-inflight-bytes-per-tenant", "--max-inflight-bytes",
                                "the fixed tenant share"),
                               "", BodiesRefused, where="the proxy"))
