"""The checks a session runs on its callers' arguments before it changes anything: token ids to append, an
eviction span, a position range, a decode count (fleet/core/kernel/session.py). Each raises what the session's
method documents and returns the argument as plain Python ints (numpy's own ints converted at the door)."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import numpy as np

from fleet.core.errors import InvalidArgument, ResourceExhausted

if TYPE_CHECKING:
    from fleet.core.kernel.config import ModelConfig

EVICT_MODES = ("exact", "reposition")


def as_int(x: Any) -> int | None:
    """`x` as a Python int (any integer type, numpy's included), or None for anything else,
    bools included.

    NOTE: converted at the door, before any arithmetic. A numpy int kept its width: np.int16(100) +
    np.int16(32700) wrapped to a negative end that passed the span check (found by review)."""
    if isinstance(x, bool | np.bool_):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def check_ids(ids: Any, cfg: ModelConfig, num_tokens: int) -> np.ndarray:
    """`ids` as int64 token ids a session of `num_tokens` tokens may append (what `Session.append` raises)."""
    if isinstance(ids, str | bytes | bytearray):
        raise InvalidArgument("append takes token ids, not text: encode it first (ByteTokenizer.encode)")
    if not isinstance(ids, np.ndarray) and not hasattr(ids, "__iter__"):
        # NOTE: the bool scan below iterated it first: append(7) and append(None) raised a bare TypeError
        raise InvalidArgument(f"append needs a non-empty 1-D sequence of token ids, got {type(ids).__name__} {ids!r}")
    if not isinstance(ids, np.ndarray) and any(isinstance(i, bool | np.bool_) for i in ids):
        raise InvalidArgument("token ids must be integers, not bool")  # np.asarray([1, True]) is int64
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0:
        raise InvalidArgument(
            f"append needs a non-empty 1-D sequence of token ids, got shape {arr.shape}"
        )
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    V = cfg.vocab_size
    bad = np.flatnonzero((arr < 0) | (arr >= V))
    if bad.size:
        raise InvalidArgument(
            f"token id {int(arr[bad[0]])} at index {int(bad[0])} is outside the vocabulary [0, {V})"
        )
    limit = cfg.max_context
    if num_tokens + arr.size > limit:
        raise ResourceExhausted(
            f"{num_tokens} + {arr.size} tokens exceed the context of {limit} "
            f"(max_seq_len / sliding_window): evict or start a new session"
        )
    return arr.astype(np.int64)


def check_span(start: Any, length: Any, mode: Any, num_tokens: int) -> tuple[int, int]:
    """(start, length) of an eviction of a session of `num_tokens` tokens (what `Session.evict` raises)."""
    # NOTE: a str first: np.array(["exact"]) passed `in` (and went into the report as an array), and a 2-element
    # array raised numpy's ValueError
    if not isinstance(mode, str) or mode not in EVICT_MODES:
        raise InvalidArgument(f"evict mode must be one of {EVICT_MODES}, got {mode!r}")
    s, n = as_int(start), as_int(length)
    if s is None or n is None:
        raise InvalidArgument(f"evict start/length must be integers, got {start!r}, {length!r}")
    if s < 0 or n < 1 or s + n > num_tokens:
        raise InvalidArgument(
            f"evict span [{s}, {s + n}) is not a non-empty range inside [0, {num_tokens})"
        )
    return s, n


def check_range(lo: Any, hi: Any, num_tokens: int) -> tuple[int, int]:
    """(lo, hi) with 0 <= lo <= hi <= num_tokens; None for `hi`: num_tokens."""
    a, b = as_int(lo), as_int(num_tokens if hi is None else hi)
    if a is None or b is None or not 0 <= a <= b <= num_tokens:
        raise InvalidArgument(f"needs 0 <= lo <= hi <= {num_tokens}, got {lo!r}, {hi!r}")
    return a, b


def check_count(n: Any, num_tokens: int, max_context: int) -> int:
    """`n` tokens to decode after `num_tokens` (what `Session.generate` raises, before it appends any)."""
    count = as_int(n)
    if count is None or count < 0:
        raise InvalidArgument(f"generate needs a non-negative integer count, got {n!r}")
    if count and not num_tokens:
        raise InvalidArgument("generate needs at least one token in the session")
    if num_tokens + count > max_context:
        raise ResourceExhausted(
            f"{num_tokens} + {count} generated tokens exceed the context of {max_context} "
            f"(max_seq_len / sliding_window): evict or start a new session"
        )
    return count
