"""Quarantine enforcement: every tool result in a request is judged before any worker sees it.

Where the tool results are (bytes = the text's UTF-8; ref = their SHA-256, hex):

    /v1/chat/completions  each message whose role is "tool", "function", "ipython" or "observation" (any case):
                          its content (and its `name`, judged alone: controller/proxy/judged.py),
                          a string or a list of parts whose text is joined ("" between them): string parts and
                          every part type vLLM renders as text (TEXT_PARTS: text, input_text, output_text,
                          refusal, thinking, tool_reference); media parts (MEDIA_PARTS) carry no text and get
                          the proxy's media policy (pass, withhold, refuse); content that cannot be inspected
                          (an unknown part type, a part without a type or media) is a 400
    /v1/responses         each `input` item carrying a tool's output (function_call_output, ...): read as a chat's
                          tool message, its message items as the chat's messages (controller/proxy/responses.py)
    /v1/completions       each <tool_result ...>...</tool_result> span (any case; one left open, or an opening
                          tag left without its ">", runs to the end) of a string prompt (or of each string of
                          a batched prompt): the text between the tags, and the opening tag's attribute text
                          where it has any, each alone (tool_parts.envelope_parts). Token-id prompts are not
                          inspected.

Beyond each alone (controller/proxy/judged.py): the tool results of a turn together, and assistant
messages that quote a withheld result verbatim.

The controller judges (JudgeToolResults, with the client's token: its tenant's records, one verdict per
bytes and tenant fleet-wide, an operator's late verdict first; heavy layers later: docs/quarantine_path.md).
The proxy keeps no verdicts of its own, so a verdict set later applies to the very next request that
carries the bytes. Per tenant policy:

    placeholder  the quarantined text is replaced by PLACEHOLDER (naming its ref) before tokenizing,
                 routing and forwarding: the worker never receives the bytes, and the route follows the
                 changed prefix (blocks past the replaced span are not this conversation's prefix any more)
    refuse       400 naming the refs and where they sit; nothing is forwarded
    off          no inspection
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from controller.proxy.control import ControlClient
from controller.proxy.errors import ProxyError
from controller.proxy.judged import JOIN, NAME_PLACEHOLDER, rename, tool_names, turns, windows
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.quotes import unquote
from controller.proxy.tool_parts import (  # noqa: F401 - MEDIA_PLACEHOLDER, MediaPart, part_kind: re-exported
    ENVELOPE,
    MEDIA_PLACEHOLDER,
    TOOL_ROLES,
    MediaPart,
    envelope_parts,
    envelope_with,
    is_tool_message,
    media_parts,
    part_kind,
    tool_text,
    withhold_media,
)
from fleet.core.verdict import CLEAN, QUARANTINED

POLICIES = ("placeholder", "refuse", "off")
MEDIA_POLICIES = ("pass", "withhold", "refuse")
PLACEHOLDER = "[tool result sha256:{ref} withheld: quarantined by kvfleet]"
# NOTE: below the controller's default gRPC message limit (4 MiB) with room for framing; larger sets of
# tool results go in several calls, and one larger tool result is refused (413) rather than sent
MAX_JUDGE_BYTES = 3 << 20
MAX_JUDGE_RESULTS = 256  # the controller's limit per call (controller.verdicts.MAX_RESULTS)
# NOTE: a first inspection costs CPU in the controller: the fast layers a request waits for (rules + learned:
# about 3 ms per KiB, docs/quarantine_default.md) and, off the request path, any heavy layer (the encoder:
# 100-200 ms per KiB, docs/quarantine_path.md); far more than a route. Later ones are a store lookup.
JUDGE_TIMEOUT_S = 30.0

Rewrite = Callable[[str, str], str | None]  # (text, where) -> replacement, or None to keep it


@dataclass(frozen=True, slots=True)
class Hit:
    """A quarantined tool result of this request: where it sat, its ref, why, and who decided."""

    where: str
    ref: str
    reasons: tuple[str, ...]
    source: str
    action: str

    def as_json(self) -> dict[str, Any]:
        return {"where": self.where, "ref": self.ref, "reasons": list(self.reasons), "source": self.source,
                "action": self.action}


def _in_prompt(p: str, where: str, fn: Rewrite) -> str:
    def one(m: re.Match[str]) -> str:
        new = [fn(text, f"{where}@{at}") for at, text in envelope_parts(m)]
        if all(x is None for x in new):
            return m.group(0)
        return envelope_with(m, new[0] if len(new) == 2 else None, new[-1])

    return ENVELOPE.sub(one, p)


def rewrite(body: dict[str, Any], chat: bool, fn: Rewrite) -> dict[str, Any]:
    """`body` with each tool result's text replaced by fn(text, where) where that is not None.

    The input is not mutated; parts that change are copied. `where` names the place for people:
    "messages[3].content", or "prompt@120" (the character offset of the span in the prompt).
    """
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return body
        out = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}].content"
            text = tool_text(m, where)
            new = None if text is None else fn(text, where)
            out.append(m if new is None else {**m, "content": new})
        return {**body, "messages": out}
    p = body.get("prompt")
    if isinstance(p, str):
        return {**body, "prompt": _in_prompt(p, "prompt", fn)}
    if isinstance(p, list) and any(isinstance(x, str) for x in p):  # NOTE: any: a mixed list is inspected too
        return {**body, "prompt": [_in_prompt(x, f"prompt[{i}]", fn) if isinstance(x, str) else x
                                   for i, x in enumerate(p)]}
    return body


def tool_results(body: dict[str, Any], chat: bool) -> list[tuple[str, str]]:
    """(where, text) of every tool result in the request, in order."""
    found: list[tuple[str, str]] = []

    def note(text: str, where: str) -> None:
        found.append((where, text))

    rewrite(body, chat, note)
    return found


class Enforcer:
    """Judges a request's tool results through the controller and applies the tenant's policy."""

    def __init__(self, default: str, per_tenant: Mapping[str, str], control: ControlClient,
                 metrics: ProxyMetrics, media: str = "pass") -> None:
        self.default, self.per_tenant, self.control, self.metrics = default, dict(per_tenant), control, metrics
        self.media = media

    def policy(self, tenant: str) -> str:
        return self.per_tenant.get(tenant, self.default)

    async def enforce(self, body: dict[str, Any], chat: bool, tenant: str,
                      token: str | None) -> tuple[dict[str, Any], list[Hit]]:
        """(the body to tokenize and forward, what was kept from the workers: its quarantined tool results and,
        with --tool-media withhold, its tool results' media parts).

        Raises:
            ProxyError(400): the tenant's policy is "refuse" and a tool result is quarantined, or the proxy's
                media policy is "refuse" and a tool result carries a media part.
        """
        policy = self.policy(tenant)
        if policy == "off":
            return body, []
        if chat and not _any_tool_message(body):
            # NOTE: what a turn without tool messages costs (most turns): one pass over the roles. Every check
            # below reads tool messages only (their content, parts and names), so it would find nothing
            return body, []
        body, withheld = self.media_policy(body, chat)
        body, hits = await self.judge(body, chat, policy, token)
        return body, withheld + hits

    def media_policy(self, body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], list[Hit]]:
        """Tool results' media parts, which no text detector can judge: passed as they are, withheld (each
        replaced by a text part saying so), or the request refused (400), per --tool-media.

        Raises:
            ProxyError(400): the proxy's media policy is "refuse" and a tool result carries a media part.
        """
        found = media_parts(body, chat)
        for mp in found:
            self.metrics.tool_media.labels(mp.kind, self.media).inc()
        if not found or self.media == "pass":
            return body, []
        if self.media == "refuse":
            raise ProxyError(400, "tool results carry media parts, which the proxy cannot inspect, and its "
                                  "--tool-media policy refuses them: "
                             + ", ".join(f"{mp.where} ({mp.kind})" for mp in found)
                             + ". Send the tool's output as text.", found[0].where)
        return withhold_media(body, found), [Hit(mp.where, "", (f"media:{mp.kind}",), "media", "withhold")
                                             for mp in found]

    async def judge(self, body: dict[str, Any], chat: bool, policy: str,
                    token: str | None) -> tuple[dict[str, Any], list[Hit]]:
        """The controller's verdicts on the body's tool results, applied per `policy` (enforce's contract): each
        result and each tool message's name alone, then each turn's results together (joined as sent, so a
        piece withheld alone cannot cut the phrase the joined text is caught by), then assistant quotes of
        withheld ones."""
        found = tool_results(body, chat)
        names = tool_names(body, chat, TOOL_ROLES)
        if not found and not names:
            return body, []
        text_of = dict(found + names)
        judged = await self._verdicts([t for _, t in found + names], found + names, policy, token)
        hits = [Hit(where, judged[t].ref, tuple(judged[t].reasons), judged[t].source, policy)
                for where, t in found + names if judged[t].quarantined]
        repl = {h.where: (NAME_PLACEHOLDER if h.where.endswith(".name") else PLACEHOLDER.format(ref=h.ref))
                for h in hits}
        groups = [g for run in turns(body, chat, TOOL_ROLES)
                  for g in windows(run, lambda w: len(text_of[w].encode()))]
        # NOTE: a dict by joined text kept one group per text: a turn repeated later in the history (an agent
        # resending it, a tool answering the same) lost its placeholders, and its pieces went through
        joined = [(JOIN.join(text_of[w] for w in g), g) for g in groups if any(w not in repl for w in g)]
        together = await self._verdicts([t for t, _ in joined], [(g[0], t) for t, g in joined], policy, token)
        # what an assistant may not quote back: each withheld text (a result, a name, a turn withheld as a whole)
        # with its placeholder and the hit it came from. NOTE: names and turns were left out: a turn withheld only
        # joined (each piece shorter than a quote), or a withheld name, quoted by the assistant, reached the worker
        # whole (review finding)
        quotable = {text_of[h.where]: (repl[h.where], h) for h in hits}
        for text, g in joined:
            j = together[text]
            if j.quarantined:
                for w in (w for w in g if w not in repl):
                    hits.append(Hit(w, j.ref, (*j.reasons, f"turn:{g[0]}..{g[-1]}"), j.source, policy))
                    repl[w] = PLACEHOLDER.format(ref=j.ref)
                    quotable.setdefault(text_of[w], (repl[w], hits[-1]))
                quotable.setdefault(text, (PLACEHOLDER.format(ref=j.ref), hits[-1]))
        body, quoted = unquote(body, chat, {t: p for t, (p, _) in quotable.items()})
        for where, t in quoted:
            src = quotable[t][1]
            hits.append(Hit(where, src.ref, (*src.reasons, f"quotes:{src.where}"), src.source, policy))
        for h in hits:
            self.metrics.quarantined.labels(policy, h.source).inc()
        if not hits:
            return body, []
        if policy == "refuse":
            raise ProxyError(400, "the request carries quarantined tool results and this tenant's policy refuses "
                                  "it: " + "; ".join(f"{h.where} (sha256:{h.ref}, {h.source}: "
                                                     f"{', '.join(h.reasons)})" for h in hits)
                             + ". Drop or replace them and send again.", hits[0].where.split("@")[0])
        body = rename(body, {w: r for w, r in repl.items() if w.endswith(".name")})
        return rewrite(body, chat, lambda text, where: repl.get(where)), hits

    async def _verdicts(self, texts: list[str], found: list[tuple[str, str]], policy: str,
                        token: str | None) -> dict[str, Any]:
        """{text: the controller's Judgement} for each distinct text, in calls within the controller's limits."""
        distinct = list(dict.fromkeys(texts))
        judged: dict[str, Any] = {}
        if not distinct:
            return judged
        for batch in _batches([t.encode() for t in distinct], found):
            got = await self.control.judge(batch, policy, token, JUDGE_TIMEOUT_S)
            judged.update(zip((b.decode() for b in batch), got, strict=True))
        for j in judged.values():
            self.metrics.judged.labels(QUARANTINED if j.quarantined else CLEAN, j.source).inc()
        return judged


def _any_tool_message(body: dict[str, Any]) -> bool:
    msgs = body.get("messages")
    return isinstance(msgs, list) and any(is_tool_message(m) for m in msgs)


def _batches(blobs: list[bytes], found: list[tuple[str, str]]) -> list[list[bytes]]:
    """`blobs` in calls of at most MAX_JUDGE_BYTES and MAX_JUDGE_RESULTS each; 413 for one tool result larger
    than MAX_JUDGE_BYTES."""
    out: list[list[bytes]] = [[]]
    size = 0
    for b in blobs:
        if len(b) > MAX_JUDGE_BYTES:
            where = next(w for w, t in found if t.encode() == b)
            raise ProxyError(413, f"the tool result at {where} is {len(b)} bytes; the proxy has tool results of "
                                  f"at most {MAX_JUDGE_BYTES} bytes judged: split or shorten it", where.split("@")[0])
        if (size + len(b) > MAX_JUDGE_BYTES or len(out[-1]) == MAX_JUDGE_RESULTS) and out[-1]:
            out.append([])
            size = 0
        out[-1].append(b)
        size += len(b)
    return out
