"""RouteService: Route, ReleaseRoute and MoveRoute, unary or as messages of one RouteStream; the tenant's
cache_salt and ownership come from its token (a client's own salt, `client_salt`, is derived from the tenant's).

A Route carries at most ctx.max_route_tokens tokens (--max-route-tokens) and a model name of at most
MAX_MODEL_CHARS characters; the router hashes a prompt over hash_lane.INLINE_HASH_TOKENS tokens off the event loop, and
refuses one (RESOURCE_EXHAUSTED) while the tenant's others waiting to be hashed hold hash_lane.LONG_WAIT_TOKENS_PER_TENANT.
A batched request's later prompts (`batch`, at most batch_route.MAX_BATCH_PROMPTS prompts in all) count towards the
same token limit, all its prompts together: those past it are left out of the route (batch_route.within), which is
refused only when the first prompt alone is over it.

RouteStream (the proxy's path, docs/proxy.md): the caller's token is checked when the stream opens and again at
each message, which runs as its own task; at most STREAM_IN_FLIGHT of one stream's messages are running or
answered but not yet written at once (past that the stream is not read, and HTTP/2 flow control holds the caller
back). A message's failure is its answer's
`error`, with the status code the unary call would have failed with; only an undecodable message, or a token
refused at the open, ends the stream.

A message may also carry ReleaseRoutes (`releases`, alone or beside its op: the proxy's releases, sent in batches
with its next message, docs/proxy.md): they are released before the op runs and answered in its answer's `released`,
with no message of their own. The stream's initial metadata (CARRIED) tells a caller that this controller takes them:
one from before would ignore the field, so a caller that did not see it sends each release as its own message.

Several messages may come in one (`more`), and several answers go in one to a caller whose call metadata carries
BATCHED (the answers written together are those finished by the time the writer takes the next): each write of a
stream costs about as much CPU as the routing it carries (docs/proxy.md, "RouteStream batches"). The initial
metadata (BATCHED) says this controller takes them. A message in `more` carries none of its own, and at most
MAX_BATCH - 1 ride in one, each with at most MAX_CARRIED releases: past that the stream ends INVALID_ARGUMENT, none
of them run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from controller.auth import Identity, Role
from controller.batch_route import MAX_BATCH_PROMPTS, within
from controller.edge import Undecodable, refuse
from controller.hash_lane import INLINE_HASH_TOKENS
from controller.servicers.common import (
    ServiceContext,
    check_caller,
    clip,
    cut_message,
    fail_call,
    status_of,
    unary,
)
from controller.servicers.convert import decision_to_proto
from controller.stream_batch import MAX_BATCH, Batch
from fleet.api.kvfleet.v1 import route_pb2 as pb
from fleet.api.kvfleet.v1 import route_pb2_grpc as pbg
from fleet.core.errors import InvalidArgument, KvfleetError

MAX_MODEL_CHARS = 1024
MAX_CLIENT_SALT_CHARS = 1024  # a client's own cache_salt (vLLM recommends 43 characters: 256 random bits)
STREAM_IN_FLIGHT = 64  # messages of one RouteStream running at once
CARRIED = ("kvfleet-route-stream", "carried-releases")  # initial metadata: releases may ride on other messages
BATCHED = ("kvfleet-route-stream", "batched")  # initial metadata: messages may ride in `more`; call metadata: answers too
# answers written in one message, and messages read in one (`more` holds the others)
# NOTE: `more` was read whatever its length: one 2.7 MB message of 1.4M empty ones took 300 MB and 0.75 s of the
# controller's loop (one Python object each) before the first ran, and a caller that then did not read held it
# releases carried on one message (the proxy sends at most a quarter of it)
# NOTE: unbounded before: one 1.9 MB message of 1M empty releases held the controller's loop for seconds, each refused
MAX_CARRIED = 4096
_OPS = {"route": "Route", "release": "ReleaseRoute", "move": "MoveRoute"}
log = logging.getLogger("kvfleet.controller")


def _client_salt(request: pb.RouteRequest) -> str | None:
    """The client's own cache_salt, checked (vLLM's own rule: a non-empty string), or None."""
    if not request.HasField("client_salt"):
        return None
    salt = request.client_salt
    if not salt or len(salt) > MAX_CLIENT_SALT_CHARS:
        raise InvalidArgument(f"cache_salt must be a non-empty string of at most {MAX_CLIENT_SALT_CHARS} characters, "
                              f"got {len(salt)}")
    return salt


class RouteServicer(pbg.RouteServiceServicer):
    def __init__(self, ctx: ServiceContext) -> None:
        self.ctx = ctx

    @unary(Role.TENANT)
    async def Route(
        self, request: pb.RouteRequest, context: grpc.aio.ServicerContext, ident: Identity
    ) -> pb.RouteResponse:
        return await self._route(request, ident)

    async def _route(self, request: pb.RouteRequest, ident: Identity) -> pb.RouteResponse:
        if not request.model:
            raise InvalidArgument("route needs a model name (the one the workers were registered with)")
        if len(request.model) > MAX_MODEL_CHARS:
            raise InvalidArgument(f"model name of {len(request.model)} characters ({clip(request.model)}) is over "
                                  f"the limit of {MAX_MODEL_CHARS}; use the name the workers were registered with")
        if len(request.lora) > MAX_MODEL_CHARS:  # NOTE: unbounded, it was echoed whole in the NOT_FOUND that lists adapters
            raise InvalidArgument(f"lora name of {len(request.lora)} characters ({clip(request.lora)}) is over the limit "
                                  f"of {MAX_MODEL_CHARS}; use an adapter name the workers list in /v1/models")
        # a batch is routed by its first MAX_BATCH_PROMPTS prompts, of those its leading ones that fit together
        num_first, later = len(request.token_ids), [p.token_ids for p in request.batch[:MAX_BATCH_PROMPTS - 1]]
        later = later[:within(num_first, later, self.ctx.max_route_tokens)]  # a batch: by its leading prompts that fit
        num_tokens = num_first + sum(map(len, later))
        if num_tokens > self.ctx.max_route_tokens:
            raise InvalidArgument(f"route of {num_tokens} tokens is over the controller's limit of "
                                  f"{self.ctx.max_route_tokens} (--max-route-tokens); send at most the model's "
                                  "context length, or raise the limit")
        salt = self.ctx.auth.cache_salt(ident.tenant, _client_salt(request))
        ids, inline = request.token_ids, num_tokens <= INLINE_HASH_TOKENS
        decision = await self.ctx.need_router().route(
            # NOTE: a long prompt's ids stay the request's 4-byte ints until its hashing thread makes them a list (1M
            # tokens: 34 MB of Python ints, built on the event loop before it waited its turn, however many waited)
            list(ids) if inline else ids,
            request.model,
            cache_salt=salt,
            lora=request.lora if request.HasField("lora") else None,
            probe=request.probe if request.HasField("probe") else None,
            track=request.track,
            owner=ident.tenant,
            batch=[list(p) if inline else p for p in later],
        )
        return decision_to_proto(decision)

    @unary(Role.TENANT)
    async def ReleaseRoute(
        self, request: pb.ReleaseRouteRequest, context: grpc.aio.ServicerContext, ident: Identity
    ) -> pb.ReleaseRouteResponse:
        return self._release(request, ident)

    def _release(self, request: pb.ReleaseRouteRequest, ident: Identity) -> pb.ReleaseRouteResponse:
        if not request.route_id:
            raise InvalidArgument("ReleaseRoute needs the route_id a Route answer carried")
        released = self.ctx.need_router().release_route(request.route_id, owner=ident.tenant)
        return pb.ReleaseRouteResponse(released=released)

    @unary(Role.TENANT)
    async def MoveRoute(
        self, request: pb.MoveRouteRequest, context: grpc.aio.ServicerContext, ident: Identity
    ) -> pb.MoveRouteResponse:
        return self._move(request, ident)

    def _move(self, request: pb.MoveRouteRequest, ident: Identity) -> pb.MoveRouteResponse:
        if not request.route_id or not request.worker:
            raise InvalidArgument("MoveRoute needs the route_id a Route answer carried and the worker it went to")
        moved = self.ctx.need_router().move_route(request.route_id, request.worker, request.dp_rank, owner=ident.tenant)
        return pb.MoveRouteResponse(moved=moved)

    async def RouteStream(self, requests: AsyncIterator[pb.RouteStreamRequest],
                          context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RouteStreamResponse]:
        shares = contextlib.ExitStack()  # the stream holds one of its tenant's server RPC slots while it is open
        try:
            ident = check_caller(self.ctx, context, Role.TENANT, "RouteStream")
            shares.enter_context(self.ctx.rpc_shares.hold(ident.tenant))
        except KvfleetError as e:
            await fail_call(self.ctx, context, "RouteStream", e)
        with shares:  # (the body indented here: a generator of its own cost a hop per answer)
            await context.send_initial_metadata((CARRIED, BATCHED))
            batched = BATCHED in tuple(context.invocation_metadata() or ())  # (key, value) pairs
            counted = self.ctx.metrics.route_stream_messages
            received, answered = counted.labels("received"), counted.labels("answered")
            writes = self.ctx.metrics.route_stream_writes
            reads, written = writes.labels("received"), writes.labels("answered")
            answers: asyncio.Queue[pb.RouteStreamResponse | BaseException | None] = asyncio.Queue()
            slots = asyncio.Semaphore(STREAM_IN_FLIGHT)
            running: set[asyncio.Task[None]] = set()
            loop = asyncio.get_running_loop()

            async def answer(msg: pb.RouteStreamRequest, inner: bool) -> None:
                # NOTE: the message's slot is released once its answer is written (below), not once it is queued: an
                # unread stream then stops being read at STREAM_IN_FLIGHT answers. Before, a caller that sent and never
                # read grew the queue without bound (82,000 answers, +89 MiB in 30 s)
                try:
                    out = await self._answer(msg, context, inner)
                except BaseException:
                    slots.release()
                    raise
                answers.put_nowait(out)

            async def read() -> None:
                try:
                    async for msg in requests:
                        if isinstance(msg, Undecodable):
                            answers.put_nowait(msg)  # refused by the writer below
                            return
                        if len(msg.more) >= MAX_BATCH:  # NOTE: len() of the field builds none of its messages
                            answers.put_nowait(InvalidArgument(
                                f"a RouteStream message carries at most {MAX_BATCH - 1} others in `more`, got "
                                f"{len(msg.more)}; send the rest in further messages"))  # refused by the writer below
                            return
                        batch = (msg, *msg.more)  # the messages sent in this one, each alone
                        if (most := max(len(one.releases) for one in batch)) > MAX_CARRIED:
                            answers.put_nowait(InvalidArgument(
                                f"a RouteStream message carries at most {MAX_CARRIED} releases, got {most}; send the "
                                "rest on further messages"))  # refused by the writer below
                            return
                        reads.inc()
                        for i, one in enumerate(batch):
                            received.inc()
                            await slots.acquire()
                            task = loop.create_task(answer(one, i > 0))
                            running.add(task)
                            task.add_done_callback(running.discard)
                    if running:
                        await asyncio.wait(set(running))
                    answers.put_nowait(None)  # the caller half-closed and every message is answered
                except BaseException as e:  # noqa: BLE001  # the stream broke: handed to the writer, which ends it
                    answers.put_nowait(e)

            reader = loop.create_task(read())
            ahead: list[pb.RouteStreamResponse | BaseException | None] = []  # taken off the queue behind a batch
            try:
                while True:
                    out = ahead.pop() if ahead else await answers.get()
                    if out is None:
                        return
                    if isinstance(out, Undecodable):
                        await refuse(out, "RouteStream", context)
                    if isinstance(out, KvfleetError):
                        await fail_call(self.ctx, context, "RouteStream", out)
                    if isinstance(out, BaseException):
                        if isinstance(out, asyncio.CancelledError):
                            return
                        raise out
                    batch = Batch(out, pb.RouteStreamResponse.ByteSize)  # (answers are small: sized exactly)
                    while batched and not answers.empty():  # the answers finished by now go with it
                        nxt = answers.get_nowait()
                        if not isinstance(nxt, pb.RouteStreamResponse) or not batch.take(nxt):
                            ahead.append(nxt)  # the next write's first
                            break
                        out.more.append(nxt)
                    n = batch.n
                    yield out
                    written.inc()
                    answered.inc(n)
                    for _ in range(n):
                        slots.release()
            finally:
                reader.cancel()
                for task in list(running):
                    task.cancel()

    async def _answer(self, msg: pb.RouteStreamRequest, context: grpc.aio.ServicerContext,
                      inner: bool = False) -> pb.RouteStreamResponse:
        op = msg.WhichOneof("op")
        method = _OPS.get(op or "", "ReleaseRoute" if msg.releases else "RouteStream")
        released: list[bool] = []
        try:
            # NOTE: again at every message: a token revoked, or a controller that stopped leading, fails the next one
            ident = check_caller(self.ctx, context, Role.TENANT, method)
            if inner and msg.more:
                raise InvalidArgument("a RouteStream message sent in another's `more` carries no `more` of its own")
            released = [self._carried(r, ident) for r in msg.releases]  # first: the op routes on the lighter load
            out = await self._op(op, msg, ident)
        except KvfleetError as e:
            out = self._failed(msg.id, method, status_of(e), str(e))
        except Exception as e:  # noqa: BLE001  # one message's failure; the stream goes on
            log.exception("RouteStream %s failed", method)
            out = self._failed(msg.id, method, grpc.StatusCode.INTERNAL,
                               f"internal error in {method}: {type(e).__name__}: {e} (see controller log)")
        out.released.extend(released)
        return out

    async def _op(self, op: str | None, msg: pb.RouteStreamRequest, ident: Identity) -> pb.RouteStreamResponse:
        if op == "route":
            return pb.RouteStreamResponse(id=msg.id, route=await self._route(msg.route, ident))
        if op == "release":
            return pb.RouteStreamResponse(id=msg.id, release=self._release(msg.release, ident))
        if op == "move":
            return pb.RouteStreamResponse(id=msg.id, move=self._move(msg.move, ident))
        if msg.releases:
            return pb.RouteStreamResponse(id=msg.id)  # releases alone: their outcomes are the answer
        raise InvalidArgument("a RouteStream message must carry one of route, release or move")

    def _carried(self, request: pb.ReleaseRouteRequest, ident: Identity) -> bool:
        """A release carried on another message: False (as an unknown id) where its route_id is not one a Route
        answer carries, so that one bad id does not fail the others carried with it."""
        try:
            return bool(self.ctx.need_router().release_route(request.route_id, owner=ident.tenant))
        except InvalidArgument:
            return False

    def _failed(self, ident: int, method: str, code: grpc.StatusCode, text: str) -> pb.RouteStreamResponse:
        self.ctx.metrics.rpc_errors.labels(method=method, code=code.name).inc()
        return pb.RouteStreamResponse(id=ident, error=pb.RouteStreamError(code=code.name, message=cut_message(text)))
