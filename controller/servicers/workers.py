"""WorkerService: the worker registry and lifecycle verbs (operator role; ListWorkers: reader too)."""

from __future__ import annotations

import re

import grpc

from controller.auth import Identity, Role
from controller.servicers.common import ServiceContext, clip, unary
from controller.servicers.convert import spec_from_proto, statuses_to_proto, witness_to_proto
from controller.servicers.route import MAX_MODEL_CHARS
from fleet.api.kvfleet.v1 import workers_pb2 as pb
from fleet.api.kvfleet.v1 import workers_pb2_grpc as pbg
from fleet.core.errors import InvalidArgument

_PORT = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://(?:\[[^\]]*\]|[^/:\[]*):(\d+)")


def check_endpoint(what: str, value: str) -> None:
    """Refuse whitespace/control characters (a trailing newline too) and ports outside 1-65535."""
    if any(c.isspace() or not c.isprintable() for c in value):
        raise InvalidArgument(f"worker {what} {clip(value)} contains whitespace or control characters")
    m = _PORT.match(value)
    if m and not 1 <= int(m.group(1)) <= 65535:
        raise InvalidArgument(f"worker {what} {clip(value)}: port {int(m.group(1))} is outside 1-65535")


# NOTE: a worker spec's model and hash_seed were unbounded: a worker registered with a model of 1,025 characters was
# listed and never routed to (Route refuses a model over MAX_MODEL_CHARS, "use the name the workers were registered
# with"), and a 1 MiB model or seed was kept in the worker's store record and sent in every ListWorkers and GetFleet
# (the proxy polls it). The seed is PYTHONHASHSEED's value: at most 10 digits, or "random".
MAX_SPEC_CHARS = {"model": MAX_MODEL_CHARS, "hash_seed": 64}
_WHY = {"model": "the model name a Route may carry", "hash_seed": "the worker's PYTHONHASHSEED: 0-4294967295 or random"}


def check_length(what: str, value: str) -> None:
    if len(value) > (limit := MAX_SPEC_CHARS[what]):
        raise InvalidArgument(f"worker {what} of {len(value)} characters ({clip(value)}) is over the limit of {limit} "
                              f"({_WHY[what]})")


VERBS = ("sleep", "wake_up", "pause", "resume", "reset_prefix_cache", "release_kv_cache_memory")


class WorkerServicer(pbg.WorkerServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(Role.OPERATOR)
    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext,
                             ident: Identity) -> pb.RegisterWorkerResponse:
        if not request.spec.name:
            raise InvalidArgument("worker spec needs a name (e.g. 'w0')")
        spec = request.spec
        for what, value in (("name", spec.name), ("url", spec.url), ("kv_events", spec.kv_events),
                            ("replay", spec.replay), ("model", spec.model)):
            check_endpoint(what, value)
        check_length("model", spec.model)
        if spec.HasField("hash_seed"):
            check_length("hash_seed", spec.hash_seed)
        router = self.ctx.need_router()
        status = await router.register_worker(spec_from_proto(request.spec))
        ranks = [s for s in router.workers() if s.name == status.name] or [status]  # every DP rank
        return pb.RegisterWorkerResponse(status=statuses_to_proto(ranks)[0])

    @unary(Role.OPERATOR)
    async def UnregisterWorker(self, request: pb.UnregisterWorkerRequest, context: grpc.aio.ServicerContext,
                               ident: Identity) -> pb.UnregisterWorkerResponse:
        await self.ctx.need_router().unregister_worker(request.name)
        return pb.UnregisterWorkerResponse()

    @unary(Role.READER)
    async def ListWorkers(self, request: pb.ListWorkersRequest, context: grpc.aio.ServicerContext,
                          ident: Identity) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=statuses_to_proto(self.ctx.need_router().workers()))

    @unary(Role.OPERATOR)
    async def Lifecycle(self, request: pb.LifecycleRequest, context: grpc.aio.ServicerContext,
                        ident: Identity) -> pb.LifecycleResponse:
        if request.verb not in VERBS:
            raise InvalidArgument(f"unknown lifecycle verb {request.verb!r}; use one of {', '.join(VERBS)}")
        r = request
        witness = await self.ctx.need_router().lifecycle(
            r.name, r.verb,
            level=r.level if r.HasField("level") else None,
            mode=r.mode if r.HasField("mode") else None,
            tags=list(r.tags) or None,
            clear_cache=r.clear_cache if r.HasField("clear_cache") else None,
            dp_rank=r.dp_rank if r.HasField("dp_rank") else None,
            reset_running_requests=r.reset_running_requests if r.HasField("reset_running_requests") else None,
        )
        return pb.LifecycleResponse(worker=r.name, witness=witness_to_proto(witness))
