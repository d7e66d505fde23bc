"""Reads of a blob's bytes on Redis: in pipelined GETRANGE chunks, a window of them a round trip."""

from __future__ import annotations

from typing import Any

_GET_CHUNK = 512 << 10
# NOTE: chunks a whole-blob read asks for in one round trip. Redis runs every command of a pipeline that has
# arrived before it serves another client, so one pipeline of all of a 64 MiB blob's chunks copied 64 MiB into
# its reply before anyone else was served.
_GET_WINDOW = 4


def get_many(r: Any, keys: list[str]) -> list[bytes | None]:
    """The blobs at `keys` (data keys), None where one is missing, on a redis-py client (`r`)."""
    # one round trip of GETRANGE 0..CHUNK-1 each; only blobs that fill the chunk need more
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.getrange(key, 0, _GET_CHUNK - 1)
    firsts = pipe.execute()
    return [_rest(r, key, first) for key, first in zip(keys, firsts, strict=True)]


def get(r: Any, key: str) -> bytes | None:
    """The blob at `key` (its data key), None if missing."""
    return _rest(r, key, r.getrange(key, 0, _GET_CHUNK - 1))


def _rest(r: Any, key: str, first: bytes) -> bytes | None:
    """Complete a read that fetched the first chunk (an empty one means empty or missing).

    NOTE: a plain GET of a large value peaks at ~3 copies inside redis-py's reader; reading it
    in pipelined GETRANGE chunks and joining them peaks at ~2 (the chunks + the result).
    """
    if not first:
        return b"" if r.exists(key) else None
    if len(first) < _GET_CHUNK:
        return first
    size, chunks = int(r.strlen(key)), [first]
    starts = list(range(_GET_CHUNK, size, _GET_CHUNK))
    for i in range(0, len(starts), _GET_WINDOW):  # NOTE: a window a round trip (module NOTE at _GET_WINDOW)
        pipe = r.pipeline(transaction=False)
        for start in starts[i:i + _GET_WINDOW]:
            pipe.getrange(key, start, min(start + _GET_CHUNK, size) - 1)
        chunks += pipe.execute()
    if sum(map(len, chunks)) != size:  # collected by gc while we read: as if missing
        return None
    return b"".join(chunks) if len(chunks) > 1 else first
