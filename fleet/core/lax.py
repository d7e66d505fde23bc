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
