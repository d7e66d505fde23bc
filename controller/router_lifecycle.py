"""The lifecycle verbs through the router (controller/router.py's Router takes these as a mixin, on RouterWorkers):
sleep, wake, pause, resume and reset, each planned by the pure core (fleet/core/lifecycle.py), run by the worker's
watcher (controller/vllm/verbs.py) and answered with its witness.

A verb first takes the worker out of routing; before it acts, it waits for the tracked routes this router decided for
that worker just before (`_settle`: the reconcile grace of the in-flight ledger, controller/inflight.py), so it does not
overtake a request still on its way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from controller.router_workers import RouterWorkers
from fleet.core import lifecycle as lc
from fleet.core.errors import InvalidArgument
from fleet.core.lifecycle import Witness


class RouterLifecycle(RouterWorkers):
    """One lifecycle verb on a registered worker, settled against the routes on their way to it."""

    async def lifecycle(
        self,
        name: str,
        verb: str,
        *,
        level: int | None = None,
        mode: str | None = None,
        tags: list[str] | None = None,
        clear_cache: bool | None = None,
        dp_rank: int | None = None,
        reset_running_requests: bool | None = None,
    ) -> Witness:
        """Drive one lifecycle verb through the controller and return its witness.

        NOTE: vLLM's verbs act on the whole engine (every DP rank); `dp_rank` only selects which
        rank's epoch the witness reports.
        """
        w = self._get(name)
        call = lc.plan(verb, level=level, mode=mode, tags=tags, clear_cache=clear_cache,
                       reset_running_requests=reset_running_requests)
        if dp_rank is not None and dp_rank not in w.ranks:
            ids = w.spec.dp_rank_ids
            raise InvalidArgument(f"dp_rank {dp_rank} out of range for {name} ({ids.start}..{ids.stop - 1})")
        wit = await w.lifecycle(call, settle=lambda: self._settle(name))
        return dataclasses.replace(wit, epoch=w.ranks[w.spec.dp_rank_start if dp_rank is None else dp_rank].epoch)

    async def _settle(self, name: str) -> None:
        """Wait until every tracked route decided for `name` has had the reconcile grace to reach it.

        NOTE: a verb first takes the worker out of routing, so nothing is added while this waits; but a route
        decided just before is still on its way (the proxy forwards it after the answer). A sleep that overtook it
        left the request queued on a sleeping engine (fleet-routing-real, short-chats, through the controller),
        and a reset that overtook a WARM route wiped the blocks it was counted on. A released route has ended and
        is not waited for; untracked routes (an SDK caller asking "where?") are not known here.
        """
        newest = self.flights.newest(name)
        if newest is not None and (wait := newest + self.flights.grace_s - time.monotonic()) > 0:
            self.metrics.lifecycle_settles.inc()
            await asyncio.sleep(wait)
