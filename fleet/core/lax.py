"""JSON values read as vLLM's OpenAI request models read them (pydantic's lax mode), for the proxy and the stand-in."""

from __future__ import annotations

import json
import math
import re
from typing import Any

LAX_BOOLS = {"0": False, "off": False, "f": False, "false": False, "n": False, "no": False,
             "1": True, "on": True, "t": True, "true": True, "y": True, "yes": True}


def lax_bool(value: Any) -> bool | None:
    """A JSON value as a bool field of vLLM's request models reads it: a bool; 0 or 1 (a number); one of LAX_BOOLS'
    strings in any case. None for anything else (and for null). NOTE: the proxy read only null and 0/1 so, and
    "true", "yes" or 1.0 were its 400 where vLLM serves them; the stand-in read "false" as true (review finding)."""
    if isinstance(value, bool):
        return value
    if type(value) in (int, float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return LAX_BOOLS.get(value.lower())
    return None


def stream_of(body: dict[str, Any]) -> bool:
    """The request's `stream` (absent or null: false).

    Raises:
        ValueError: a value vLLM refuses (its message names what it takes).
    """
    raw = body.get("stream")
    stream = lax_bool(raw)
    if stream is None and raw is not None:
        raise ValueError("'stream' must be true or false (or what vLLM reads as one: 0 or 1, \"true\" or \"false\", "
                         "\"yes\" or \"no\", \"on\" or \"off\")")
    return bool(stream)


def reads_prefix_cache(body: dict[str, Any], chat: bool) -> bool:
    """Whether vLLM reads its prefix cache for this completion (`chat`: chat completion) request.

    vLLM prefills the whole prompt of a request that asks for its prompt's logprobs (SamplingParams sets
    `skip_reading_prefix_cache` when `prompt_logprobs` is not None: a cached block has no logits), though it still
    caches the blocks it computes. A request's prompt logprobs are its `prompt_logprobs`, else, with `echo`, a
    completion's `logprobs` or a chat's `top_logprobs` (0 when left out, so a chat's `echo` alone asks for them).
    NOTE: the proxy claimed such a request WARM on the worker holding its prefix, for all of it, and the stand-in
    reused its cache for it; vLLM reports 0 cached tokens."""
    if body.get("prompt_logprobs") is not None:
        return False
    if lax_bool(body.get("echo")) is not True:
        return True
    return (body.get("top_logprobs", 0) if chat else body.get("logprobs")) is None


# NOTE: pydantic-core strips what Rust's str::trim strips (Unicode White_Space), not Python's str.strip: that also
# strips \x1c-\x1f, which pydantic refuses
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
               "\u2028\u2029\u202f\u205f\u3000"
_INT_TEXT = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
_FLOAT_INT_LIMIT = 2.0 ** 63  # pydantic reads a float as an int only below this ("exceeded maximum size")


def lax_int(value: Any) -> int | None:
    """A JSON value as an int field of vLLM's request models reads it (pydantic's lax mode): an int; a bool (0 or 1);
    a finite float with no fractional part, under 2**63 in size; a string of decimal digits (a sign, single
    underscores between digits, trailing ".0" zeros and surrounding white space allowed). None for anything else."""
    if isinstance(value, int):  # a bool too: True is 1
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer() and abs(value) < _FLOAT_INT_LIMIT:
            return int(value)
        return None
    if isinstance(value, str):
        text = value.strip(_WHITE_SPACE)
        if _INT_TEXT.fullmatch(text) is None:
            return None
        return int(text.partition(".")[0])
    return None


def lax_token_ids(prompt: list[Any]) -> list[int]:
    """A list of token ids as vLLM's completions request reads a `prompt` that is one (`list[int]`, each at least 0,
    in pydantic's lax mode: 1000.0, "1000" and true are ids 1000, 1000 and 1).

    Raises:
        ValueError: an element vLLM refuses (the message names its place and value).
    """
    out = []
    for i, v in enumerate(prompt):
        t = lax_int(v)
        if t is None or t < 0:
            what = "a token id (a whole number of at least 0)" if t is None else "at least 0"
            raise ValueError(f"[{i}] is {_shown(v)}, which is not {what}")
        out.append(t)
    return out


def _shown(value: Any) -> str:
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "an object"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
