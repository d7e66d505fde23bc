"""KernelActor: one Ray actor per session, hosting its kernel session (DESIGN §3, STYLE §15).

Write path of every mutating call:

    caller ──append(tokens, op_id)──▶ KernelActor
                                        1. host.apply(op)          bad input raises here, nothing changed
                                        2. store.oplog_append(op)  durable before the reply
                                        3. reply (logits)          = acknowledged

If step 2 fails the actor rebuilds itself from the log (dropping the unlogged op) and raises
Unavailable, so memory never holds an op the log lacks. Retries carry the same `op_id`; an op
already applied (e.g. logged just before a crash, then replayed) is answered, not re-applied.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from fleet.errors import FailedPrecondition, NotFound, Unavailable
from fleet.kernel import PrefixKV, Session
from workers.host import SessionHost
from workers.spec import KernelSpec, make_kernel


class KernelActor:
    """Hosts one session. Created by a NodeSupervisor as `session:{tenant}:{session_id}`."""

    def __init__(self, tenant: str, session_id: str, store_url: str, kernel_spec: dict[str, Any],
                 node_id: str = "", epoch: int = 0) -> None:
        self.tenant, self.session_id, self.node_id, self.epoch = tenant, session_id, node_id, epoch
        self.kernel = make_kernel(KernelSpec.from_dict(kernel_spec))
        self.host = SessionHost(self.kernel)
        self._store_url = store_url
        self._store: Any = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="store")  # the store is used from one thread
        self._lock = asyncio.Lock()                                   # ops of one session never interleave
        self.created_at = self.last_active = time.time()
        self.num_replayed_ops = 0
        self.state = "new"

    # -- store I/O (off the event loop) --------------------------------------------------------

    def _store_sync(self, fn: str, args: tuple[Any, ...]) -> Any:
        if self._store is None:
            from fleet.cas import open_store

            self._store = open_store(self._store_url)
        return getattr(self._store, fn)(*args)

    async def _store_call(self, fn: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._io, self._store_sync, fn, args)

    # -- the one mutation path ----------------------------------------------------------------

    async def _mutate(self, op: dict[str, Any], prefix: PrefixKV | None = None) -> dict[str, Any]:
        async with self._lock:
            if op.get("op_id") and op["op_id"] in self.host.op_ids:
                return self._reply(op, None, replayed=True)
            if op["op"] != "create" and self.host.session is None:
                raise FailedPrecondition(f"session {self.session_id} has no state yet (create or restore it)")
            result = self.host.apply(op, prefix)
            try:
                index = await self._store_call("oplog_append", self.tenant, self.session_id, op)
            except Exception as e:  # noqa: BLE001 - any failure: the op is not durable
                await self._rebuild()
                raise Unavailable(f"op log write failed, op not applied ({type(e).__name__}: {e})") from e
            self.last_active, self.state = time.time(), "active"
            return self._reply(op, result, index=index)

    def _reply(self, op: dict[str, Any], result: Any, index: int | None = None,
               replayed: bool = False) -> dict[str, Any]:
        s = self.host.session
        assert s is not None
        if replayed:  # answer from the current state: the op's effect is already in it
            result = s.last_logits if op["op"] in ("create", "append") else None
        return {"result": result, "num_tokens": len(s), "op_index": index, "replayed": replayed}

    async def _rebuild(self) -> None:
        ops = await self._store_call("oplog_read", self.tenant, self.session_id)
        self.host = SessionHost(self.kernel)
        self.host.replay(ops)
        self.num_replayed_ops = len(ops)

    # -- verbs --------------------------------------------------------------------------------

    async def create(self, tokens: list[int], prefix_refs: list[Any] | None = None,
                     op_id: str = "") -> dict[str, Any]:
        """First op of a session; adopts the shared blocks in `prefix_refs` (ObjectRefs) if any."""
        prefix = await self._adopt(tokens, prefix_refs or [])
        return await self._mutate({"op": "create", "tokens": list(tokens), "op_id": op_id}, prefix)

    async def _adopt(self, tokens: list[int], refs: list[Any]) -> PrefixKV | None:
        if not refs:
            return None
        blocks = tuple(await asyncio.gather(*refs))  # zero-copy, read-only views on this node
        n = len(blocks) * self.kernel.block_size
        return PrefixKV(tuple(tokens[:n]), self.kernel.block_size, blocks, self.kernel.model_id)

    async def restore(self) -> dict[str, Any]:
        """Regenerate from the op log (after the previous actor was lost)."""
        async with self._lock:
            await self._rebuild()
            if self.host.session is None:
                raise NotFound(f"session {self.session_id}: no op log to regenerate from")
            self.state = "regenerated"
            return self._info()

    async def init_fork(self, parent_ops: list[dict[str, Any]], parent_id: str, op_id: str) -> dict[str, Any]:
        """Become a branch: copy the parent's ops into this session's log, then replay them."""
        async with self._lock:
            await self._store_call("oplog_delete", self.tenant, self.session_id)
            for op in parent_ops:
                await self._store_call("oplog_append", self.tenant, self.session_id, op)
            self.host = SessionHost(self.kernel)
            self.host.replay(parent_ops)
        return await self._mutate({"op": "fork", "parent": parent_id, "parent_ops": len(parent_ops),
                                   "op_id": op_id})

    async def append(self, tokens: list[int], op_id: str = "") -> dict[str, Any]:
        return await self._mutate({"op": "append", "tokens": list(tokens), "op_id": op_id})

    async def generate(self, n: int, op_id: str = "") -> dict[str, Any]:
        return await self._mutate({"op": "generate", "n": int(n), "op_id": op_id})

    async def evict(self, start: int, length: int, mode: str = "exact", op_id: str = "") -> dict[str, Any]:
        return await self._mutate({"op": "evict", "start": start, "length": length, "mode": mode,
                                   "op_id": op_id})

    # -- reads --------------------------------------------------------------------------------

    async def ops(self) -> list[dict[str, Any]]:
        async with self._lock:
            return list(await self._store_call("oplog_read", self.tenant, self.session_id))

    async def export_prefix(self, num_tokens: int) -> PrefixKV:
        return self._s.export_prefix(num_tokens)

    async def digest(self) -> str:
        return self._s.digest()

    async def last_logits(self) -> np.ndarray | None:
        return self._s.last_logits

    async def tokens(self) -> list[int]:
        return list(self._s.tokens)

    async def info(self) -> dict[str, Any]:
        return self._info()

    async def ping(self) -> str:
        return "ok"

    def _info(self) -> dict[str, Any]:
        s = self.host.session
        mem = s.memory() if s is not None else None
        num_tokens = len(s) if s is not None else 0
        return {
            "session": self.session_id, "tenant": self.tenant, "node": self.node_id,
            "actor": f"session:{self.tenant}:{self.session_id}", "tokens": num_tokens,
            "bytes_alone": mem.bytes_alone if mem else 0, "bytes_shared": mem.bytes_shared if mem else 0,
            "adopted_tokens": self.host.num_adopted_tokens, "num_ops": self.host.num_ops,
            "replayed_ops": self.num_replayed_ops, "quarantined_spans": 0, "state": self.state,
            "epoch": self.epoch, "last_active": self.last_active, "pid": os.getpid(),
        }

    @property
    def _s(self) -> Session:
        if self.host.session is None:
            raise FailedPrecondition(f"session {self.session_id} has no state yet")
        return self.host.session
