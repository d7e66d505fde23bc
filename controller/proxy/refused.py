"""Tokens the controller refused lately: answered 401 by the proxy itself for a few seconds.

Anyone who reaches the proxy can send a bearer token, and each token the proxy does not know costs the controller a
WhoAmI; a client retrying a revoked or mistyped token asked it on every request. A refusal is kept `ttl_s` (2 s by
default) and at most `max_entries` of them (the least recently used goes first), so a client's retries cost one
WhoAmI a window.
NOTE: a refused token does not become valid by a mint: `kvfleet controller --mint-token` makes a new random token
(256 bits, controller/auth.py), so a token minted meanwhile was never the refused one. It can become valid only
when its hash is put back in the tokens file (a restored backup), or when the controller reads a tokens file older
than the client's token (a Secret mount not updated yet): then the client waits at most `ttl_s` more.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from fleet.core.errors import Unauthenticated


class RefusedTokens:
    """token -> the controller's refusal, kept `ttl_s` (0: nothing kept), at most `max_entries` at once (LRU)."""

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl_s, self._clock = max_entries, ttl_s, clock
        self._refused: OrderedDict[str | None, tuple[float, str]] = OrderedDict()  # token -> (until, message)

    def __len__(self) -> int:
        return len(self._refused)

    def get(self, token: str | None) -> Unauthenticated | None:
        """The refusal of `token`, while it lasts (a new exception each time: one raised again and again would
        keep every traceback it went through)."""
        hit = self._refused.get(token)
        if hit is None:
            return None
        if hit[0] <= self._clock():
            del self._refused[token]
            return None
        self._refused.move_to_end(token)
        return Unauthenticated(hit[1])

    def add(self, token: str | None, refusal: Unauthenticated) -> None:
        if self.ttl_s <= 0 or self.max_entries <= 0:
            return
        self._refused[token] = (self._clock() + self.ttl_s, str(refusal))
        self._refused.move_to_end(token)
        while len(self._refused) > self.max_entries:
            self._refused.popitem(last=False)
