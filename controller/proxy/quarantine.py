"""Quarantine enforcement: every tool result in a request is judged before any worker sees it.

Where the tool results are (bytes = the text's UTF-8; ref = their SHA-256, hex):

    /v1/chat/completions  each message whose role is "tool", "function" or "ipython" (any case): its content,
                          a string or a list of parts whose text (string parts, "text" and "refusal") is
                          joined ("" between them); content that cannot be inspected is a 400
    /v1/completions       each <tool_result ...>...</tool_result> span (any case, attributes allowed; one left
                          open runs to the end) of a string prompt (or of each string of a batched prompt):
                          the text between the tags. Token-id prompts are not inspected.

The controller judges (JudgeToolResults, with the client's token: its tenant's records, one verdict per
bytes fleet-wide, an operator's late verdict first). The proxy keeps no verdicts of its own, so a verdict
set later applies to the very next request that carries the bytes. Per tenant policy:

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
from controller.proxy.metrics import ProxyMetrics
from fleet.verdict import CLEAN, QUARANTINED

POLICIES = ("placeholder", "refuse", "off")
TOOL_ROLES = ("tool", "function", "ipython")  # compared stripped and lowercased; "ipython": Llama 3's tool role
# NOTE: any case, attributes allowed; an envelope left open runs to the end of the prompt (a client cannot end
# inspection by leaving out the closing tag). A closing tag inside the tool's own text still ends the span: the
# client must escape it (the text after it is the client's, not the tool's)
ENVELOPE = re.compile(r"(<tool_result\b[^>]*>)(.*?)(</tool_result\s*>|\Z)", re.S | re.I)
TEXT_KEYS = ("text", "refusal")  # the keys of a content part vLLM renders as text
PLACEHOLDER = "[tool result sha256:{ref} withheld: quarantined by kvfleet]"
# NOTE: below the controller's default gRPC message limit (4 MiB) with room for framing; larger sets of
# tool results go in several calls, and one larger tool result is refused (413) rather than sent
MAX_JUDGE_BYTES = 3 << 20
MAX_JUDGE_RESULTS = 256  # the controller's limit per call (controller.verdicts.MAX_RESULTS)
# NOTE: a first inspection costs CPU in the controller (the rules read several views of the text: about 3 s
# per MiB on a loaded 2-core machine), far more than a route; later ones are a store lookup
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


def _tool_text(m: Any, where: str) -> str | None:
    """The text of a tool message as the worker would render it (None: not a tool message, or no content).

    Plain-string parts and a part's "text"/"refusal" are text (vLLM renders them); media parts carry none.
    Raises:
        ProxyError(400): content the proxy cannot inspect (not a string, a list of parts, or null; a part that
            is neither a string nor an object; a text key that is not a string): fail closed, never forward it.
    """
    role = m.get("role") if isinstance(m, dict) else None
    if not isinstance(role, str) or role.strip().lower() not in TOOL_ROLES:
        return None
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise ProxyError(400, f"{where} is a {type(c).__name__}; a tool result's content must be a string or a "
                              "list of content parts", where)
    texts = []
    for j, p in enumerate(c):
        if isinstance(p, str):
            texts.append(p)
            continue
        if not isinstance(p, dict):
            raise ProxyError(400, f"{where}[{j}] is a {type(p).__name__}; a content part must be a string or an "
                                  "object such as {\"type\": \"text\", \"text\": ...}", where)
        for k in TEXT_KEYS:
            if k in p and p[k] is not None and not isinstance(p[k], str):
                raise ProxyError(400, f"{where}[{j}].{k} is a {type(p[k]).__name__}; it must be a string", where)
        texts.extend(p[k] for k in TEXT_KEYS if isinstance(p.get(k), str))
    return "".join(texts)


def _in_prompt(p: str, where: str, fn: Rewrite) -> str:
    def one(m: re.Match[str]) -> str:
        new = fn(m.group(2), f"{where}@{m.start(2)}")
        return m.group(0) if new is None else m.group(1) + new + m.group(3)

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
            text = _tool_text(m, where)
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
                 metrics: ProxyMetrics) -> None:
        self.default, self.per_tenant, self.control, self.metrics = default, dict(per_tenant), control, metrics

    def policy(self, tenant: str) -> str:
        return self.per_tenant.get(tenant, self.default)

    async def enforce(self, body: dict[str, Any], chat: bool, tenant: str,
                      token: str | None) -> tuple[dict[str, Any], list[Hit]]:
        """(the body to tokenize and forward, the quarantined tool results it had).

        Raises:
            ProxyError(400): the tenant's policy is "refuse" and a tool result is quarantined.
        """
        policy = self.policy(tenant)
        found = tool_results(body, chat) if policy != "off" else []
        if not found:
            return body, []
        texts = list(dict.fromkeys(text for _, text in found))
        judged: dict[str, Any] = {}
        for batch in _batches([t.encode() for t in texts], found):
            judged.update(zip((b.decode() for b in batch), await self.control.judge(batch, policy, token, JUDGE_TIMEOUT_S),
                              strict=True))
        for j in judged.values():
            self.metrics.judged.labels(QUARANTINED if j.quarantined else CLEAN, j.source).inc()
        hits = [Hit(where, judged[t].ref, tuple(judged[t].reasons), judged[t].source, policy)
                for where, t in found if judged[t].quarantined]
        for h in hits:
            self.metrics.quarantined.labels(policy, h.source).inc()
        if not hits:
            return body, []
        if policy == "refuse":
            raise ProxyError(400, "the request carries quarantined tool results and this tenant's policy refuses "
                                  "it: " + "; ".join(f"{h.where} (sha256:{h.ref}, {h.source}: "
                                                     f"{', '.join(h.reasons)})" for h in hits)
                             + ". Drop or replace them and send again.", hits[0].where.split("@")[0])

        def fn(text: str, where: str) -> str | None:
            j = judged[text]
            return PLACEHOLDER.format(ref=j.ref) if j.quarantined else None

        return rewrite(body, chat, fn), hits


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
