"""The proxy's view of the fleet: registered workers (ListWorkers), their model cards, local suspicion.

The controller's Route answer is authoritative for where to go; the directory supplies what a route
answer does not carry: the URLs of the fallback candidates, which workers are serving right now,
the union of the workers' /v1/models cards, and a short local "suspect" mark on a worker the proxy
itself found asleep or gone behind the controller's back, or that failed several attempts in a row (so later
requests skip it until the controller's reconcile loop catches up, instead of each paying a failed attempt). Its `watch` (controller/proxy/watch.py)
is what the requests waiting on one worker's first byte share; a worker the controller stops listing as
serving is nudged there, so its waiters ask it at once whether it sleeps, unless the controller lists it draining
(a pause with mode=wait or a reset of its own: the requests already running there finish there); the drain's end, the
worker listed paused or sleeping, nudges them too (those still waiting were queued, and wait there for the resume or
the wake). A worker the controller stops
listing at all (unregistered) is forgotten: its cards and suspect mark here, and whatever `on_gone` drops
(the proxy's per-worker metrics and first-byte waits).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import aiohttp

from controller.proxy.config import ProxyConfig
from controller.proxy.control import ControlClient
from controller.proxy.errors import ProxyError
from controller.proxy.suspects import SuspectMarks
from controller.proxy.watch import WorkerWatch
from controller.vllm.http import read_capped
from fleet.core.errors import KvfleetError, PermissionDenied, Unauthenticated
from fleet.sdk.types import WorkerInfo

log = logging.getLogger("kvfleet.proxy")
MAX_MODELS_BYTES = 1 << 20  # the most of a worker's /v1/models answer read (its cards)


def _valid_card(c: Any) -> bool:
    """A /v1/models card the proxy can route by: an object with a non-empty string id and a string or null parent
    (before, one worker's `{"data": [1]}` made every request of every tenant a 500)."""
    return (isinstance(c, dict) and isinstance(c.get("id"), str) and bool(c["id"])
            and isinstance(c.get("parent"), str | None))


def _card(model_id: str, parent: str | None = None) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "kvfleet", "root": model_id,
            "parent": parent}


class Resolved(NamedTuple):
    """What a request's `model` names. `base`: the registered model of the workers that list it, what the proxy
    tokenizes with and routes on; `lora`: the adapter, or None; `name`: what the forwarded body names, the client's
    own (a LoRA, a --served-model-name alias or the model's name), or the first served name when it gave none."""

    base: str
    lora: str | None
    name: str


def _listing_error(e: KvfleetError) -> str:
    """Why the directory cannot list the workers, with what to do. NOTE: every error said "give it a reader (or
    operator) token (--token)", a refused connection too (found by review): a token is the fix only when the
    controller refused the proxy's; an unreachable controller is named as such (fleet.sdk.base.to_error)."""
    if isinstance(e, Unauthenticated | PermissionDenied):
        return f"{e}; give the proxy a reader (or operator) token (--token, or KVFLEET_PROXY_TOKEN or KVFLEET_TOKEN)"
    return str(e)


