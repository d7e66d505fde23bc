"""Placement helpers: node affinity, actor names, tenant salts, and the node choice rule."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.core.errors import ResourceExhausted
from fleet.core.oplog import Op, blob_refs, parse_log, to_dict

RAY_NAMESPACE = "kvfleet"
NODE_MIN_CPUS = 0.05  # a node hosts sessions only with some CPU (the chart's head runs with num-cpus 0)
NODE_KV_BYTES = 2 << 30  # default KV budget of one node (--node-kv-bytes)
NODE_MAX_SESSIONS = 4096  # default session budget of one node's kernel host (--node-max-sessions)
SALT_BASE = 1 << 40  # salt tokens lie far outside any vocabulary: they never collide with real ids


def fleet_scope(store_url: str) -> str:
    """A short id of the store a fleet writes to. Actor names carry it, so two fleets on different
    stores in one Ray cluster never adopt each other's hosts or sessions (and op logs)."""
    return hashlib.sha256(store_url.encode()).hexdigest()[:10]


# The kernel host's call API (workers/host.py, with its mixins' in host_slots.py and host_restore.py: its methods and
# their arguments). Raise it with any change a host of the previous version would refuse: the host's name carries it,
# so a controller of a new version starts hosts of its own instead of reattaching to a previous version's detached
# ones (their sessions are rebuilt from their logs).
# NOTE: reattached, a previous version's host refused close and rebuild (a new `owner` argument): INTERNAL.
# 3: a fork's log travels packed, and fork_point, working_set and pieces answer packed (workers/packed.py).
HOST_API_VERSION = 3


def host_name(host_id: str, scope: str) -> str:
    """The Ray actor name of a kernel host (workers/host.py): its fleet's scope and API version, and its id."""
    return f"host:{scope}-v{HOST_API_VERSION}:{host_id}"


def previous_host_names(names: Iterable[str], scope: str) -> list[str]:
    """The kernel host names among `names` (actor names) of the fleet of `scope` and a previous host API version:
    below HOST_API_VERSION, or of none (`host:{scope}:{id}`: version 1, named before versions). Never this
    version's, nor a later one's (a controller rolled back leaves a newer fleet's hosts alone), nor another
    fleet's (another scope)."""
    head = f"host:{scope}-v"
    out = []
    for name in names:
        version = name[len(head):].split(":", 1)[0] if name.startswith(head) else ""
        if name.startswith(f"host:{scope}:") or (version.isdigit() and int(version) < HOST_API_VERSION):
            out.append(name)
    return out


def host_ids(node_id: str, num_devices: int) -> list[str]:
    """The kernel hosts of a node with `num_devices` devices for its kernel: one per GPU for a CUDA
    kernel, one for a CPU kernel (`num_devices` 1). The first host's id is the node id (a CPU node's
    only host); the others add `:gpuN`. Invariant: node_of(each id) == node_id."""
    return [node_id] + [f"{node_id}:gpu{i}" for i in range(1, num_devices)]


def node_hosts(node_id: str, resources: dict[str, float], needs_gpu: bool) -> dict[str, float]:
    """A node's kernel hosts (host id -> its share of the node's CPUs): one per GPU for a CUDA kernel
    (each asks Ray for one GPU and owns it), one for a CPU kernel."""
    ids = host_ids(node_id, int(float(resources.get("GPU", 0.0))) if needs_gpu else 1)
    return {hid: float(resources.get("CPU", 1.0)) / len(ids) for hid in ids}


def node_of(host_id: str) -> str:
    """The Ray node id a host id (host_ids) runs on."""
    return host_id.split(":", 1)[0]


def tenant_salt(tenant: str, page_size: int) -> list[int]:
    """One page of tenant-specific pseudo-tokens put in front of every radix key, so tenants never
    match each other's prefixes (the same idea as vLLM's cache_salt folded into block 0)."""
    digest = hashlib.sha256(tenant.encode()).digest()
    return [SALT_BASE + int.from_bytes(digest[(4 * i) % 32:(4 * i) % 32 + 4], "big") for i in range(page_size)]


