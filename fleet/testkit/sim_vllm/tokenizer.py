"""A tiny deterministic tokenizer and chat template for the stand-in (not a real vocabulary).

Words and punctuation map to ids by crc32; the chat template mirrors ChatML's shape with fixed
special ids, so that the proxy and the stand-in tokenize identically.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import Any

from fleet.errors import InvalidArgument

IM_START, IM_END, NEWLINE = 151644, 151645, 198
VOCAB = 150000
_WORD = re.compile(r"\w+|[^\w\s]")


def tokenize(text: Any) -> list[int]:
    """Deterministic ids for `text` (words and punctuation)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}")
    return [100 + zlib.crc32(w.encode()) % VOCAB for w in _WORD.findall(text)]


def apply_chat_template(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """ChatML-shaped: <|im_start|>role\\ncontent<|im_end|>\\n ... then <|im_start|>assistant\\n."""
    out: list[int] = []
    for m in messages:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise InvalidArgument("each message needs string 'role' and 'content'")
        out += [IM_START, *tokenize(m["role"]), NEWLINE, *tokenize(m["content"]), IM_END, NEWLINE]
    if add_generation_prompt:
        out += [IM_START, *tokenize("assistant"), NEWLINE]
    return out


def synthetic_output(prompt: Sequence[int], n: int) -> list[int]:
    """Deterministic 'generated' ids: a function of the prompt only."""
    seed = zlib.crc32(bytes(str(list(prompt[-64:])), "ascii"))
    return [100 + (seed * 2654435761 + i * 40503) % VOCAB for i in range(n)]


def detokenize(ids: Sequence[int]) -> str:
    return "".join(f" t{i}" for i in ids)
