"""A kernel host's slots (workers/host.py's KernelHost takes these as a mixin): which session holds a name on the
host, who may open a kernel under it, and the room a host has for one more.

A create or fork opens its kernel with `_insert` (refused while the name is held, unless the holder is an orphan,
workers/orphans.py, or the same try's), a rebuild with `_open` (in place of the session's own kernel); both are
refused on a full host (`_check_room`: `max_sessions`); a create or fork also when the node's KV budget has no room
for it (`free_bytes`, the creates and forks still filling here counted at what they need: `reserved`). A rebuild is
not: its size is its log's, known once replayed, and the session it restores was admitted once (see `_open`). A
try that failed removes only the kernel it opened (`_drop`). `used_bytes` is the node's KV use that placement weighs
against its budget.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from fleet.core.errors import AlreadyExists, ResourceExhausted
from workers.orphans import Orphans
from workers.placement import has_room, need_bytes
from workers.session_kernel import SessionGone, SessionKernel

if TYPE_CHECKING:
    from fleet.cas import BlobStore
    from workers.host_cache import NodeCache
    from workers.lanes import TenantLanes

ORPHAN_TRIES = 3  # looks at a name a create or fork finds held (an orphan replaced, or the holder changed meanwhile)


class HostSlots(Orphans):
    """The sessions a host holds, and opening and dropping their kernels."""

    node_id: str
    name: str
    pid: int
    store: BlobStore
    lanes: TenantLanes
    cache: NodeCache
    block_size: int
    bytes_per_token: int
    kv_budget_bytes: int
    max_sessions: int
    remote_adopters: set[tuple[str, str]]
    reserved: dict[SessionKernel, int]  # a create or fork in flight -> the KV bytes it needs (`_check_room`)
    _loading: Future[tuple[Any, Any]]

    async def _kernel(self) -> tuple[Any, Any]:
        return await asyncio.wrap_future(self._loading)

    def _held(self, key: tuple[str, str], s: SessionKernel) -> int:
        """KV bytes a session holds privately: its blocks except those adopted from this node's tree
        (views of the same; blocks a cross-node fork adopted were copied here, so they count)."""
        i = s.memory()
        adopted = 0 if key in self.remote_adopters else s.num_adopted_tokens * self.bytes_per_token
        return max(0, i[0] + i[1] - adopted)

    def used_bytes(self) -> int:
        """KV bytes held on this node: the tree's blocks (each once, in the object store) plus every
        session's private blocks."""
        private = sum(self._held(k, s) for k, s in list(self.sessions.items()))
        return self.cache.cached_bytes() + private

    def free_bytes(self) -> int:
        """KV bytes left of the node's budget: less what it holds, and less what each create or fork still filling
        here needs beyond what it holds so far (it was admitted for them). May be negative (budget overspent)."""
        pending = sum(max(0, n - self._held((s.tenant, s.session_id), s)) for s, n in list(self.reserved.items()))
        return self.kv_budget_bytes - self.used_bytes() - pending

    async def _open(self, tenant: str, session_id: str, epoch: int, owner: str, create_op_id: str) -> SessionKernel:
        """A new, empty SessionKernel for a rebuild of the session at `epoch` (the registry's: KernelFleet
        counts them), in place of the one the host holds (a torn or older one); `create_op_id`: the session's.
        A rebuild that would take a new slot of a full host is refused (ResourceExhausted: the fleet places it
        again). NOTE: it was not: a session rebuilt on its own host after that host filled up overfilled it.
        Its KV is not checked against the node's budget: what it will hold is known only once its log is replayed (a
        ledger of appends and evictions: nothing to reserve beforehand), and it was admitted under a budget when it
        was made; placement still skips a node with no KV room left (`choose_node`)."""
        kernel, tokenizer = await self._kernel()
        if (tenant, session_id) not in self.sessions:
            self._check_room()  # one in place of the session's own kernel takes no new room
        old = self.sessions.pop((tenant, session_id), None)
        if old is not None:
            old.closed = True
        return self._put(tenant, session_id, kernel, tokenizer, epoch, owner, create_op_id)

    async def _insert(self, tenant: str, session_id: str, owner: str, tokens: list[int] | None = None, *,
                      adopts: bool = True, files: bool = True) -> SessionKernel:
        """A new, empty SessionKernel for a create or fork (`owner`: its op id), refused while the host holds
        the session: AlreadyExists. The check and the insert run with no await between them, so of two tries
        of one name (two callers, two controllers) one gets the name and the other is refused; neither replaces
        the other's session. A retry of the same try (nodes.call repeats a call Ray may have run) gets the
        session that try opened. NOTE: the check was made before the kernel's load was awaited, and the session
        opened after it replaced whatever another try had opened meanwhile.

        One exception: a held kernel no record names, while the session's record names this try (an orphan,
        `_orphaned`), is closed with its log and the try goes on (`_replace_orphan`). The registry decides, as it
        does between controllers (its compare-and-set): the record names one try of a name at a time.

        With `tokens` (a create's prompt, a fork's tokens at its fork point), the session is admitted only while the
        node's KV budget has room for them (`_check_room`; `adopts`, `files`: its), and they stay reserved for it until
        the create or fork ends (`release`)."""
        kernel, tokenizer = await self._kernel()
        key = (tenant, session_id)
        for _ in range(ORPHAN_TRIES):
            held = self.sessions.get(key)
            if held is None:
                need = self._check_room(tenant, tokens, adopts, files)  # a retry that joins its try's takes no new room
                s = self._put(tenant, session_id, kernel, tokenizer, 0, owner)
                if tokens is not None:
                    self.reserved[s] = need  # NOTE: with no await since the check: the next create or fork sees it
                return s
            if owner and held.owner == owner and not held.closed:
                return held
            if not await self._orphaned(held, owner):
                break
            if self.sessions.get(key) is held:  # else it changed while the registry was read: look again
                await self._replace_orphan(held)
        raise AlreadyExists(f"session {session_id} already exists")

    def _put(self, tenant: str, session_id: str, kernel: Any, tokenizer: Any, epoch: int, owner: str,
             create_op_id: str = "") -> SessionKernel:
        key = (tenant, session_id)
        self.remote_adopters.discard(key)
        s = SessionKernel(tenant, session_id, kernel, tokenizer, self.store, self.lanes.run, node_id=self.node_id,
                          epoch=epoch, host=self.name, pid=self.pid, owner=owner, create_op_id=create_op_id)
        self.sessions[key] = s
        return s

    def _check_room(self, tenant: str = "", tokens: list[int] | None = None, adopts: bool = True,
                    files: bool = True) -> int:
        """ResourceExhausted when this host holds its most sessions (`max_sessions`), or (with `tokens`, a create's
        prompt or a fork's tokens) when the node's KV budget has no room for them (placement's rule, `has_room`); the
        KV bytes the session will take, reserved for it meanwhile: its private blocks, whole (less the blocks it adopts
        from the node's tree, with `adopts`: at most len - 1 tokens, `NodeCache.adoptable`) and, with `files` (a
        create), the full blocks it files in the tree. A fork adopts from the tree when it shares its parent's blocks here; one
        that replays its log, or adopts blocks fetched from another node (copies), holds all of its tokens.
        Placement skips a full host; this refuses a create, fork or rebuild that reaches it all the same (a fork that
        names its node, a rebuild on the session's own host, a placement that raced another for the last
        slot or the last KV bytes: creates and forks placed at once all read the same offer).
        NOTE: the KV budget was placement's alone: six creates at once on a node of 6 blocks' budget all read the
        same offer, and the node took all six (31 blocks); then six forks at once of a parent on a node of 8 blocks'
        budget (one at a time: one fork) all stayed there (13 blocks)."""
        if len(self.sessions) >= self.max_sessions:
            raise ResourceExhausted(f"the kernel host of node {self.node_id} holds its most sessions "
                                    f"({self.max_sessions}): close idle sessions, add nodes, or raise --node-max-sessions")
        if tokens is None:
            return 0
        warm, free = self.cache.num_warm(tenant, tokens) if adopts else 0, self.free_bytes()
        bs = self.block_size
        adopted = min(warm, (len(tokens) - 1) // bs * bs)   # it computes its last logits itself
        need = need_bytes(-(-len(tokens) // bs) * bs, adopted, self.bytes_per_token)   # its kernel holds whole blocks
        if not has_room(free, need):
            raise ResourceExhausted(f"node {self.node_id} has no KV room left for a session of {len(tokens)} tokens "
                                    f"(~{need} bytes; {max(free, 0)} of its {self.kv_budget_bytes} free, creates and "
                                    "forks in flight counted): close idle sessions, add nodes, or raise --node-kv-bytes")
        filed = need_bytes(len(tokens) - len(tokens) % self.block_size, warm, self.bytes_per_token) if files else 0
        return need + filed   # what it will hold: its own blocks, and the full ones it files in the tree (publish)

    def release(self, s: SessionKernel) -> None:
        """A create has ended (done, or failed): what it holds counts from now on, not what it reserved."""
        self.reserved.pop(s, None)

    def _drop(self, s: SessionKernel) -> None:
        """A try that failed removes the session it opened, if the host still holds that one (never the
        session of another try that holds the name now); a retry that joined it is refused."""
        key = (s.tenant, s.session_id)
        if self.sessions.get(key) is s:
            del self.sessions[key]
            self.remote_adopters.discard(key)
        self.reserved.pop(s, None)
        s.closed = True

    def _session(self, tenant: str, session_id: str) -> SessionKernel:
        s = self.sessions.get((tenant, session_id))
        if s is None:
            raise SessionGone(f"session {session_id} is not held by host {self.name}")
        return s
