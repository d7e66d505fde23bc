"""Which tool results each stored /v1/responses answer's conversation carries, so that a follow-up naming it is
refused once one of them is quarantined.

vLLM keeps a stored response's whole conversation (its input, and its `previous_response_id`'s before it) in the
memory of the worker that answered. A follow-up naming the response sends only its new items: a tool result judged
clean when it was sent (or let through while a heavier judge's verdict was still to come) and quarantined since (a
late verdict, an operator's verdict on its hash, the tenant's blob marked) is not in the request, so the proxy cannot
withhold it, and the worker would render it again. So the proxy remembers, per tenant, each answered response id's
parent and the digests (SHA-256) of the tool results its request carried (each alone and each turn's together, as
they are judged; read off the body as forwarded, so a withheld one counts as its placeholder, never as what it
withheld), and before a follow-up it asks the controller what it knows now of the chain's digests (KnownVerdicts:
no bytes, nothing inspected); one quarantined: 409, nothing forwarded, and the client resends the conversation
without `previous_response_id` (its tool results are then judged, and withheld, as any request's).

A chain the proxy has no whole record of (it restarted, another replica answered, the record was evicted) is
refused where a digest of the part it holds is quarantined, and otherwise answered, logged and counted
(`kvfleet_proxy_response_chains_total{outcome="unknown"}`): failing closed would refuse every follow-up after each
proxy restart and across replicas, where vLLM answers them; docs/proxy.md states the choice.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

from controller.proxy.errors import ProxyError
from controller.proxy.judged import JOIN, turns, windows
from controller.proxy.quarantine import tool_results
from controller.proxy.responses import chat_of, valid_id
from controller.proxy.tool_parts import TOOL_ROLES

if TYPE_CHECKING:
    from controller.proxy.server import Proxy

log = logging.getLogger("kvfleet.proxy")
DIGEST = 32  # bytes of one SHA-256
MAX_ASKED = 1024  # digests per KnownVerdicts call (controller.verdicts.MAX_REFS)


class Record(NamedTuple):
    parent: str | None
    digests: bytes  # DIGEST bytes each, concatenated (one object, not one string per digest)


class Lineage:
    """Response id -> (its parent id, the digests its request carried), per tenant: at most `per_tenant` ids and
    `digests_per_tenant` digests each, least recently used first out (so one tenant's answers never push out another's
    records), and at most `max_tenants` tenants, the least recently active leaving with its records. A chain is read
    back to its first response, or until an id is not held (then the whole chain is unknown)."""

    def __init__(self, per_tenant: int = 1024, digests_per_tenant: int = 4096, max_tenants: int = 256) -> None:
        self.per_tenant, self.digests_per_tenant, self.max_tenants = per_tenant, digests_per_tenant, max_tenants
        self._records: OrderedDict[str, OrderedDict[str, Record]] = OrderedDict()
        self._num_digests: dict[str, int] = {}

    def add(self, tenant: str, rid: str, rec: Record) -> None:
        num = len(rec.digests) // DIGEST
        if num > self.digests_per_tenant:
            return  # NOTE: kept, it would push out all the tenant's others; its follow-ups are unknown (answered)
        recs = self._records.get(tenant)
        if recs is None:
            recs = self._records[tenant] = OrderedDict()
            self._num_digests[tenant] = 0
            if len(self._records) > self.max_tenants:
                gone, _ = self._records.popitem(last=False)
                del self._num_digests[gone]
        self._records.move_to_end(tenant)
        old = recs.pop(rid, None)
        recs[rid] = rec
        n = self._num_digests[tenant] + num - (len(old.digests) // DIGEST if old else 0)
        while len(recs) > self.per_tenant or n > self.digests_per_tenant:
            _, out = recs.popitem(last=False)
            n -= len(out.digests) // DIGEST
        self._num_digests[tenant] = n

    def chain(self, tenant: str, rid: str) -> list[str] | None:
        """The digests (hex, first seen first, once each) of every response of `rid`'s chain, or None: some id of it
        is not held."""
        found, whole = self.walk(tenant, rid)
        return found if whole else None

    def walk(self, tenant: str, rid: str) -> tuple[list[str], bool]:
        """The digests (hex, first seen first, once each) of the responses of `rid`'s chain held here, from `rid`
        back until an id is not held; and whether that reached its first response (the whole chain)."""
        recs = self._records.get(tenant)
        if recs is None:
            return [], False
        self._records.move_to_end(tenant)
        found: dict[str, None] = {}
        ids: list[str] = []
        at: str | None = rid
        while at is not None and len(ids) < len(recs):  # NOTE: bounded: more ids than held is a cycle
            rec = recs.get(at)
            if rec is None:
                break
            ids.append(at)
            found.update(dict.fromkeys(rec.digests[k:k + DIGEST].hex() for k in range(0, len(rec.digests), DIGEST)))
            at = rec.parent
        for i in reversed(ids):  # used: the first response first, so that `rid` is the last to leave
            recs.move_to_end(i)
        return list(found), at is None


def carried(chat: dict[str, Any] | None) -> tuple[str, ...]:
    """The digests of the tool results a /v1/responses body carries, read as a chat (responses.as_chat): each alone
    and each turn's together (as the Enforcer judges them, controller/proxy/judged.py), once each."""
    if chat is None:
        return ()
    found = tool_results(chat, True)
    text_of = dict(found)
    groups = [g for run in turns(chat, True, TOOL_ROLES) for g in windows(run, lambda w: len(text_of[w].encode()))]
    texts = [t for _, t in found] + [JOIN.join(text_of[w] for w in g) for g in groups]
    return tuple(dict.fromkeys(hashlib.sha256(t.encode()).hexdigest() for t in texts))


