"""JSON values read as vLLM's OpenAI request models read them (pydantic's lax mode), for the proxy and the stand-in."""

from __future__ import annotations

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
