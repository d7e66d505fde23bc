"""A KernelFleet's create and fork (workers/fleet.py): placed on a host with room (a fork on its parent's node while
it has room, sharing the parent's blocks), placed again when that host turns out full or its node died, and
acknowledged by compare-and-set over its `creating` record."""

from __future__ import annotations

import uuid
from typing import Any

from fleet.core.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from fleet.core.kernel.tokenizer import encode_message
from fleet.core.oplog import ForkOp, kv_follows_tokens
from fleet.core.session_types import check_session_id
from workers.call_timeout import fork_timeout
from workers.fleet_rebuild import PLACE_TRIES, FleetRebuild
from workers.nodes import CallTimeout, NodeGone
from workers.packed import pack_ops, unpack_ops
from workers.placement import has_room, need_bytes
from workers.registry import CREATING, SessionRecord
from workers.session_kernel import SessionKernel


class FleetCreate(FleetRebuild):
    """A KernelFleet's create and fork (workers/fleet.py)."""

    def create_session(self, tenant: str, session_id: str, system_prompt: str,
                       tokens: list[int] | None = None) -> dict[str, Any]:
        """Place and start a session; it adopts the node's warm prefix blocks if it has them.

        Args:
            tokens: `system_prompt` already encoded (`encode_message(self.tokenizer, "system", ...)`),
                by a caller that counted them; encoded here when None. Never encoded again below.
        """
        from fleet.cas.base import check_tenant

        check_tenant(tenant)
        check_session_id("session_id", session_id)
        if not isinstance(system_prompt, str) or not system_prompt:
            raise InvalidArgument("the system prompt must be a non-empty str")
        if tokens is None:
            tokens = encode_message(self.tokenizer, "system", system_prompt)  # the piece's own tokens
        with self._names.hold((tenant, session_id)):
            self._claim(tenant, session_id)
            node = self.nodes.place(tenant, tokens)
            # one op id for every try: the log a try left when its host died after logging the system op is
            # recognised by the next, which drops it (SessionKernel._drop_earlier_try) instead of logging twice;
            # it also names what this create made (kernel, log, record), all its cleanup may remove
            rec = SessionRecord(tenant, session_id, node, create_op_id=uuid.uuid4().hex)
            raw = self._insert(rec)
            try:
                for attempt in range(PLACE_TRIES):
                    try:
                        out = self.nodes.call(rec.node, "create_session", tenant, session_id, tokens, rec.create_op_id)
                        break
                    except (NodeGone, ResourceExhausted) as e:
                        if attempt == PLACE_TRIES - 1:
                            raise
                        raw = self._place_again(rec, raw, tokens, e)
            except BaseException:  # not acknowledged: leave nothing of it behind, and nothing else removed
                self._abandon(rec, raw)
                raise
            rec.acknowledged(out["adopted_tokens"], model_id=str(out.get("model_id", "")))
            self._acknowledge(rec, raw)
        return rec.to_dict()

    def _place_again(self, rec: SessionRecord, raw: bytes, tokens: list[int], refused: Exception) -> bytes:
        """A create's or fork's host refused it (`refused`; full: another create took its last slot or KV bytes since
        the placement read the offers) or its node died: what the try left there goes, and the record names another
        node (the one refused skipped; none with room: that host's refusal, `_place_elsewhere`); the record's bytes.
        NOTE: a create that raced another for a host's last slot got ResourceExhausted although another host had room."""
        self._clear(rec)
        rec.node = self._place_elsewhere(rec.tenant, tokens, rec.node, refused)
        return self.registry.replace(rec, raw) or raw   # unchanged unless another controller cleared it

    def _insert(self, rec: SessionRecord) -> bytes:
        """Write a create's or fork's `creating` record while no record holds the name; its bytes. AlreadyExists
        when one does (another controller's create or fork wrote it since the claim)."""
        raw = self.registry.insert(rec)
        if raw is None:
            raise AlreadyExists(f"session {rec.session!r} already exists")
        return raw

    def _acknowledge(self, rec: SessionRecord, raw: bytes) -> None:
        """Write the acknowledged record over its `creating` one. When another controller's create or fork
        cleared that meanwhile (it took it for a crashed one) and took the name, this one is not acknowledged:
        what it made is removed, and the caller gets AlreadyExists."""
        if self.registry.replace(rec, raw) is None:
            self._clear(rec)
            raise AlreadyExists(f"session {rec.session!r} was taken by another create or fork meanwhile")

    def fork(self, tenant: str, session_id: str, child_id: str, share: bool = True,
             node: str | None = None) -> dict[str, Any]:
        """A branch, a session of its own, isolated from the parent (copy-on-write).

        On the parent's node (the usual case, while its KV budget has room) the child adopts the
        parent's block-aligned prefix from the node's object store zero-copy and computes only
        the tokens past it, so N branches cost about the prefix once plus N suffixes. On another
        node (the parent's is full, or `node` names another) the child adopts the same blocks,
        which Ray moves from the parent's node through the object store (`moved_bytes` in the
        record): a copy, but no recompute. `share=False` replays the log (a full private copy).
        Either way the child's log is the parent's + a fork marker, so a regeneration replays it
        bit-identically. A parent whose node is gone is regenerated first (by its fork point).
        """
        check_session_id("child_id", child_id)
        if node is not None and not self.nodes.alive(node):
            raise InvalidArgument(f"node {node!r} is not an alive node of this fleet: see node_stats()")
        self._record(tenant, session_id)
        taken = self.registry.get(tenant, child_id)
        if taken is not None and taken.state != CREATING:
            raise AlreadyExists(f"session {child_id!r} already exists")  # early; the claim below decides
        point = self._call(tenant, session_id, SessionKernel.fork_point)  # ops and tokens read together
        point["ops"] = unpack_ops(point["ops"])                    # packed on the parent's host (workers/packed.py)
        parent = self._record(tenant, session_id)                  # its node, after any regeneration
        op_id = uuid.uuid4().hex                                   # the fork's: its marker and record carry it
        ops = pack_ops([*point["ops"], ForkOp(session_id, len(point["ops"]), op_id)])  # the child's log, packed
        with self._names.hold((tenant, child_id)):                 # NOTE: not the parent's: no lock is held twice
            self._claim(tenant, child_id)
            named = node is not None                               # a node the caller named is not placed again
            node = node or self._fork_node(tenant, parent.node, point["tokens"])
            rec = SessionRecord(tenant, child_id, node, parent=session_id, create_op_id=op_id)
            raw = self._insert(rec)
            try:
                for attempt in range(PLACE_TRIES):
                    try:
                        args = self._fork_args(tenant, session_id, parent.node, rec.node, point, share)
                        out = self.nodes.call(rec.node, "fork", tenant, ops, child_id, *args)
                        break
                    except ResourceExhausted as e:   # its host was full after all: another node, where one has room
                        if named or attempt == PLACE_TRIES - 1:
                            raise
                        raw = self._place_again(rec, raw, point["tokens"], e)
                node = rec.node
            except CallTimeout as e:  # not acknowledged either; named (NOTE: before, "a worker did not answer")
                self._abandon(rec, raw)
                raise fork_timeout(session_id, child_id, e) from e
            except BaseException:  # not acknowledged: leave nothing of it behind, and nothing else removed
                self._abandon(rec, raw)
                raise
            # NOTE: the blocks the child adopted, not the refs it was handed: a child that refused them (its log
            # re-rotated KV) fetched none, and its record said 184,320 bytes moved beside 0 tokens adopted
            moved = 0 if node == parent.node else out["adopted_tokens"] // self.kernel.block_size * self.kernel.block_bytes
            rec.acknowledged(out["adopted_tokens"], moved, str(out.get("model_id", "")))
            self._acknowledge(rec, raw)
        return rec.to_dict()

    def _fork_node(self, tenant: str, parent_node: str, tokens: list[int]) -> str:
        """The parent's node while its KV and session budgets have room for the child (zero-copy sharing; the KV
        budget's rule, `has_room`), else placement. Its host checks again as it admits the child (forks at once).
        NOTE: the session budget was not asked: with --node-max-sessions 2, six forks went to a full node (8)."""
        try:
            offer = self.nodes.call(parent_node, "offer", tenant, tokens)
        except Unavailable:
            return self.nodes.place(tenant, tokens, exclude=parent_node)
        need = need_bytes(len(tokens), offer["matched"], self.nodes.bytes_per_token)
        if has_room(offer["free_bytes"], need) and offer["sessions"] < offer["max_sessions"]:
            return parent_node
        return self.nodes.place(tenant, tokens)  # the parent's node skipped as full (named when every node is)

    def _fork_args(self, tenant: str, parent_id: str, parent_node: str, node: str, point: dict[str, Any],
                   share: bool) -> tuple[Any, ...]:
        """The host's fork arguments past (tenant, ops, child), from the parent's fork `point` (its ops and
        tokens): same node: the parent's id (zero-copy); another node: the parent's block refs (fetched
        across); no sharing, a log whose KV does not follow its tokens (the child replays it op by op), a
        node of another kernel spec (node group), or a parent its host no longer knows: none (replay). The
        tokens always go (the host admits the child by them: its KV budget). NOTE: a replay got none, and no
        fork's host checked its KV budget."""
        tokens = point["tokens"]
        replay = (None, tokens)
        if not share:
            return replay
        if node == parent_node:
            return (parent_id, tokens)
        if not kv_follows_tokens(point["ops"]):
            return replay  # the child would refuse the blocks (a reposition eviction re-rotated them): export none
        if self.nodes.specs.get(node) != self.nodes.specs.get(parent_node):
            return replay  # another backend/device (node group): its KV is not portable, replay it there
        try:
            if self.nodes.call(parent_node, "model_id") != self.nodes.call(node, "model_id"):
                # NOTE: compared by backend and device alone, nodes of one spec on CPUs of other code paths (AVX-512
                # and AVX2) exchanged blocks whose bits differ from what the child's node computes (1.4e-6)
                return replay  # another CPU code path, or other weights: replay it there, exporting nothing
            shared = self.nodes.call(parent_node, "share_prefix", tenant, parent_id, tokens)
        except (NotFound, Unavailable):
            return replay
        return (None, tokens, shared["refs"], shared["model_id"])
