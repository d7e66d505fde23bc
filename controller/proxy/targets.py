"""Where a routed request may be sent (controller/proxy/forward.py sends it): the chosen worker, then the
router's other candidates, then any other worker of the model, each a Target."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from controller.proxy.directory import WorkerDirectory
from fleet.core.route_types import COLD, verdict_of
from fleet.sdk.types import RouteDecision


@dataclass(frozen=True, slots=True)
class Target:
    worker: str
    url: str
    verdict: str
    matched_tokens: int
    epoch: int  # of its DP rank `dp_rank`: the route's, or the proxy's listing's for a fallback
    dp_rank: int = 0


def targets(d: RouteDecision, directory: WorkerDirectory, base: str, name: str | None = None) -> Iterator[Target]:
    """The chosen worker, then the router's other candidates, then any other worker of the model; of the fallbacks,
    only those whose cards list `name`, the request's model id (None: any).

    NOTE: lazy: nearly every request is answered by the first, and the fallbacks cost a directory walk.
    NOTE: the walk took every worker of the base model: a request for an adapter loaded on some workers only, whose
    chosen worker was asleep, was sent to one without it and the client got its 404 ("The model `x` does not
    exist."), a permanent error to an OpenAI SDK, where the fleet was only short of a worker for a moment.
    """
    yield Target(d.worker, d.url, d.verdict, d.matched_tokens, d.epoch, d.dp_rank)
    seen = {d.worker}
    for c in d.candidates:
        w = directory.get(c.worker)
        if w is not None and c.worker not in seen and directory.lists(c.worker, name):
            seen.add(c.worker)
            epoch = next((r.epoch for r in w.ranks if r.dp_rank == c.dp_rank), 0)
            yield Target(c.worker, w.url, verdict_of(c.matched_tokens), c.matched_tokens, epoch, c.dp_rank)
    for w in sorted(directory.workers.values(), key=lambda w: w.name):
        if w.model == base and w.name not in seen and directory.lists(w.name, name):
            rank = directory.first_rank(w.name)  # where MoveRoute puts it (app.py)
            epoch = next((r.epoch for r in w.ranks if r.dp_rank == rank), 0)
            yield Target(w.name, w.url, COLD, 0, epoch, rank)
