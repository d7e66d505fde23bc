"""FleetClient: the synchronous kvfleet SDK (typed results, deadlines, retries on UNAVAILABLE)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from fleet.api.kvfleet.v1 import blobs_pb2, fleet_pb2, workers_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.sdk import base, types
from fleet.sdk.retry import Attempts, RetryPolicy, retryable
from fleet.sdk.sessions import SessionsMixin

T = TypeVar("T")


class FleetClient(SessionsMixin):
    """Synchronous client of a kvfleet controller.

    Args:
        target: "host:port" of the controller.
        token: bearer token (from `kvfleet controller --mint-token`); None if auth is off.
        tls: use TLS (system roots unless root_certificates is given).
        root_certificates: CA bundle (PEM bytes or a path) that signed the controller's certificate.
        client_cert, client_key: this client's certificate and key (PEM bytes or paths), for a controller
            that requires mutual TLS (--tls-client-ca).
        timeout: per-attempt deadline of unary calls, seconds.
        blob_timeout: per-attempt deadline of a blob put or get, seconds.
        retry: backoff policy for UNAVAILABLE (the only status retried).
    """

    def __init__(self, target: str, token: str | None = None, *, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, client_cert: bytes | str | Path | None = None,
                 client_key: bytes | str | Path | None = None, timeout: float = 10.0,
                 blob_timeout: float = 120.0, retry: RetryPolicy | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.target, self.timeout, self.blob_timeout = target, timeout, blob_timeout
        self.retry = retry or RetryPolicy()
        self._md = base.metadata(token)
        creds = base.credentials(tls, root_certificates, client_cert, client_key)
        self._channel = (grpc.secure_channel(target, creds, options) if creds
                         else grpc.insecure_channel(target, options))
        self._blobs = BlobServiceStub(self._channel)
        self._workers = WorkerServiceStub(self._channel)
        self._route = RouteServiceStub(self._channel)
        self._fleet = FleetServiceStub(self._channel)

    def _call(self, method: str, fn: Callable[[float], T], timeout: float | None = None) -> T:
        """Run fn(per-attempt timeout), retrying UNAVAILABLE with backoff until the retry deadline."""
        tries = Attempts(self.retry)
        while (left := tries.next()) is not None:
            try:
                return fn(min(timeout or self.timeout, left))
            except grpc.RpcError as e:
                if not retryable(e):
                    raise base.to_error(e, method, self.target) from e
                pause = tries.failed(e)
                if pause is not None:  # never past the deadline
                    time.sleep(pause)
        raise base.gave_up(method, self.target, tries.num_attempts, tries.elapsed(), tries.last)

    # blobs
    def put_blob(self, data: bytes, *, expected_ref: str | None = None, verify: bool = True) -> types.BlobRef:
        """Store bytes (chunked); returns their ref. verify=True has the server check our own sha256."""
        exp = base.expected(data, expected_ref, verify)
        r = self._call("PutBlob", lambda t: self._blobs.PutBlob(base.put_requests(data, exp), timeout=t,
                                                                  metadata=self._md), self.blob_timeout)
        return types.BlobRef(r.ref, r.size)

    def get_blob(self, ref: types.BlobRef | str, *, verify: bool = True) -> bytes:
        req = blobs_pb2.GetBlobRequest(ref=str(ref))

        def get(t: float) -> bytes:
            return b"".join(m.chunk for m in self._blobs.GetBlob(req, timeout=t, metadata=self._md))

        data = self._call("GetBlob", get, self.blob_timeout)
        return base.check_got(str(ref), data) if verify else data

    def stat_blob(self, ref: types.BlobRef | str) -> types.BlobInfo:
        r = self._call("StatBlob", lambda t: self._blobs.StatBlob(blobs_pb2.StatBlobRequest(ref=str(ref)),
                                                                  timeout=t, metadata=self._md))
        return types.blob_info(r.meta)

    def pin_blob(self, ref: types.BlobRef | str, *, tenant: str = "") -> types.BlobInfo:
        """Pin a blob: GC never collects it until as many unpins. `tenant`: operators only (another
        tenant's blob); a retry after a lost reply may pin twice (read `pins` in the answer)."""
        req = blobs_pb2.PinBlobRequest(ref=str(ref), tenant=tenant)
        r = self._call("PinBlob", lambda t: self._blobs.PinBlob(req, timeout=t, metadata=self._md))
        return types.blob_info(r.meta)

    def unpin_blob(self, ref: types.BlobRef | str, *, tenant: str = "") -> types.BlobInfo:
        """Drop one pin (FailedPrecondition when it has none)."""
        req = blobs_pb2.PinBlobRequest(ref=str(ref), tenant=tenant)
        r = self._call("UnpinBlob", lambda t: self._blobs.UnpinBlob(req, timeout=t, metadata=self._md))
        return types.blob_info(r.meta)

    def collect_garbage(self) -> int:
        """Operator: run the store's GC now (every tenant); returns the blobs deleted."""
        req = blobs_pb2.CollectGarbageRequest()
        r = self._call("CollectGarbage", lambda t: self._blobs.CollectGarbage(req, timeout=t, metadata=self._md))
        return int(r.num_collected)

    # workers (operator)
    def register_worker(self, name: str, *, url: str, kv_events: str, replay: str = "", model: str = "",
                        dp_ranks: int = 1, block_size: int | None = None, hash_algo: str | None = None,
                        hash_seed: str | int | None = None) -> types.WorkerInfo:
        spec = base.worker_spec(name, url, kv_events, replay, model, dp_ranks, block_size, hash_algo, hash_seed)
        req = workers_pb2.RegisterWorkerRequest(spec=spec)
        r = self._call("RegisterWorker", lambda t: self._workers.RegisterWorker(req, timeout=t, metadata=self._md))
        return types.worker_info(r.status)

    def unregister_worker(self, name: str) -> None:
        req = workers_pb2.UnregisterWorkerRequest(name=name)
        self._call("UnregisterWorker", lambda t: self._workers.UnregisterWorker(req, timeout=t, metadata=self._md))

    def workers(self) -> list[types.WorkerInfo]:
        r = self._call("ListWorkers", lambda t: self._workers.ListWorkers(workers_pb2.ListWorkersRequest(),
                                                                          timeout=t, metadata=self._md))
        return [types.worker_info(w) for w in r.workers]

    def lifecycle(self, name: str, verb: str, *, level: int | None = None, mode: str | None = None,
                  tags: Sequence[str] | None = None, clear_cache: bool | None = None,
                  dp_rank: int | None = None) -> types.Witness:
        """Drive a lifecycle verb through the controller; returns its cache-loss witness."""
        req = base.lifecycle_request(name, verb, level, mode, tags, clear_cache, dp_rank)
        r = self._call("Lifecycle", lambda t: self._workers.Lifecycle(req, timeout=t, metadata=self._md))
        return types.witness(r)

    # routing
    def route(self, token_ids: Sequence[int], model: str, *, lora: str | None = None,
              probe: bool | None = None) -> types.RouteDecision:
        req = base.route_request(token_ids, model, lora, probe)
        return types.route_decision(self._call("Route", lambda t: self._route.Route(req, timeout=t, metadata=self._md)))

    # fleet
    def whoami(self) -> types.Caller:
        r = self._call("WhoAmI", lambda t: self._fleet.WhoAmI(fleet_pb2.WhoAmIRequest(), timeout=t, metadata=self._md))
        return types.Caller(r.tenant, r.role, r.name)

    def fleet(self) -> types.FleetInfo:
        r = self._call("GetFleet", lambda t: self._fleet.GetFleet(fleet_pb2.GetFleetRequest(), timeout=t,
                                                                  metadata=self._md))
        return types.fleet_info(r)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
