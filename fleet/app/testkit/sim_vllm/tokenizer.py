"""A tiny deterministic tokenizer and chat template for the stand-in (not a real vocabulary).

Words and punctuation map to ids by crc32; the chat template mirrors ChatML's shape with fixed
special ids, so that the proxy and the stand-in tokenize identically.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

from fleet.core.errors import InvalidArgument

IM_START, IM_END, NEWLINE = 151644, 151645, 198
VOCAB = 150000
_WORD = re.compile(r"\w+|[^\w\s]")


def tokenize(text: Any) -> list[int]:
    """Deterministic ids for `text` (words and punctuation)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}")
    return [100 + zlib.crc32(w.encode()) % VOCAB for w in _WORD.findall(text)]


# NOTE: as vLLM's chat_utils renders content parts for a text-only model: these types are text, read from this
# key, and joined with "\n"; a media part is refused (the stand-in serves no multimodal model)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
              "thinking": "thinking", "tool_reference": "name"}


def content_text(content: Any) -> str:
    """A message's content as the chat template sees it: a string, or a list of parts rendered as vLLM does.

    NOTE: null (or missing) content is empty text, as vLLM renders it: OpenAI's assistant turn that calls tools
    has "content": null beside its "tool_calls" (which the stand-in's template leaves out of the text).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument("each message needs string 'role' and string, list or null 'content'")
    texts = []
    for p in content:
        # NOTE: vLLM's request model refuses a part that is neither (its 400); p.get raised AttributeError, the
        # stand-in's 500, which the proxy's /tokenize relayed as a 502 (found by scripts/fuzz_proxy.py)
        if not isinstance(p, str | dict):
            raise InvalidArgument(f"a content part must be a string or an object, got {type(p).__name__}")
        t = p.get("type") if isinstance(p, dict) else "text"
        if not isinstance(t, str) or t not in TEXT_PARTS:
            raise InvalidArgument(f"this model is text-only: a content part of type {t!r} is not supported")
        text = p if isinstance(p, str) else p.get(TEXT_PARTS[t])
        if not isinstance(text, str):
            raise InvalidArgument(f"a {t!r} content part needs a string {TEXT_PARTS[t]!r}")
        texts.append(text)
    return "\n".join(texts)


def apply_chat_template(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                        continue_final_message: bool = False, documents: Any = None) -> list[int]:
    """ChatML-shaped: <|im_start|>role\\ncontent<|im_end|>\\n ... then <|im_start|>assistant\\n.

    `documents` (a list of objects, for retrieval-augmented templates) come first, as a "documents" turn of each
    document's values; `continue_final_message` leaves the last message open (no <|im_end|>, no generation prompt).
    """
    out: list[int] = []
    if documents:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise InvalidArgument("documents must be a list of objects")
        text = "\n".join(str(v) for d in documents for v in d.values())
        out += [IM_START, *tokenize("documents"), NEWLINE, *tokenize(text), IM_END, NEWLINE]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument("each message needs string 'role' and string, list or null 'content'")
        out += [IM_START, *tokenize(m["role"]), NEWLINE, *tokenize(content_text(m.get("content")))]
        if not (continue_final_message and i == len(messages) - 1):
            out += [IM_END, NEWLINE]
    if add_generation_prompt and not continue_final_message:
        out += [IM_START, *tokenize("assistant"), NEWLINE]
    return out


def synthetic_output(prompt: Sequence[int], n: int) -> list[int]:
    """Deterministic 'generated' ids: a function of the prompt only."""
    seed = zlib.crc32(bytes(str(list(prompt[-64:])), "ascii"))
    return [100 + (seed * 2654435761 + i * 40503) % VOCAB for i in range(n)]


def detokenize(ids: Sequence[int]) -> str:
    return "".join(f" t{i}" for i in ids)