class WorkerDirectory:
    """Workers by name, refreshed every cfg.refresh_s; model cards every cfg.models_refresh_s."""

    def __init__(self, cfg: ProxyConfig, control: ControlClient, http: aiohttp.ClientSession,
                 on_gone: Callable[[str], None] | None = None,
                 on_listed: Callable[[frozenset[str]], None] | None = None) -> None:
        self.cfg, self.control, self.http, self.on_gone, self.on_listed = cfg, control, http, on_gone, on_listed
        self.workers: dict[str, WorkerInfo] = {}
        self.cards: dict[str, list[dict[str, Any]]] = {}  # worker name -> its /v1/models cards
        self._cards_at: dict[str, float] = {}
        self.marks = SuspectMarks(cfg.suspect_s, cfg.suspect_after_failures)  # workers found asleep or gone here
        self._rr = itertools.count()
        self.last_error: str | None = "not refreshed yet"
        self.loaded_at: float | None = None  # monotonic time of the last refresh that listed the workers
        self._task: asyncio.Task[None] | None = None
        self._drains_ask: asyncio.Future[frozenset[str]] | None = None  # drains_now's ListWorkers call in flight
        self.watch = WorkerWatch()  # the requests waiting for each worker's first byte: their probe and its finding

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.refresh_s)
            await self.refresh()

    async def refresh(self) -> None:
        try:
            workers = await self.control.workers(self.cfg.token)
        except KvfleetError as e:
            why = _listing_error(e)
            if self.last_error != why:
                log.warning("proxy cannot list workers: %s", why)
            self.last_error = why
            return
        merged: dict[str, WorkerInfo] = {}
        for w in workers:  # the controller lists one entry per (worker, dp_rank): merge the ranks
            prev = merged.get(w.name)
            merged[w.name] = w if prev is None else dataclasses.replace(prev, ranks=prev.ranks + w.ranks)
        # NOTE: a drain's end (paused, sleeping) nudges too: a request queued behind the drained ones waits there for
        # the resume or wake, and waited for its own next probe (up to 8 s) with other workers free (found by review)
        was_serving = {n for n, w in self.workers.items() if w.serving or w.draining}
        gone = set(self.workers) - set(merged)
        self.workers, self.last_error, self.loaded_at = merged, None, time.monotonic()
        if self.on_listed is not None:  # at once, before any await: whatever named a worker not listed ran before
            self.on_listed(frozenset(merged))
        for name in was_serving:  # NOTE: the controller stopped listing it (slept, paused, lost): ask it now
            now_serving = merged.get(name)
            if now_serving is None or not (now_serving.serving or now_serving.draining):
                # NOTE: not one it drains (a pause with mode=wait): its requests finish there; nudged, each waiter's
                # probe found it "asleep" and pulled its request (sent again elsewhere, or a 503; found by review)
                self.watch.nudge(name)
        now = time.monotonic()
        stale = [w for w in workers if self._cards_at.get(w.name, -1e9) + self.cfg.models_refresh_s <= now]
        await asyncio.gather(*(self._fetch_cards(w, now) for w in stale))
        for name in set(self.cards) - set(self.workers):
            self.cards.pop(name, None)
            self._cards_at.pop(name, None)
        for name in gone:  # NOTE: unregistered; before, a proxy kept 23 metric series and 2 entries per gone name
            self.marks.forget(name)
            if self.on_gone is not None:
                self.on_gone(name)

    async def _fetch_cards(self, w: WorkerInfo, now: float) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.probe_timeout_s * 4)
            async with self.http.get(w.url.rstrip("/") + "/v1/models", timeout=timeout) as r:
                raw = await read_capped(r, MAX_MODELS_BYTES) if r.status == 200 else None
                data = json.loads(raw)["data"] if raw is not None else None
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
            data = None
        cards = [c for c in data if _valid_card(c)] if isinstance(data, list) else []
        if isinstance(data, list) and len(cards) < len(data):  # NOTE: kept, every request would read them
            log.warning("proxy: worker %s listed %d model card(s) that are not objects with a string id (and a "
                        "string or null parent); ignored", w.name, len(data) - len(cards))
        self.cards[w.name] = cards or [_card(w.model)]
        self._cards_at[w.name] = now

    # queries
    def unready(self) -> str | None:
        """Why the proxy should take no traffic now (GET /ready answers 503 with it), or None: the directory never
        loaded, or its refreshes have failed since a load older than cfg.ready_stale_s (one failed refresh is a
        blip; the routes need the controller anyway). NOTE: /health answered ok with a dead controller, so the
        chart's readiness probe kept the proxy in the Service (found by review); /health stays the liveness
        answer, since restarting the proxy does not bring a controller back."""
        if self.loaded_at is None:
            return f"the proxy has not listed the workers yet ({self.last_error})"
        age = time.monotonic() - self.loaded_at
        if self.last_error is not None and age > self.cfg.ready_stale_s:
            return f"the proxy last listed the workers {age:.0f}s ago ({self.last_error})"
        return None

    def get(self, name: str) -> WorkerInfo | None:
        return self.workers.get(name)

    def first_rank(self, name: str) -> int:
        """The worker's first serving DP rank (else its first): a global rank, dp_rank_start for a server behind an
        external or hybrid DP load balancer. NOTE: rank 0 was assumed, which such a worker has not."""
        w = self.workers.get(name)
        ranks = sorted(w.ranks, key=lambda r: (not r.serving, r.dp_rank)) if w is not None else []
        return ranks[0].dp_rank if ranks else 0

    def serving(self, name: str) -> bool:
        w = self.workers.get(name)
        return w is not None and w.serving and not self.is_suspect(name)

    def draining(self, name: str) -> bool:
        """The listing says the controller drains it: a pause or sleep with mode=wait, or a reset, of its own runs
        there, so what runs there is answered there (vLLM's /is_sleeping says true meanwhile, for the pause); what
        waits in vLLM's queue stays there until the resume or the wake. A pause behind the controller's back cannot
        be told from a sleep by vLLM's endpoints, and is not this."""
        w = self.workers.get(name)
        return w is not None and w.draining

    async def drains_now(self, name: str) -> bool:
        """Whether the controller lists the worker draining now: one ListWorkers call, shared by the requests that
        ask at once (they found it asleep together, by one shared probe), read for this answer only: the directory's
        listing stays as its last refresh left it. NOTE: the listing is up to refresh_s old, and a verb on a worker
        whose routes are older than --route-reconcile-grace reaches vLLM at once: a probe that found the worker
        asleep before the listing said draining gave up the request it was finishing (found by review)."""
        if self._drains_ask is None or self._drains_ask.done():
            self._drains_ask = asyncio.ensure_future(self._listed_draining())
        return name in await asyncio.shield(self._drains_ask)

    async def _listed_draining(self) -> frozenset[str]:
        try:
            workers = await self.control.workers(self.cfg.token)
        except KvfleetError:  # the listing's own loop logs why; not draining, as far as anyone can tell
            return frozenset()
        return frozenset(w.name for w in workers if w.draining)

    def is_suspect(self, name: str, routed_epoch: int | None = None, rank: int | None = None) -> bool:
        """Found asleep or gone by this proxy and not yet caught up with by the controller (SuspectMarks.holds)."""
        return self.marks.holds(name, self.workers.get(name), routed_epoch, rank)

    def suspect(self, name: str, routed_epoch: int | None = None, rank: int | None = None) -> None:
        """Mark the worker found asleep or gone (SuspectMarks.mark)."""
        self.marks.mark(name, self.workers.get(name), routed_epoch, rank)

    def failed(self, name: str, routed_epoch: int | None = None, rank: int | None = None) -> bool:
        """An attempt failed though no probe found the worker asleep or gone (SuspectMarks.failed)."""
        return self.marks.failed(name, self.workers.get(name), routed_epoch, rank)

    def answered(self, name: str) -> None:
        """An attempt on the worker got its first byte: its failures in a row start again from none."""
        self.marks.answered(name)

    def models(self) -> list[dict[str, Any]]:
        """The union of the registered workers' model cards (first card per id wins)."""
        out: dict[str, dict[str, Any]] = {}
        for name in sorted(self.workers):
            for c in self._cards_of(name):
                out.setdefault(str(c.get("id")), c)
        return list(out.values())

    def resolve(self, model: str | None) -> Resolved:
        """What a requested model id names (Resolved), from the cards of the workers that list it; 404 if none does.

        A card without a parent is a name a worker serves its registered model under (vLLM lists one per
        --served-model-name, all with parent null); one with a parent, a LoRA adapter of it. NOTE: the parentless
        cards were each taken for a model of its own, so a request for an alias looked for workers registered
        under the alias, found none and got 503 (found by review). No model (None): the fleet's one registered
        model, under its first served name, as vLLM fills it in; 400 when the fleet serves several, naming them."""
        if not self.workers and self.last_error:  # NOTE: why (the controller's address, its error) is logged and in
            # /ready and /health, for the operator; it went to every client too (found by review)
            raise ProxyError(503, "the proxy cannot see the fleet: it could not list the workers from the controller; "
                                  "retry shortly")
        if model is None:
            return self._the_one_model()
        for name in sorted(self.workers):
            for c in self._cards_of(name):
                if c.get("id") == model:
                    return Resolved(self.workers[name].model, model if c.get("parent") else None, model)
        raise ProxyError(404, f"The model `{model}` does not exist.", "model")

    def _cards_of(self, name: str) -> list[dict[str, Any]]:
        return self.cards.get(name) or [_card(self.workers[name].model)]

    def _the_one_model(self) -> Resolved:
        """The fleet's one registered model, named as its first worker's first served name; 400 if there are more."""
        first: dict[str, str] = {}  # registered model -> its first worker's first served name
        for name in sorted(self.workers):
            names = [str(c["id"]) for c in self._cards_of(name) if not c.get("parent")]
            first.setdefault(self.workers[name].model, names[0] if names else self.workers[name].model)
        if len(first) != 1:
            raise ProxyError(400, f"'model' is required: the fleet serves {len(first)} models "
                                  f"({', '.join(sorted(first.values())) or 'none yet'}); name one from GET /v1/models",
                             "model")
        ((base, served),) = first.items()
        return Resolved(base, None, served)

    def max_model_len(self, model: str) -> int | None:
        """The context length a card of the model id `model` gives (vLLM's cards carry max_model_len), else None."""
        for name in sorted(self.workers):
            for c in self._cards_of(name):
                n = c.get("max_model_len")
                if c.get("id") == model and isinstance(n, int) and not isinstance(n, bool):
                    return n
        return None

    def lists(self, worker: str, name: str | None) -> bool:
        """Whether the worker's cards list the model id `name` (None: any name). vLLM answers 404 ("The model `x` does
        not exist.") to a request for an id it does not list: an adapter loaded on some workers only, or an alias."""
        return name is None or any(c.get("id") == name for c in self._cards_of(worker))

    def serving_workers(self, base: str | None, listing: str | None = None) -> list[WorkerInfo]:
        """The serving workers of `base` (None: of any model), rotated so the load spreads; with `listing`, those whose
        cards list that id."""
        ws = [w for _, w in sorted(self.workers.items())
              if (base is None or w.model == base) and self.serving(w.name) and self.lists(w.name, listing)]
        k = next(self._rr) % len(ws) if ws else 0
        return ws[k:] + ws[:k]

    def served_name(self, base: str) -> str:
        """A name the workers of `base` serve it under (a card without a parent): the registered name where one does,
        as vLLM's /tokenize answers only a name it serves (404 for the registered one under --served-model-name)."""
        names = {c.get("id") for w in self.workers.values() if w.model == base for c in self._cards_of(w.name)
                 if not c.get("parent")}
        return base if base in names or not names else str(min(names, key=str))

    def tokenizer_urls(self, base: str, listing: str | None = None) -> list[str]:
        """URLs of workers of `base` (serving ones, else any), rotated so tokenize load spreads; with `listing`, of
        those whose cards list that id. NOTE: an adapter loaded on some workers only (at runtime) is a 404 at the
        others' /tokenize, which reached the client as a 502."""
        ws = [w for w in self.workers.values() if w.model == base and self.lists(w.name, listing)]
        ws = [w for w in ws if self.serving(w.name)] or ws
        if not ws:
            return []
        k = next(self._rr) % len(ws)
        return [w.url for w in ws[k:] + ws[:k]]