def on_node(node_id: str) -> Any:
    """A hard node-affinity scheduling strategy (Ray's own; we do not write a scheduler)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def node_resources(extra: dict[str, float] | None = None) -> dict[str, float]:
    """What a node must have to host sessions: NODE_MIN_CPUS CPU plus `extra` (custom resources such
    as an accelerator label, which its kernel host asks Ray for). A node that lacks any never hosts one."""
    return {"CPU": NODE_MIN_CPUS, **(extra or {})}


def eligible_nodes(nodes: Sequence[dict[str, Any]], need: dict[str, float]) -> list[str]:
    """Ids of the alive nodes (rows of `ray.nodes()`) whose total resources cover `need`.

    The head of the chart runs with `num-cpus: 0`: it has no CPU, so it gets no host and
    no session (a hard-pinned actor there could never be scheduled)."""
    return sorted(n["NodeID"] for n in nodes if n.get("Alive")
                  and all(float(n.get("Resources", {}).get(k, 0.0)) >= v for k, v in need.items()))


@dataclass(frozen=True, slots=True)
class NodeOffer:
    """One node's answer to "how much of this prompt do you hold warm, how busy are you, and how
    much of your KV and session budgets is left?". `num_free_bytes` may be negative (budget overspent)."""

    node_id: str
    num_matched: int
    num_sessions: int
    num_free_bytes: int = 1 << 62
    max_sessions: int = NODE_MAX_SESSIONS
    model_id: str = ""  # its kernel's (Kernel.model_id); "" while its weights load


def need_bytes(num_tokens: int, num_matched: int, bytes_per_token: int) -> int:
    """KV bytes a new session of `num_tokens` takes on a node that holds `num_matched` of them warm (adopted, not
    held twice)."""
    return max(0, num_tokens - num_matched) * bytes_per_token


def has_room(num_free_bytes: int, num_need_bytes: int) -> bool:
    """The KV budget's one rule, for placement (`choose_node`) and for the host that admits the session
    (workers/host_slots.py): some budget left, and at least what the new session needs."""
    return num_free_bytes > 0 and num_free_bytes >= num_need_bytes


def choose_node(offers: Sequence[NodeOffer], num_tokens: int = 0, bytes_per_token: int = 0,
                model_id: str = "") -> str:
    """Among the nodes with room for a session of `num_tokens` (what a node holds warm is
    adopted, not held twice) and below their session budget, prefer the node holding the longest warm prefix, then the least
    loaded, then the id. With `model_id` (a lost session's: a rebuild is bit-identical only on a kernel of the
    same one), only the nodes with room whose kernel has it, while there is one.

    Raises:
        ResourceExhausted: no node has room (every KV budget is spent), or there is no node.
    """
    fits = [o for o in offers if has_room(o.num_free_bytes, need_bytes(num_tokens, o.num_matched, bytes_per_token))
            and o.num_sessions < o.max_sessions]
    if not fits:
        free = max((o.num_free_bytes for o in offers), default=0)
        if offers and all(o.num_sessions >= o.max_sessions for o in offers):
            raise ResourceExhausted(
                f"every node's kernel host holds its most sessions ({len(offers)} eligible nodes, "
                f"{max(o.max_sessions for o in offers)} each): close idle sessions, add nodes, or raise "
                "--node-max-sessions")
        raise ResourceExhausted(
            f"no node has room for a session of {num_tokens} tokens (~{num_tokens * bytes_per_token} KV bytes; "
            f"{len(offers)} eligible nodes, the most free: {max(free, 0)} bytes): close idle sessions, add nodes, "
            "or raise the per-node KV budget (--node-kv-bytes)")
    if model_id:
        fits = [o for o in fits if o.model_id == model_id] or fits
    best = min(fits, key=lambda o: (-o.num_matched, o.num_sessions, o.node_id))
    return best.node_id


def session_holder(tenant: str, session_id: str) -> str:
    """Who holds a session's blob references in the store (BlobStore.add_ref's `holder`): one reference per (blob,
    session), however many of its tool results name the blob. Tenants exclude ':', so it names one session."""
    return f"{tenant}:{session_id}"


def add_blob_refs(store: Any, tenant: str, session_id: str, ops: Sequence[Op]) -> None:
    """The session's reference on the blob of each tool result in `ops` (taken again, it changes nothing)."""
    holder = session_holder(tenant, session_id)
    for ref, owner in blob_refs(ops):
        store.add_ref(ref, owner, holder)


