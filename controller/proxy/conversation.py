"""A chat's messages as vLLM hands them to a Hugging Face chat template, for the local tokenizer. Pure.

vLLM (chat_utils.py `_parse_chat_message_content`) rebuilds each message before the template runs. In its "string"
content format (a template that reads each message's content as text; see the NOTE below) the content becomes one
string: null or missing content is "", a string is itself, and a list of parts is the texts of its text parts
joined with "\\n". A text part is a bare string, or an object whose `type` is "text", "input_text" or "output_text"
(its `text`), "refusal" (its `refusal`), "thinking" (its `thinking`) or "tool_reference" (its `name`); a "text" or
"refusal" part without its string is skipped. Beside the content the template gets only: an assistant's
`tool_calls` (when not null), `reasoning` (also as `reasoning_content`), a tool's `tool_call_id`, a string `name` or
`task`, and a developer's `tools`.

Anything else in a part (an image, audio, video or embeddings part; a part vLLM refuses) makes conversation()
None: the chat is tokenized by the workers' /tokenize, which knows the model's media placeholders and its refusals.

NOTE: a list of parts reached the template as it was sent, and the template rendered the Python list
("[{'type': 'text', 'text': ...}]"): ids no worker computes, so a chat of parts was routed COLD on every turn
(tests/controller/proxy/test_proxy_hf_render.py). The parity probes (controller/proxy/tokenize.py PROBES) now include
a chat of parts: a worker whose template takes the parts as a list (vLLM's "openai" content format, which renders
them otherwise) is caught there, and the workers' /tokenize is used.
"""

from __future__ import annotations

from typing import Any

# a text part's type -> the key its text is under
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking", "tool_reference": "name"}
SKIPPED_WHEN_EMPTY = ("text", "refusal")  # vLLM skips these parts when their string is missing (null)


def content_text(content: Any) -> str | None:
    """A message's content as vLLM's "string" format renders it; None when the local tokenizer cannot."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts: list[str] = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or part.get("uuid") is not None:  # NOTE: vLLM reads a part with a uuid as media
            return None
        text = part.get(TEXT_PARTS[kind])
        if text is None and kind in SKIPPED_WHEN_EMPTY:
            continue
        if not isinstance(text, str):
            return None
        texts.append(text)
    return "\n".join(texts)


def _message(m: dict[str, Any]) -> dict[str, Any] | None:
    role, content = m.get("role"), content_text(m.get("content"))
    if not isinstance(role, str) or content is None:
        return None
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if m.get("tool_calls") is not None:
            out["tool_calls"] = m["tool_calls"]
        if m.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = m["reasoning"]
    elif role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` as vLLM passes them to the chat template; None when one of them is left to the workers."""
    out = []
    for m in messages:
        msg = _message(m)
        if msg is None:
            return None
        out.append(msg)
    return out
