"""What a routing decision is, on both sides of the wire: the router builds these (controller/router.py,
controller/cost.py), the Route RPC carries them (controller/servicers/convert.py), and the SDK gives the
same types back to its callers (fleet/sdk/types.py). One definition each.

NamedTuples, not dataclasses: the router builds one RouteCost and one RouteCandidate per candidate on
every route, and a NamedTuple is about three times cheaper to build than a frozen slotted dataclass.
"""

from __future__ import annotations

from typing import NamedTuple

WARM, COLD = "WARM", "COLD"


def verdict_of(matched_tokens: int) -> str:
    """The one rule: a route is WARM when the chosen rank holds a prefix of the prompt (>= 1 block), else COLD."""
    return WARM if matched_tokens > 0 else COLD


class RouteCost(NamedTuple):
    """A candidate's cost in prefill-token units (docs/routing.md):
    prefill - (1 - share) * amortized + queue_weight * queued + request_weight * active + pressure_weight * evicted,
    share: shared_prefix_weight, or mixed_prefix_weight where that is larger and the rank serves another prefix."""

    total: float
    prefill_tokens: int
    cached_tokens: int
    queued_tokens: float
    active_requests: float
    evicted_tokens: int
    amortized_tokens: int = 0  # of prefill_tokens: a shared prefix the rank lacks (counted at its share)


class RouteCandidate(NamedTuple):
    worker: str
    dp_rank: int
    matched_tokens: int
    cost: RouteCost | None = None


class RouteDecision(NamedTuple):
    """Where to send a request: the cheapest serving candidate. verdict is "WARM" (prefix resident and
    worker serving) or "COLD".

    Send `cache_salt` to vLLM with the request so the worker's block hashes match the router's.
    `candidates` are every serving candidate, cheapest first (the proxy fails over in this order);
    `cost` is the chosen candidate's cost terms, `runner_up` the cheapest one not chosen.
    `route_id` is set when the route was tracked (the router's in-flight ledger); release it
    (ReleaseRoute) when the request ends.
    """

    worker: str
    url: str
    dp_rank: int
    verdict: str
    matched_tokens: int
    epoch: int
    cache_salt: str
    candidates: tuple[RouteCandidate, ...] = ()
    route_id: str = ""
    cost: RouteCost | None = None
    runner_up: RouteCandidate | None = None

    @property
    def warm(self) -> bool:
        return self.verdict == WARM
