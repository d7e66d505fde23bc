"""The proxy's gRPC link to the controller: Route, ReleaseRoute, MoveRoute and WhoAmI with the CLIENT's
token, ListWorkers with its own.

One channel for every caller; the bearer token travels as per-call metadata, so the controller
authenticates each client and derives its tenant's cache_salt itself. No retries here: the proxy
is on the request path and answers 503 (Retry-After) when the controller is unavailable.
ReleaseRoute runs off the response path (`release_soon`): the answer never waits for it, and a
lost release only leaves the route to the controller's reconcile and TTL.

At most `max_rpcs` RPCs are open at once on the channel (one HTTP/2 connection); more wait their turn.
NOTE: the controller refuses streams past its per-connection limit (--grpc-max-concurrent-streams, 100 by
default) with RST_STREAM REFUSED_STREAM, which reached clients as 503s: at 200 streaming clients
(bench/proxy_load.py) 966 of 4,000 proxied requests failed so with no bound, and 51 of 1,000 with a bound
of 100 (a stream the proxy has finished may still count at the controller); with 50, none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from controller.keyed_slots import KeyedSlots
from controller.proxy.callers import KnownCallers
from controller.proxy.lookups import TokenLookups
from controller.proxy.refused import RefusedTokens
from controller.proxy.route_stream import RouteStreams, StreamUnsupported
from controller.proxy.tls_renewal import TlsRenewal
from controller.tls_reload import CHECK_INTERVAL_S, Stamp
from fleet.api.kvfleet.v1 import fleet_pb2, quarantine_pb2, route_pb2, workers_pb2
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.quarantine_pb2_grpc import QuarantineServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvfleetError,
    PermissionDenied,
    Unauthenticated,
)
from fleet.sdk import base, types

log = logging.getLogger("kvfleet.proxy")
MAX_REFUSED = 10000  # refused tokens remembered at once (controller/proxy/refused.py)
UNKNOWN = ("tokens not known yet",)  # the one slot share of every token no WhoAmI has named a tenant for yet
OWN = ("the proxy's own token",)  # the proxy's ListWorkers: a share of its own, apart from the clients' tokens


def _ignore(outcome: str) -> None:
    pass


class ControlClient:
    """Route / WhoAmI / ListWorkers against one controller; errors raised as fleet.core.errors.*."""

    def __init__(self, target: str, *, timeout_s: float = 2.0, auth_cache_s: float = 5.0,
                 auth_refused_s: float = 2.0, credentials: grpc.ChannelCredentials | None = None,
                 max_rpcs: int = 50, stream: bool = True, own_token: str | None = None) -> None:
        self.target, self.timeout_s, self.auth_cache_s, self.own_token = target, timeout_s, auth_cache_s, own_token
        # NOTE: a tenant (or a token not known yet) holds at most three quarters of the slots (see _slot)
        # NOTE: no address in the name: a client whose token has no slot left is told it (errors.from_fleet)
        self._slots = KeyedSlots(max(1, max_rpcs - max_rpcs // 4), max_rpcs, key_name="group of tokens not known yet",
                                 name="the proxy's RPCs to the controller")
        self._use_streams = stream
        self._link(credentials)
        self._tls: TlsRenewal | None = None
        self._callers = KnownCallers()  # WhoAmI answers by token, fair between tenants at the bound (callers.py)
        self._refused = RefusedTokens(MAX_REFUSED, auth_refused_s)  # a refusal answered here (refused.py)
        self._lookups = TokenLookups()  # the WhoAmIs of tokens not known yet, a few per client address (lookups.py)
        self._releases: set[asyncio.Task[None]] = set()  # releases and WhoAmI renewals in the background
        self._renewing: set[str | None] = set()

    def _link(self, credentials: grpc.ChannelCredentials | None) -> None:
        """A channel to the controller with these credentials, and its stubs and RouteStreams, from now on."""
        target = self.target
        self._channel = (grpc.aio.secure_channel(target, credentials, base.RECONNECT) if credentials is not None
                         else grpc.aio.insecure_channel(target, base.RECONNECT))
        self._route = RouteServiceStub(self._channel)
        self._fleet = FleetServiceStub(self._channel)
        self._workers = WorkerServiceStub(self._channel)
        self._quarantine = QuarantineServiceStub(self._channel)
        self._streams = RouteStreams(self._route, target) if self._use_streams else None

    def watch_tls(self, paths: tuple[str, ...], load: Callable[[], grpc.ChannelCredentials | None], stamp: Stamp,
                  interval_s: float = CHECK_INTERVAL_S) -> None:
        """Look at the TLS files every `interval_s` (from `start`): when they changed since `stamp` (taken before the
        channel's credentials were read) and `load` reads them whole, new calls go over a new channel with the new
        credentials (controller/proxy/tls_renewal.py)."""
        self._tls = TlsRenewal(paths, load, stamp, self._relink, interval_s)

    def _relink(self, credentials: grpc.ChannelCredentials | None) -> tuple[grpc.aio.Channel, RouteStreams | None]:
        """New calls go over a new channel with these credentials; returns the channel and streams it replaced."""
        old = (self._channel, self._streams)
        self._link(credentials)
        return old

    async def start(self) -> None:
        if self._tls is not None:
            await self._tls.start()

    async def route(
        self, token_ids: Sequence[int], model: str, *, lora: str | None, token: str | None,
        client_salt: str | None = None, batch: Sequence[Sequence[int]] = (),
        orphaned: Callable[[str], None] | None = None,
    ) -> types.RouteDecision:
        """`client_salt`: the client's own cache_salt; the decision's salt is then the controller's derivation of the
        tenant's and it (controller/auth.py). `batch`: a batched request's later prompts (`token_ids` is its first);
        a controller from before ignores them and routes by the first alone. `orphaned`: the outcome of releasing
        a route whose answer came over the RouteStream after this call was cancelled or timed out (the proxy
        releases it; a unary Route cancelled so leaves it to the controller's reconcile, as it has no route id)."""
        try:  # NOTE: as table.route, with protobuf's own range check instead of a Python pass over the ids
            req = route_pb2.RouteRequest(token_ids=token_ids, model=model, track=True,
                                         batch=[route_pb2.BatchPrompt(token_ids=b) for b in batch])
        except (ValueError, TypeError):
            raise InvalidArgument("token ids must be integers in [0, 2**32)") from None
        if lora is not None:
            req.lora = lora
        if client_salt is not None:
            req.client_salt = client_salt
        # track: the proxy releases every route when its answer ends (controller/proxy/routed.py answer)
        async with self._slot("Route", token):
            def orphan(late: route_pb2.RouteResponse) -> None:
                if late.route_id:
                    self.release_soon(late.route_id, token, orphaned)

            r = await self._over_stream(token, route=req, orphan=orphan)
            if r is None:
                r = await self._call("Route", self._route.Route, req, token)
        return types.route_decision(r)

    async def _over_stream(self, token: str | None, orphan: Callable[[Any], Any] | None = None, **op: Any) -> Any:
        """The op's answer over the token's RouteStream; None where it must go unary (no stream for it)."""
        if self._streams is None or not self._streams.usable(token):
            return None
        try:
            return await self._streams.ask(token, self.timeout_s, orphan, **op)
        except StreamUnsupported:
            return None

    def release_soon(
        self, route_id: str, token: str | None, done: Callable[[str], None] | None = None
    ) -> None:
        """Release a route in the background; `done` gets "released", "unknown" or "failed". Over the token's open
        RouteStream it rides on the stream's next message (token_stream.BATCH_S at most later), taking no slot."""
        if self._streams is not None and self._streams.carry_release(token, route_id, done or _ignore):
            return
        task = asyncio.get_running_loop().create_task(self._release(route_id, token, done))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def move(self, route_id: str, worker: str, dp_rank: int, token: str | None) -> bool:
        """Tell the controller that the route goes to another of its candidates, before it is sent there. False:
        the controller answered that the candidate is not serving now, so the request must not go there (it may
        have slept it since the route: this proxy's listing lags by up to --refresh). Any other failure (the
        controller unreachable, this token's slots busy) is logged and the send goes on (True)."""
        req = route_pb2.MoveRouteRequest(route_id=route_id, worker=worker, dp_rank=dp_rank)
        try:
            async with self._slot("MoveRoute", token):
                if await self._over_stream(token, move=req) is None:
                    await self._call("MoveRoute", self._route.MoveRoute, req, token)
        except FailedPrecondition as e:
            log.info("proxy: MoveRoute %s refused: %s", route_id, e)
            return False
        except KvfleetError as e:  # the slot's wait ran out (not sent), or the answer was another error
            log.info("proxy: MoveRoute %s failed: %s", route_id, e)
        return True

    async def _release(self, route_id: str, token: str | None, done: Callable[[str], None] | None) -> None:
        outcome = await self.release(route_id, token)
        if done is not None:
            done(outcome)

    async def release(self, route_id: str, token: str | None) -> str:
        """ReleaseRoute now: "released", "unknown" (the controller no longer tracks it) or "failed" (logged)."""
        req = route_pb2.ReleaseRouteRequest(route_id=route_id)
        try:
            async with self._slot("ReleaseRoute", token):
                r = await self._over_stream(token, release=req)
                if r is None:
                    r = await self._call("ReleaseRoute", self._route.ReleaseRoute, req, token)
            outcome = "released" if r.released else "unknown"
        except KvfleetError as e:  # the slot's wait ran out (not sent), or the answer was an error
            log.info("proxy: ReleaseRoute %s failed: %s", route_id, e)
            outcome = "failed"
        return outcome

    async def whoami(self, token: str | None, client: str | None = None) -> types.Caller:
        """Who the controller says `token` is; good answers are cached auth_cache_s (Route re-checks anyway). A token
        not known yet is looked up once for all its requests, a few tokens at once per `client` address (lookups.py).

        NOTE: a token in use is asked again in the background once half its answer's life is gone, so a steady
        client never waits for a WhoAmI on its request path (one did every auth_cache_s); no answer is used
        longer than auth_cache_s, and a refresh that finds the token refused drops it at once.
        """
        hit = self._callers.get(token)
        now = time.monotonic()
        if hit is None or hit[0] <= now:
            refusal = self._refused.get(token)
            if refusal is not None:
                raise refusal
        if hit is not None and hit[0] > now:
            if hit[0] - now < self.auth_cache_s / 2 and token not in self._renewing:
                self._renewing.add(token)
                task = asyncio.get_running_loop().create_task(self._renew(token))
                self._releases.add(task)  # NOTE: held (and awaited on close) with the releases
                task.add_done_callback(self._releases.discard)
            return hit[1]
        # NOTE: a token the controller named a tenant for, its answer aged out, is no made-up one: not held to the
        # address's bound (before, a gateway's 5th token back after a pause got a 429); its WhoAmI takes its tenant's share
        return await self._lookups.look_up(token, client if hit is None else None, lambda: self._ask_whoami(token))

    async def _renew(self, token: str | None) -> None:
        try:
            await self._ask_whoami(token)
        except KvfleetError as e:
            if isinstance(e, PermissionDenied):
                self._callers.pop(token, None)  # refused now: the next request asks (and gets the error) itself
            log.info("proxy: renewing a cached WhoAmI failed: %s", e)
        finally:
            self._renewing.discard(token)

    async def _ask_whoami(self, token: str | None) -> types.Caller:
        try:
            r = await self._unary("WhoAmI", self._fleet.WhoAmI, fleet_pb2.WhoAmIRequest(), token)
        except Unauthenticated as err:  # NOTE: refused: answered here for a while (refused.py)
            self._callers.pop(token, None)  # .. and no longer its tenant's: its calls take the unknown share
            self._refused.add(token, err)
            raise
        caller = types.Caller(r.tenant, r.role, r.name)
        self._callers[token] = (time.monotonic() + self.auth_cache_s, caller)
        return caller

    async def workers(self, token: str | None) -> list[types.WorkerInfo]:
        r = await self._unary("ListWorkers", self._workers.ListWorkers, workers_pb2.ListWorkersRequest(), token)
        return [types.worker_info(w) for w in r.workers]

    async def judge(self, results: list[bytes], action: str, token: str | None,
                    timeout_s: float | None = None) -> list[quarantine_pb2.Judgement]:
        """The controller's verdict on each tool result (JudgeToolResults, with the client's token)."""
        req = quarantine_pb2.JudgeToolResultsRequest(results=results, action=action)
        r = await self._unary("JudgeToolResults", self._quarantine.JudgeToolResults, req, token, timeout_s)
        return list(r.judgements)

    async def known(self, refs: list[str], token: str | None) -> list[quarantine_pb2.Judgement]:
        """The verdict the controller knows now on each ref, bytes not sent (KnownVerdicts, the client's token)."""
        req = quarantine_pb2.KnownVerdictsRequest(refs=refs)
        r = await self._unary("KnownVerdicts", self._quarantine.KnownVerdicts, req, token)
        return list(r.judgements)

    async def _call(self, rpc: str, call: Callable[..., Awaitable[Any]], req: Any, token: str | None,
                    timeout_s: float | None = None) -> Any:
        """One unary RPC with the token's metadata; a gRPC error raised as fleet.core.errors.*."""
        try:
            return await call(req, timeout=timeout_s or self.timeout_s, metadata=base.metadata(token))
        except grpc.RpcError as e:
            raise base.to_error(e, rpc, self.target) from e

    async def _unary(self, rpc: str, call: Callable[..., Awaitable[Any]], req: Any, token: str | None,
                     timeout_s: float | None = None) -> Any:
        """`_call` in one of the token's slots."""
        async with self._slot(rpc, token):
            return await self._call(rpc, call, req, token, timeout_s)

    @contextlib.asynccontextmanager
    async def _slot(self, rpc: str, token: str | None) -> AsyncIterator[None]:
        """One of the channel's max_rpcs open RPCs, waited for at most timeout_s (then Unavailable: 503).

        A tenant holds at most three quarters of them: one tenant's flood of calls, or of slow
        JudgeToolResults, leaves a quarter to everyone else (one tenant never slows another). Half was tried
        first: one token at 200 clients served about 4% fewer requests per second (docs/proxy.md).
        The share is the tenant's, all its tokens together, once WhoAmI named it (every request asks first); the
        tokens not known yet (their first WhoAmI) share ONE share, all of them together, and the proxy's own
        ListWorkers has another.
        NOTE: each token not known yet had a share of its own: a flood of made-up tokens (no valid token needed)
        held every slot with their WhoAmIs, and a known tenant's Route waited behind them in the channel's queue
        (tests/controller/proxy/test_proxy_bad_tokens.py). Now they hold three quarters at most; a new legitimate
        token's first WhoAmI waits behind them (at most timeout_s, then 503), and a known tenant never does.
        NOTE: the share was the token's: a tenant with two tokens (a tenant may mint many) held every slot with
        its slow JudgeToolResults, and another tenant's Route waited the whole timeout_s, then got a 503
        (tests/controller/proxy/test_proxy_fair_slots.py).
        """
        hit = self._callers.get(token)
        if hit is None:
            key = OWN if token is not None and token == self.own_token else UNKNOWN
            async with self._slots.hold(key, self.timeout_s, rpc):
                yield
        else:
            async with self._slots.hold(("tenant", hit[1].tenant), self.timeout_s, rpc, key_name="tenant"):
                yield

    async def close(self) -> None:
        """Let pending releases finish (up to the RPC timeout), then close the channel (and any a renewal replaced)."""
        if self._tls is not None:
            await self._tls.stop()
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=self.timeout_s)
        if self._streams is not None:
            with contextlib.suppress(TimeoutError):
                await self._streams.drain(self.timeout_s)
            await self._streams.close()
        await self._channel.close()
