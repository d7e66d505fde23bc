"""A chat's messages as vLLM hands them to a Hugging Face chat template, for the local tokenizer. Pure.

vLLM (chat_utils.py `_parse_chat_message_content`) rebuilds each message before the template runs. In its "string"
content format (a template that reads each message's content as text; see the NOTE below) the content becomes one
string: null or missing content is "", a string is itself, and a list of parts is the texts of its text parts
joined with "\\n". A text part is a bare string, or an object whose `type` is "text", "input_text" or "output_text"
(its `text`), "refusal" (its `refusal`), "thinking" (its `thinking`) or "tool_reference" (its `name`); a "text" or
"refusal" part without its string is skipped. Beside the content the template gets only: an assistant's
`tool_calls` (when not null), `reasoning` (also as `reasoning_content`), a tool's `tool_call_id`, a string `name` or
`task`, and a developer's `tools`. Each tool call's `function.arguments` is the object its JSON string decodes to,
as vLLM's `_postprocess_messages` makes it for templates that write the arguments themselves: {} for a string that is
not JSON and for a value that is neither a string, an object nor a list; an empty `tool_calls` is left out.

Anything else in a part (an image, audio, video or embeddings part; a part vLLM refuses) makes conversation()
None: the chat is tokenized by the workers' /tokenize, which knows the model's media placeholders and its refusals.

NOTE: a list of parts reached the template as it was sent, and the template rendered the Python list
("[{'type': 'text', 'text': ...}]"): ids no worker computes, so a chat of parts was routed COLD on every turn
(tests/controller/proxy/test_proxy_hf_render.py). The parity probes (controller/proxy/tokenize.py PROBES) now include
a chat of parts: a worker whose template takes the parts as a list (vLLM's "openai" content format, which renders
them otherwise) is caught there, and the workers' /tokenize is used.

NOTE: tool call arguments reached the template as the JSON string the client sent, and a template that writes them
with `tojson` wrote the string quoted and escaped ("{\\"city\\": ...}") where vLLM writes the object: ids no worker
computes for every turn after a tool call.
"""

from __future__ import annotations

import json
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


def _tool_calls(calls: list[Any]) -> list[Any] | None:
    """An assistant's tool calls with their arguments decoded, copied (the request's own are forwarded as sent);
    None for a call without a `function` object (vLLM's error, left to the workers)."""
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            return None
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:  # NOTE: empty, blank or malformed: vLLM's {} (older releases refused it)
                args = {}
        elif not isinstance(args, (dict, list)):
            args = {}
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def _message(m: dict[str, Any]) -> dict[str, Any] | None:
    role, content = m.get("role"), content_text(m.get("content"))
    if not isinstance(role, str) or content is None:
        return None
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            if (calls := _tool_calls(calls)) is None:
                return None
            out["tool_calls"] = calls
        elif calls is not None and not isinstance(calls, list):
            out["tool_calls"] = calls  # as vLLM passes it on
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