async def check(p: Proxy, tenant: str, token: str | None, prev: str) -> None:
    """Refuse a follow-up naming `prev` when a tool result of its chain is quarantined now; answer it (logged,
    counted) when the proxy has no record of the chain.

    Raises:
        ProxyError(409): a tool result of the chain is quarantined now.
    """
    # NOTE: the part of a chain held here is checked even where the rest is not: before, a chain with one id not held
    # (a response answered before a restart, or by another replica) was answered unchecked, the tool results its
    # later turns carried through this proxy, quarantined since, with it
    refs, whole = p.lineage.walk(tenant, prev)
    bad = []
    for k in range(0, len(refs), MAX_ASKED):
        bad += [j for j in await p.control.known(refs[k:k + MAX_ASKED], token) if j.quarantined]
    if not bad and not whole:  # NOTE: the id is a capability: not logged
        log.info("proxy: a /v1/responses follow-up of tenant %s names a response whose chain the proxy has no "
                 "whole record of; its stored tool results were not all checked again", tenant)
        p.metrics.chains.labels("unknown").inc()
        return
    if not bad:
        p.metrics.chains.labels("clean").inc()
        return
    p.metrics.chains.labels("quarantined").inc()
    listed = "; ".join(f"sha256:{j.ref} ({j.source}: {', '.join(j.reasons)})" for j in bad[:8])
    raise ProxyError(409, f"the conversation stored for previous_response_id carries tool results quarantined after it "
                          f"was answered ({listed}{'; ...' if len(bad) > 8 else ''}), and the worker would read them "
                          "again. Send the conversation again in `input`, without previous_response_id: its tool "
                          "results are then judged, and quarantined ones withheld, as in any request.",
                     "previous_response_id")


async def follow_up(p: Proxy, body: dict[str, Any], tenant: str, token: str | None) -> Record | None:
    """What to record for the answer to /v1/responses `body` (as forwarded): its parent (`previous_response_id`) and
    the digests it carries; the follow-up refused first per `check`. None: the tenant's quarantine policy is off
    (nothing is judged, so nothing is recorded or checked). NOTE: the input is read as a chat only past that check
    (before, every tenant's request paid for it: ~35 us for 40 tool outputs of 4 KiB)."""
    if p.enforcer.policy(tenant) == "off":
        return None
    prev = valid_id(body.get("previous_response_id"))
    if prev is not None:
        await check(p, tenant, token, prev)
    return Record(prev, b"".join(bytes.fromhex(r) for r in carried(chat_of(body))))
