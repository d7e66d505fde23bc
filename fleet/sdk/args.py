"""The SDK's argument checks: a bad argument to a FleetClient call is InvalidArgument naming it, before any RPC.

The request builders (fleet/sdk/table.py, fleet/sdk/sessions.py, fleet/sdk/base.py) run them on each integer,
string, token-id list, tag list and blob they take; the controller checks the meaning (a num_tokens past its limit, a
piece that does not exist). NOTE: before, protobuf's own checks answered, as a ValueError ("Value out of range:
-1": generate(s, -1), working_set(s, budget_tokens=-5)) or a TypeError (route("hello"), put_blob("text")), and
route([]) was sent and answered COLD (found by review).
"""

from __future__ import annotations

import array
import math
import operator
from collections.abc import Iterable

from fleet.core.errors import InvalidArgument

UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
INT32_MAX = (1 << 31) - 1
assert array.array("I").itemsize == 4, "token ids are checked as 4-byte C unsigned ints"


def count(name: str, value: object, low: int = 0, high: int = UINT32_MAX) -> int:
    """`value` as an int in [low, high] (a numpy integer is one; a bool or a float is not).

    Raises:
        InvalidArgument: naming `name`, the bounds and what was given.
    """
    try:
        if isinstance(value, bool):
            raise TypeError
        n = operator.index(value)  # type: ignore[arg-type]  # a TypeError when it is not an integer
    except TypeError:
        raise InvalidArgument(f"{name} must be an integer, got {type(value).__name__} {value!r:.40}") from None
    if n < low:
        raise InvalidArgument(f"{name} must be >= {low}, got {n}")
    if n > high:
        raise InvalidArgument(f"{name} must be <= {high}, got {n}")
    return n


def token_ids(value: object, name: str = "token_ids") -> array.array[int]:
    """`value` as token ids: a non-empty sequence of ints in [0, 2**32), checked in C (array.array), not a Python
    pass over a long prompt.

    Raises:
        InvalidArgument: text instead of ids, an empty list, or an id out of range or not an integer (a bool is
            not one: fleet.core.session_types.check_token_ids, the rule the kernel and the controller apply).
    """
    if isinstance(value, str | bytes | bytearray | memoryview):  # NOTE: array("I", b"...") reads raw bytes as ids
        raise InvalidArgument(f"{name} must be a list of token ids, not {type(value).__name__}; tokenize the text "
                              "first")
    try:
        items = value if isinstance(value, list | tuple | array.array) else list(value)  # type: ignore[call-overload]
        ids: array.array[int] = array.array("I", items)  # "I": 4 bytes on CPython
    except (TypeError, OverflowError, ValueError):
        raise InvalidArgument(f"{name} must be a list of token ids: integers in [0, 2**32)") from None
    if bool in map(type, items):  # NOTE: array("I", [True]) is [1]: append(s, [True, False]) appended ids 1 and 0
        raise InvalidArgument(f"{name} must be integers, not bool (True would be sent as token id 1)")
    if not ids:
        raise InvalidArgument(f"{name} is empty: give at least one token id")
    return ids


def strings(name: str, value: Iterable[str] | None) -> list[str]:
    """`value` as a list of str (None: empty). A lone str is refused: it would be split into characters."""
    if value is None:
        return []
    try:
        items = None if isinstance(value, str) else list(value)
    except TypeError:
        items = None
    if items is None or not all(isinstance(v, str) for v in items):
        raise InvalidArgument(f"{name} must be a list of strings, got {type(value).__name__} {value!r:.40}")
    return [text(name, v) for v in items]


def blob(data: object) -> bytes:
    """`data` as bytes (bytes, bytearray or memoryview); a str must be encoded first."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"put_blob takes bytes, got {type(data).__name__}"
                              + ("; encode it first (data.encode())" if isinstance(data, str) else ""))
    return bytes(data)


def text(name: str, value: object) -> str:
    """`value` as a str a request can carry: a str (not bytes, not a number) that UTF-8 can encode.

    Raises:
        InvalidArgument: naming `name`: not a str, or a lone surrogate in it (from bytes decoded with
            errors="surrogateescape", or a str cut inside a surrogate pair). NOTE: before, protobuf's own TypeError
            ("bad argument type for built-in operation", naming no argument) or UnicodeEncodeError left the SDK.
    """
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a str, got {type(value).__name__} {value!r:.40}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgument(f"{name} is not valid Unicode: {value[e.start]!r} at character {e.start} is a lone "
                                  "surrogate, which UTF-8 cannot encode; decode the bytes it came from with "
                                  "errors='replace'") from None
    return value


def ref(value: object, name: str = "ref") -> str:
    """A blob ref (a BlobRef, or its sha256 hex) as the str a request carries."""
    return text(name, str(value))


def seconds(name: str, value: object) -> float:
    """`value` as a client deadline: a finite number of seconds above 0 (an int or a float, not a bool or a str).

    Raises:
        InvalidArgument: naming `name`. NOTE: before, FleetClient(timeout=-1, 0, nan or inf) failed every call with
            "deadline exceeded ... the controller is slow or unreachable" while the controller was fine, and
            timeout="10" raised TypeError from inside the retry loop (found by review).
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number of seconds, got {type(value).__name__} {value!r:.40}")
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} must be a finite number of seconds above 0, got {value!r}")
    return float(value)
