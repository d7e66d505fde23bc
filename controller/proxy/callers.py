"""The WhoAmI answers the proxy holds, by token: at most MAX_CALLERS of them, shared fairly between tenants.

Each answer names its token's tenant. Past the bound, the tenant holding the most answers loses its oldest
(controller/owned.py), so a tenant that uses many tokens (one per end user of its app) pushes out its own answers,
never another tenant's.
NOTE: past 10,000 answers every one was dropped at once: each new token of such a tenant made every other tenant's
next request wait for a WhoAmI again, in the one share of the tokens not known yet and held to the bound per client
address (controller/proxy/lookups.py: a gateway's fifth token got a 429). An answer is used for auth_cache_s at most
(ControlClient.whoami reads its expiry); one that aged out stays, its tenant's, until asked for again or pushed out.
"""

from __future__ import annotations

from controller.owned import OwnedLru
from fleet.sdk import types

MAX_CALLERS = 10000  # answers held, all tenants together (about 300 bytes each)
Hit = tuple[float, types.Caller]  # (when it expires, monotonic; the answer)


class KnownCallers:
    """token -> (expiry, WhoAmI answer); past `cap`, the tenant with the most answers loses its oldest."""

    def __init__(self, cap: int | None = None) -> None:
        self._lru: OwnedLru[str | None, Hit] = OwnedLru(MAX_CALLERS if cap is None else cap)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, token: object) -> bool:
        return token in self._lru

    def __getitem__(self, token: str | None) -> Hit:
        hit = self._lru.get(token)
        if hit is None:
            raise KeyError(token)
        return hit

    def __setitem__(self, token: str | None, hit: Hit) -> None:
        self._lru.put(token, hit[1].tenant, hit)

    def get(self, token: str | None) -> Hit | None:
        return self._lru.get(token)

    def pop(self, token: str | None, default: Hit | None = None) -> Hit | None:
        hit = self._lru.pop(token)
        return default if hit is None else hit
