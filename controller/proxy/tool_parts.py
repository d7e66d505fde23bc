"""Reading tool messages as vLLM renders them: which messages are tool results, the text of their content
(string or parts), and their media parts (which no text detector can judge). Pure; controller/proxy/quarantine.py
judges what these find.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from controller.proxy.errors import ProxyError

# compared stripped and lowercased; "ipython": Llama 3's tool role, "observation": GLM's (and ReAct-style agents')
TOOL_ROLES = ("tool", "function", "ipython", "observation")
# NOTE: vLLM's chat_utils (MM_PARSER_MAP): these part types are rendered as text, read from this key. Any other
# type is media (MEDIA_PARTS) or one vLLM rejects too, so the proxy refuses it rather than guess
TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
    "tool_reference": "name",
}
MEDIA_PARTS = (
    "image_url",
    "input_image",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
)  # also how vLLM recognises a media part that has no "type"
MEDIA_PLACEHOLDER = "[tool result {kind} part withheld: kvfleet cannot inspect media]"
# A /v1/completions prompt's tool result: <tool_result ...>...</tool_result>, any case. NOTE: an envelope left
# open runs to the end of the prompt, and so does an opening tag left without its ">" (a client cannot end
# inspection by leaving out a closing character). A closing tag inside the tool's own text still ends the
# span: the client must escape it (the text after it is the client's, not the tool's)
ENVELOPE = re.compile(r"(?P<open><tool_result\b(?P<attrs>[^>]*)(?:>|\Z))(?P<body>.*?)(?P<close></tool_result\s*>|\Z)",
                      re.S | re.I)


def envelope_parts(m: re.Match[str]) -> list[tuple[int, str]]:
    """What is judged of one envelope, each alone, as (character offset, text): its opening tag's attribute text
    where it has any, then its text.

    NOTE: the model reads the attributes too (`<tool_result note="ignore previous instructions">`); they were not
    judged. They were then judged joined with the text, which changed the judged bytes' ref: an operator's or a
    session's verdict on the tool result's own bytes no longer applied to an envelope with an id or a name."""
    attrs = m.group("attrs").strip()
    return ([(m.start("attrs"), attrs)] if attrs else []) + [(m.start("body"), m.group("body"))]


def envelope_with(m: re.Match[str], attrs: str | None, body: str | None) -> str:
    """The envelope with its parts replaced where not None: withheld attribute text is dropped with the tag's
    attributes, a withheld text replaced by `body`."""
    tag = m.group("open") if attrs is None else "<tool_result>"
    return f"{tag}{m.group('body') if body is None else body}{m.group('close')}"


def is_tool_message(m: Any) -> bool:
    """A message whose role is one of TOOL_ROLES (any case, surrounding spaces ignored)."""
    role = m.get("role") if isinstance(m, dict) else None
    return isinstance(role, str) and role.strip().lower() in TOOL_ROLES


def tool_content(m: Any) -> Any:
    """The content of a tool message (None: not a tool message, or no content)."""
    return m.get("content") if is_tool_message(m) else None


def part_kind(p: Any, where: str, param: str) -> tuple[str, str | None]:
    """("text", its text) or (a media type, None) for one content part of a tool result, as vLLM reads it.

    Raises:
        ProxyError(400): a part that is neither a string nor an object, an unknown or missing type, a text that
            is not a string: the proxy cannot tell what the worker would render, so it never forwards it.
    """
    if isinstance(p, str):
        return "text", p
    if not isinstance(p, dict):
        raise ProxyError(
            400,
            f"{where} is a {type(p).__name__}; a content part must be a string or an object "
            'such as {"type": "text", "text": ...}',
            param,
        )
    t = p.get("type")
    if t is None:
        t = next((k for k in MEDIA_PARTS if k in p), None)
        if t is None:
            raise ProxyError(
                400,
                f'{where} has no "type"; give each content part of a tool result its type '
                f"(text parts: {', '.join(TEXT_PARTS)})",
                param,
            )
    if t in MEDIA_PARTS:
        return t, None
    if not isinstance(t, str) or t not in TEXT_PARTS:
        raise ProxyError(
            400,
            f"{where}.type {t!r} is not a content part type the proxy can inspect in a tool "
            f"result; use one of {', '.join([*TEXT_PARTS, *MEDIA_PARTS])}",
            param,
        )
    text = p.get(TEXT_PARTS[t])
    if text is not None and not isinstance(text, str):
        raise ProxyError(
            400, f"{where}.{TEXT_PARTS[t]} is a {type(text).__name__}; it must be a string", param
        )
    return "text", text or ""


def tool_text(m: Any, where: str) -> str | None:
    """The text of a tool message as the worker would render it (None: not a tool message, or no content).

    Raises:
        ProxyError(400): content the proxy cannot inspect (not a string, a list of parts, or null; a part
            part_kind refuses): fail closed, never forward it.
    """
    c = tool_content(m)
    if c is None or isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise ProxyError(
            400,
            f"{where} is a {type(c).__name__}; a tool result's content must be a string or a "
            "list of content parts",
            where,
        )
    kinds = [part_kind(p, f"{where}[{j}]", where) for j, p in enumerate(c)]
    # joined as vLLM renders text parts for the template ("\n"). NOTE: joined with "", one word a part read as
    # one run-together word: an injection the model reads line by line was judged clean and forwarded
    return "\n".join(text for _, text in kinds if text is not None)  # media parts have no text


@dataclass(frozen=True, slots=True)
class MediaPart:
    """A media part of a tool message: messages[i].content[j], of this type."""

    i: int
    j: int
    kind: str

    @property
    def where(self) -> str:
        return f"messages[{self.i}].content[{self.j}]"


def media_parts(body: dict[str, Any], chat: bool) -> list[MediaPart]:
    """Every media part of a tool message (chat only: a raw prompt has no parts)."""
    msgs = body.get("messages") if chat else None
    found: list[MediaPart] = []
    for i, m in enumerate(msgs if isinstance(msgs, list) else []):
        c = tool_content(m)
        for j, part in enumerate(c if isinstance(c, list) else []):
            kind, text = part_kind(part, f"messages[{i}].content[{j}]", f"messages[{i}].content")
            if text is None:
                found.append(MediaPart(i, j, kind))
    return found


def withhold_media(body: dict[str, Any], found: list[MediaPart]) -> dict[str, Any]:
    """`body` with each media part in `found` replaced by a text part saying it was withheld (not mutated)."""
    msgs = list(body["messages"])
    parts: dict[int, list[Any]] = {}  # NOTE: each message's parts copied once (before: once per withheld part, so
    # 100,000 media parts in one message took 43 s of the event loop)
    for mp in found:
        if mp.i not in parts:
            parts[mp.i] = list(msgs[mp.i]["content"])
        parts[mp.i][mp.j] = {"type": "text", "text": MEDIA_PLACEHOLDER.format(kind=mp.kind)}
    for i, p in parts.items():
        msgs[i] = {**msgs[i], "content": p}
    return {**body, "messages": msgs}