def write_fork_log(store: Any, tenant: str, session_id: str, ops: Sequence[Op]) -> None:
    """A fork's log (its parent's ops and its marker, `ops`) in one write, with the child's reference on each of its
    tool results' blobs: the references first, then the log. A write that fails gives back the references unless the
    log holds `ops` (or may: it cannot be read), so a log is never written without all of its references; those a
    store still out kept are the child's own (named), taken once by a retry of the fork and given back by the
    child's close or its name's cleanup (delete_log), never a reference of its parent.
    A log that starts with `ops` already is this fork's, written with its references by an earlier run of it (its
    fork marker carries the fork's own op id): nothing is taken or written again.

    NOTE: the log went first and its references after: a store that failed between two references left the child's
    log with some of them, and the cleanup gave back one for each of its tool results, the parent's references to
    those it never took included (GC then collected a blob the parent still logged). And a fork the fleet ran again
    after its host died (in the child's prefill, past the log) took every reference a second time: the blobs
    outlived both sessions."""
    entries = [to_dict(op) for op in ops]
    if store.oplog_read(tenant, session_id)[:len(entries)] == entries:  # NOTE: the earlier run may have logged
        return                                              # the end of an admission past them (finish_admissions)
    try:
        add_blob_refs(store, tenant, session_id, ops)
        store.oplog_replace(tenant, session_id, entries)
    except BaseException:
        try:
            if store.oplog_read(tenant, session_id) != entries:
                drop_blob_refs(store, blob_refs(ops), session_holder(tenant, session_id))
        except Exception:  # noqa: BLE001 - the store is still out: the child's references stay until its cleanup
            pass
        raise


def drop_blob_refs(store: Any, refs: Iterable[tuple[str, str]], holder: str | None) -> None:
    """Give back `holder`'s reference on each (ref, tenant) of `refs` (None: one taken with no holder, by a release
    before holders). A blob already collected, or whose reference is given back already, is skipped: there is
    nothing of it to give back, and the others' references still are. NOTE: a reference already at 0 (data from an
    older release) raised FailedPrecondition and ended the loop: the log was deleted by then, so the rest of its
    references were never given back and their blobs never collected."""
    from fleet.core.errors import FailedPrecondition, NotFound

    # NOTE: a named reference is one per (blob, holder); unnamed ones are one per logged tool result, so each counts
    for ref, tenant in sorted(set(refs) if holder is not None else refs):
        try:
            store.drop_ref(ref, tenant, holder)
        except (NotFound, FailedPrecondition):
            pass


def delete_log(store: Any, tenant: str, session_id: str, log: Sequence[Op]) -> None:
    """Delete a session's op log (`log`, as read), then give back the session's blob references: every one the store
    says it holds (held_refs), so a delete cut off half-way and run again, the log gone by then, gives back the rest
    and none twice: each reference is the session's own, given back once however often it is asked (BlobStore.
    add_ref's holder). References the log names but the session does not hold were taken with no holder, by a
    release before holders, one per tool result of the log (a blob logged twice, two; a fork's, one per tool result of
its log, its parent's included): the delete that removed the log gives those back, each (of two closes at once,
one). NOTE: it gave back one per blob: a blob a legacy session logged twice kept a reference for good.

    NOTE: the references went first and the log after: a close cut off half-way (the store went out) kept the
    log and its record, so the caller retried, and the retry gave back every reference again, those already given
    included: a blob another session (the fork's parent) still logged then stood at 0 references, GC collected it,
    and that session could never be rebuilt from its log. Then the log went first and the rest of its references
    stayed for good after a cut-off: one too many, the blob never collected."""
    holder = session_holder(tenant, session_id)
    held = set(store.held_refs(holder))  # NOTE: before the log goes: the session is closed, nothing adds to it
    if store.oplog_delete(tenant, session_id):  # NOTE: one unnamed reference per tool result: each is given back
        drop_blob_refs(store, [r for r in blob_refs(log) if r not in held], None)
    drop_blob_refs(store, held, holder)


def undo_blob_ref(store: Any, tenant: str, session_id: str, op: Op) -> None:
    """Give back the reference add_blob_refs took for `op`, whose op log write raised, unless the log holds the op
    all the same (its last entry: a session's ops are serialised) or may (the log cannot be read either), or another
    of its tool results names the same blob (the session's one reference on it is theirs too). A reference kept for
    an op that never landed is the session's own, given back by its close; one given back for an op the log holds
    lets GC collect a blob the session's rebuild fetches.

    NOTE: a Redis reply lost after the RPUSH was applied (a reset connection) gave the reference back: the log held
    the tool result at 0 references, GC collected the blob, and the rebuild of the session from its log (the failed
    call tore it) failed with NotFound for good."""
    mine = blob_refs([op])
    if not mine:
        return
    try:
        log = store.oplog_read(tenant, session_id)
    except Exception:  # noqa: BLE001 - the store is still out: the reference stays (see above)
        return
    if log and log[-1] == to_dict(op):
        return
    if set(mine) & set(blob_refs(parse_log(log))):
        return
    drop_blob_refs(store, mine, session_holder(tenant, session_id))
