"""A PutBlob holds its blob once while the store writes it, so the upload gate's reservation (the announced size)
is what an unfinished put holds.

Real controller, real gRPC on loopback, SQLite and a real redis-server; tracemalloc counts the Python allocations
of the whole process (the server's handler and its store thread; the client's blob is allocated before it starts).
NOTE: before, the servicer handed its one buffer to `put_stream` as a one-chunk stream, and put_stream gathered it
into a second buffer: a 16 MiB put peaked at two copies (about 33 MiB traced) while the gate reserved 16 MiB.
"""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from pathlib import Path

from support.controller import make_tokens, start_controller

from fleet.sdk import NO_RETRY, AsyncFleetClient

SIZE = 16 << 20



async def test_a_put_holds_its_blob_once_while_it_is_stored(url: str, tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(url, tok)
    data = os.urandom(SIZE)
    ref = hashlib.sha256(data).hexdigest()
    try:
        async with AsyncFleetClient(ctl.address, token=tok.a, retry=NO_RETRY) as c:
            tracemalloc.start()
            try:
                got = await c.put_blob(data)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert got.ref == ref and await c.get_blob(got) == data  # control: the whole blob, under its hash
    finally:
        await ctl.stop(0)
    print(f"a {SIZE >> 20} MiB put peaked at {peak / SIZE:.2f}x its size")
    assert peak < 1.5 * SIZE, peak  # before: 2.0x (the servicer's buffer and put_stream's copy of it)
