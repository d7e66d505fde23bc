"""Seeded fuzz audit of the controller's KV-event ingestion: `python scripts/fuzz_kv_events.py --seed N --frames K`.

It plays a vLLM worker against a real controller. The controller runs in a process of its own (`python -m
controller.main`, loopback, a fresh SQLite store, its log kept in a file); the fuzzer registers one worker with it
over gRPC, serves the worker's HTTP surface with the `kvfleet sim-vllm` stand-in's app, and publishes the worker's KV
events itself on a real ZMQ PUB socket (vLLM's frames: topic, 8-byte seq, msgpack batch) while it answers the
replay requests on a real ROUTER socket (vLLM's replay protocol), keeping the last batches it sent as vLLM does.

Each round takes one fault and sends it, then sends valid events again and checks the controller. Faults:
valid batches with one field mutated (wrong types and lengths, negative and huge ints, block hashes as short or odd
bytes, negative ints, None or nested lists, parent hashes never stored, junk medium/LoRA/group/kind fields, unknown
event tags, extra fields, NaN and infinite timestamps, another DP rank), truncated and random msgpack, messages of
1, 2, 4 and 5 frames and short or long seq frames, seqs going backwards, repeating and jumping (by up to 2**63),
replay answers that are malformed (wrong frame counts, junk seqs, seqs below the start asked, holes, junk
payloads, out of order), late, never sent or flooding, floods of live messages (valid stores and removals, clears,
seq resets, junk), and controller restarts whose catch-up replay answers in any of those ways.

What it flags (exit status 1, each with the round and its seed):
- a traceback in the controller's log (a failure must be a counted decode error and a warning, not an exception);
- a controller that stops answering Route or ListWorkers (each asked with a deadline after every round);
- a rank that does not recover: once valid events resume, a prompt the worker then stores must route WARM;
- a wrong WARM: each round's fault names the blocks of a prompt the worker does not hold; where the fault is one
  vLLM could never send, that prompt must route COLD afterwards;
- memory: each controller process's RSS growth, from after the warm-up (or its restart) to its end (flagged past
  --max-rss-growth-mb).

Nothing here is a test of the suite (it runs for minutes); its findings became regression tests in
tests/controller/vllm/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgspec
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleet.api.kvfleet.v1 import route_pb2, workers_pb2  # noqa: E402
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub  # noqa: E402
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub  # noqa: E402
from fleet.app.testkit.sim_vllm.config import SimEngineConfig  # noqa: E402
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm  # noqa: E402
from fleet.core.block_hash import HashConfig, external_chain  # noqa: E402

BS = 16  # the worker's block size (registered, and in every valid event)
END = b"\xff" * 8
BUFFER_STEPS = 64  # batches the worker keeps for replay (vLLM: 10,000)
RPC_S = 5.0  # a Route or ListWorkers slower than this is a controller that stopped answering
RECOVER_S = 12.0  # valid events resumed this long without a WARM route: a rank that never recovers
FAULTY_HOLD_S = 1.0  # the controller's --kv-faulty-hold: a flood's hold ends within a round
CFG = HashConfig("sha256", None, BS)
ENC = msgspec.msgpack.Encoder()


# ---------------------------------------------------------------- events, as vLLM 0.33 encodes them

def stored(hashes: list[Any], tokens: list[int], parent: Any = None, salt: str | None = None,
           **extra: Any) -> dict[str, Any]:
    """A BlockStored map, fields in vLLM's order (its required ones always present, defaults omitted)."""
    ev: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                          "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    if salt is not None and parent is None:
        ev["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    ev.update(extra)
    return ev


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(events: list[Any], ts: Any = None, dp: Any = 0) -> bytes:
    return ENC.encode([time.time() if ts is None else ts, events, dp])


@dataclass
class Prompt:
    tokens: list[int]
    hashes: list[int]

    def event(self, salt: str, **extra: Any) -> dict[str, Any]:
        return stored(list(self.hashes), list(self.tokens), None, salt, **extra)


def new_prompt(rng: random.Random, salt: str, blocks: int = 3) -> Prompt:
    toks = [rng.randrange(1, 50_000) for _ in range(blocks * BS)]
    return Prompt(toks, external_chain(CFG, toks, cache_salt=salt))


# ---------------------------------------------------------------- the worker

class Worker:
    """The fuzzer's worker: a PUB for live batches, a ROUTER answering replays as `replay_mode` says."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.pub_ep = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self.replay_ep = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        self.seq = 0  # the next seq of the honest stream
        self.buffer: dict[int, bytes] = {}  # seq -> payload, the last BUFFER_STEPS sent (vLLM's replay buffer)
        self.replay_mode = "honest"
        self.replays = 0
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def send(self, payload: bytes, seq: int | None = None, buffer: bool = True) -> int:
        """Publish `payload` at `seq` (default: the next one of the stream) and keep it for replay."""
        if seq is None:
            seq = self.seq
            self.seq += 1
        if buffer and 0 <= seq < 1 << 63:
            self.buffer[seq] = payload
            for s in [s for s in self.buffer if s < self.seq - BUFFER_STEPS]:
                del self.buffer[s]
        await self.pub.send_multipart([b"", (seq % (1 << 64)).to_bytes(8, "big"), payload])
        return seq

    async def _serve(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            self.replays += 1
            if len(frames) != 3:
                continue  # vLLM logs and drops such a request
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            mode = self.replay_mode
            with contextlib.suppress(Exception):
                await self._answer(ident, start, mode)

    async def _answer(self, ident: bytes, start: int, mode: str) -> None:
        send = self.router.send_multipart
        held = [(s, p) for s, p in sorted(self.buffer.items()) if s >= start]
        if mode == "never":
            return
        if mode == "late":
            await asyncio.sleep(1.6)  # past the controller's replay timeout (1 s of silence)
        if mode == "flood":  # batches without end (until the deadline cuts it)
            for i in range(30_000):
                await send([ident, b"", b"", (start + i).to_bytes(8, "big"), batch([removed([7])])])
                if i % 500 == 0:
                    await asyncio.sleep(0)
            return
        if mode == "bad_frames":
            await send([ident, b"", b"x"])
            return
        if mode == "bad_seq":
            await send([ident, b"", b"", b"\x01\x02", b""])
            return
        if mode == "below_start":  # older batches than asked (vLLM sends seq >= start only)
            held = [(s, p) for s, p in sorted(self.buffer.items())]
        if mode == "hole" and len(held) > 2:
            held = held[:1] + held[2:]
        if mode == "junk_payload":
            held = [(s, b"\xc1junk") for s, _ in held]
        if mode == "reversed":
            held = held[::-1]
        if mode == "legacy":  # vLLM before 0.26: no topic frame
            for s, p in held:
                await send([ident, b"", s.to_bytes(8, "big"), p])
            await send([ident, b"", END, b""])
            return
        for s, p in held:
            await send([ident, b"", b"", s.to_bytes(8, "big"), p])
        await send([ident, b"", b"", END, b""])

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(0)
        self.router.close(0)


# ---------------------------------------------------------------- faults

@dataclass
class Fault:
    name: str
    frames: list[list[bytes] | tuple[str, Any]]  # raw frame lists, or ("seq", payload) / ("at", (seq, payload))
    legal: bool = False  # vLLM could send it: its blocks may be indexed
    replay: str = "honest"
    poisons_groups: bool = False  # it opens a KV group a single-group model never has (fail closed until an epoch drop)
    restart: bool = False  # the controller restarts after the frames; its catch-up replay answers as `replay` says


JUNK = [None, True, -1, -(1 << 63), (1 << 64) - 1, 1.5, math.nan, "x", b"", b"\x00" * 3, [], [[]], {"a": 1},
        [[1, 2]], [None], "GPU", 1 << 40]


def nested(depth: int) -> msgspec.Raw:
    """[[...[1]...]], `depth` lists deep, as raw msgpack (deeper than Python's recursion would encode)."""
    return msgspec.Raw(b"\x91" * depth + b"\x01")


def short(v: Any) -> str:
    if isinstance(v, list) and v and isinstance(v[0], msgspec.Raw):
        return f"[Raw({len(v[0])} bytes)]"
    return f"Raw({len(v)} bytes)" if isinstance(v, msgspec.Raw) else f"{v!r:.40}"


def mutate_stored(rng: random.Random, p: Prompt, salt: str) -> tuple[str, dict[str, Any], bool, bool]:
    """(what, the event, legal, poisons_groups): `p`'s store with one field changed."""
    ev = p.event(salt)
    h, t = list(p.hashes), list(p.tokens)
    H, P, T = "block_hashes", "parent_block_hash", "token_ids"
    unplain = [[[1]], [nested(50)], [[salt, salt]]]  # block 0's keys, not one salt: not recomputable here
    choices: list[tuple[str, str, Any, bool, bool]] = [
        ("hashes_short_bytes", H, [b"\x01" * rng.randrange(0, 8)] + h[1:], False, False),
        ("hashes_odd_bytes", H, [bytes(rng.randrange(1, 7)) + x.to_bytes(8, "big") for x in h], True, False),
        ("hashes_32_bytes", H, [bytes(24) + x.to_bytes(8, "big") for x in h], True, False),
        ("hashes_negative", H, [-(x >> 1) - 1 for x in h], False, False),
        ("hashes_none", H, [None] * len(h), False, False),
        ("hashes_nested", H, [[x] for x in h], False, False),
        ("hashes_deep", H, [nested(rng.choice([10, 200, 5000]))], False, False),
        ("hashes_float", H, [float(x) for x in h], False, False),
        ("hashes_str", H, [str(x) for x in h], False, False),
        ("hashes_not_list", H, h[0], False, False),
        ("hashes_fewer", H, h[:-1], True, False),
        ("hashes_more", H, h + [rng.getrandbits(64)], False, False),
        ("hashes_dup", H, [h[0], h[0], h[1]], True, False),
        ("parent_never_stored", P, rng.getrandbits(64), True, False),
        ("parent_junk", P, rng.choice(JUNK), True, False),
        ("tokens_short", T, t[:-1], False, False),
        ("tokens_long", T, t + [1], False, False),
        ("tokens_negative", T, [-x for x in t], False, False),
        ("tokens_huge", T, [x + (1 << 40) for x in t], False, False),
        ("tokens_junk", T, rng.choice([j for j in JUNK if j != []]), False, False),
        ("tokens_other", T, [x + 1 for x in t], False, False),
        ("tokens_empty", T, [], True, False),
        ("block_size_junk", "block_size", rng.choice(JUNK + [0, 8, 15, 17, 32, 1 << 63]), False, False),
        ("lora_id_junk", "lora_id", rng.choice(JUNK), True, False),
        ("medium_junk", "medium", rng.choice(JUNK + ["gpu", "GPU ", "cpu", "CPU", "", "G\x00PU", "cuda:0"]), False,
         False),
        ("lora_name_junk", "lora_name", rng.choice(JUNK + ["lora-x", ""]), True, False),
        ("extra_keys_junk", "extra_keys", rng.choice(JUNK + [[["other-salt"]], *unplain]),
         False, False),
        ("group_idx_junk", "group_idx", rng.choice(JUNK + [1, 7, -1]), False, True),
        ("kind_junk", "kv_cache_spec_kind", rng.choice(JUNK + ["sliding_window", "mamba", "full_attention"]), True,
         False),
        ("window_junk", "kv_cache_spec_sliding_window", rng.choice(JUNK + [0, 1, 1 << 62]), True, False),
        ("locality", "locality", rng.choice(["local", "remote", 5]), True, False),
        ("ownership", "ownership", rng.choice(["owned", None]), True, False),
        ("session_id", "session_id", "s1", True, False),
        ("lookahead", "lookahead_token_ids", [[1, 2]], True, False),
        ("unknown_field", "zzz", nested(3), True, False),
        ("missing_field", "", None, False, False),
        ("type_junk", "type", rng.choice(JUNK + ["BlockStoredX", "blockstored", ""]), False, False),
    ]
    what, key, value, legal, poisons = rng.choice(choices)
    if what == "missing_field":
        key = rng.choice([H, P, T, "block_size", "lora_id", "medium", "lora_name"])
        del ev[key]
        what += ":" + key
        legal = key in ("lora_id", "medium", "lora_name")  # a decoder may default the ones that may be None
    else:
        ev[key] = value
        what += "=" + short(value)
    if key == "medium" and value in (None, "GPU", "gpu"):
        legal = True  # upper-cased, "gpu" is the GPU pool's tier too
    if key == "extra_keys" and any(value is v for v in unplain):
        legal = True  # block 0's keys say it is no plain salted block (multimodal): no evidence, trusted
    if key in ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window") and value is None:
        legal, poisons = True, False
    return what, ev, legal, poisons


KINDS = ("field", "batch", "wire", "seq", "replay", "flood", "removed", "frames", "restart")


def make_fault(rng: random.Random, p: Prompt, salt: str, w: Worker, only: str = "") -> Fault:
    kind = only or rng.choice(["field"] * 6 + list(KINDS[1:]))
    if kind == "field":
        what, ev, legal, poisons = mutate_stored(rng, p, salt)
        return Fault("field:" + what, [("seq", ENC.encode([time.time(), [ev], 0]))], legal, poisons_groups=poisons)
    if kind == "removed":
        what, val = rng.choice([("hashes", rng.choice(JUNK)), ("medium", rng.choice(JUNK)),
                                ("group", rng.choice(JUNK)), ("extra", {"zzz": 1})])
        ev = removed([rng.getrandbits(64)])
        if what == "hashes":
            ev["block_hashes"] = val
        elif what == "medium":
            ev["medium"] = val
        elif what == "group":
            ev["group_idx"] = val
        else:
            ev.update(val)
        return Fault(f"removed:{what}", [("seq", ENC.encode([time.time(), [ev], 0]))], False)
    ev = p.event(salt)
    if kind == "batch":
        what = rng.choice(["ts_nan", "ts_inf", "ts_neg_inf", "ts_str", "ts_none", "ts_huge_int", "dp_other",
                           "dp_junk", "events_not_list", "events_dict", "batch_4_items", "batch_1_item",
                           "batch_map", "events_empty", "unknown_tag", "unknown_tag_deep", "legacy_array",
                           "legacy_array_junk",
                           "clear_then_store", "store_then_clear", "event_not_map"])
        ts: Any = time.time()
        if what == "ts_nan":
            return Fault("batch:ts_nan", [("seq", ENC.encode([math.nan, [ev], 0]))], False)
        if what == "ts_inf":
            return Fault("batch:ts_inf", [("seq", ENC.encode([math.inf, [ev], 0]))], False)
        if what == "ts_neg_inf":
            return Fault("batch:ts_neg_inf", [("seq", ENC.encode([-math.inf, [ev], 0]))], False)
        if what == "ts_str":
            return Fault("batch:ts_str", [("seq", ENC.encode(["now", [ev], 0]))], False)
        if what == "ts_none":
            return Fault("batch:ts_none", [("seq", ENC.encode([None, [ev], 0]))], False)
        if what == "ts_huge_int":
            return Fault("batch:ts_huge_int", [("seq", ENC.encode([(1 << 64) - 1, [ev], 0]))], True)
        if what == "dp_other":
            return Fault("batch:dp_other", [("seq", ENC.encode([ts, [ev], rng.choice([1, 3, -1, (1 << 63) - 1])]))])
        if what == "dp_junk":
            dp = rng.choice(JUNK)
            return Fault("batch:dp_junk", [("seq", ENC.encode([ts, [ev], dp]))], dp is None)
        if what == "events_not_list":
            return Fault("batch:events_not_list", [("seq", ENC.encode([ts, ev, 0]))])
        if what == "events_dict":
            return Fault("batch:events_dict", [("seq", ENC.encode([ts, {"a": ev}, 0]))])
        if what == "batch_4_items":
            return Fault("batch:4_items", [("seq", ENC.encode([ts, [ev], 0, "extra"]))], True)
        if what == "batch_1_item":
            return Fault("batch:1_item", [("seq", ENC.encode([ts]))])
        if what == "batch_map":  # one upstream revision's map batch: read too
            return Fault("batch:map", [("seq", ENC.encode({"ts": ts, "events": [ev], "data_parallel_rank": 0}))],
                         True)
        if what == "events_empty":
            return Fault("batch:events_empty", [("seq", ENC.encode([ts, [], 0]))], True)
        if what == "unknown_tag":
            return Fault("batch:unknown_tag", [("seq", ENC.encode([ts, [{"type": "BlockPinned", "x": 1}, ev], 0]))])
        if what == "unknown_tag_deep":  # nested near the decoder's recursion limit (what is left of it varies)
            x = nested(rng.randrange(850, 1000))
            return Fault("batch:unknown_tag_deep", [("seq", ENC.encode([ts, [{"type": "BlockPinned", "x": x}, ev], 0]))])
        if what == "legacy_array":  # vLLM <= 0.23: events as arrays
            arr = ["BlockStored", list(p.hashes), None, list(p.tokens), BS, None, "GPU", None,
                   [[salt]] + [None] * (len(p.hashes) - 1)]
            return Fault("batch:legacy_array", [("seq", ENC.encode([ts, [arr], 0]))], True)
        if what == "legacy_array_junk":
            arr = ["BlockStored", list(p.hashes), rng.choice(JUNK), list(p.tokens)]
            return Fault("batch:legacy_array_junk", [("seq", ENC.encode([ts, [arr, ["BlockStored"]], 0]))])
        if what == "clear_then_store":
            return Fault("batch:clear_then_store", [("seq", ENC.encode([ts, [{"type": "AllBlocksCleared"}, ev], 0]))],
                         True)
        if what == "store_then_clear":  # legal, and it leaves the prompt not held
            return Fault("batch:store_then_clear",
                         [("seq", ENC.encode([ts, [ev, {"type": "AllBlocksCleared"}], 0]))], False)
        return Fault("batch:event_not_map", [("seq", ENC.encode([ts, [5, ev], 0]))])
    good = batch([ev])
    if kind == "wire":
        what = rng.choice(["truncated", "random_bytes", "random_msgpack", "empty", "bitflip"])
        if what == "truncated":
            return Fault("wire:truncated", [("seq", good[: rng.randrange(0, len(good))])])
        if what == "random_bytes":
            return Fault("wire:random_bytes", [("seq", rng.randbytes(rng.randrange(0, 400)))])
        if what == "random_msgpack":
            obj = [rng.choice(JUNK), [rng.choice(JUNK) for _ in range(rng.randrange(0, 4))], rng.choice(JUNK)]
            return Fault("wire:random_msgpack", [("seq", ENC.encode(obj))])
        if what == "empty":
            return Fault("wire:empty_payload", [("seq", b"")])
        b = bytearray(good)
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
        # a flipped bit in a hash or token is a store vLLM never sent: its prompt must not route WARM
        return Fault("wire:bitflip", [("seq", bytes(b))], True)
    if kind == "frames":
        n = rng.choice([1, 2, 4, 5])
        seqf = w.seq.to_bytes(8, "big")
        frames = {1: [good], 2: [seqf, good], 4: [b"", seqf, good, b"x"], 5: [b"", seqf, good, b"", b""]}[n]
        what = rng.choice(["count", "seq_short", "seq_long"])
        if what == "seq_short":
            return Fault("frames:seq_short", [[b"", seqf[: rng.randrange(0, 8)], good]])
        if what == "seq_long":  # the unreleased 24-byte seq (a publisher id after it): the first 8 bytes count
            return Fault("frames:seq_long", [("seq24", good)], True)
        # vLLM sends 3 frames; 4 or more is no message of vLLM's
        return Fault(f"frames:{n}", [frames], n > 3)  # lenient: read as its first 3
    if kind == "seq":
        what = rng.choice(["backwards", "repeat", "jump_2", "jump_2_40", "jump_2_62", "jump_2_63", "to_max",
                           "end_marker", "reset_0"])
        if what == "backwards":
            return Fault("seq:backwards", [("at", (max(0, w.seq - rng.randrange(2, 10)), good))], True)
        if what == "repeat":
            return Fault("seq:repeat", [("at", (max(0, w.seq - 1), good))], True)
        if what == "jump_2":  # a lost batch: repaired by replay
            return Fault("seq:jump_2", [("at", (w.seq + 1, good))], False)
        jumps = {"jump_2_40": 1 << 40, "jump_2_62": 1 << 62, "jump_2_63": 1 << 63}
        if what in jumps:
            return Fault(f"seq:{what}", [("at", (w.seq + jumps[what], good))], False)
        if what == "to_max":
            return Fault("seq:to_max", [("at", ((1 << 63) - 2, good))], False)
        if what == "end_marker":
            return Fault("seq:end_marker", [("at", ((1 << 64) - 1, good))], False)
        return Fault("seq:reset_0", [("at", (0, good))], True)
    if kind == "restart":
        # the prompt is stored then evicted, then the controller restarts: whatever its catch-up replay answers, the
        # prompt must not route WARM
        mode = rng.choice(["honest", "never", "late", "below_start", "hole", "junk_payload", "reversed", "legacy",
                           "bad_seq", "flood"])
        return Fault(f"restart:{mode}", [("seq", good), ("seq", batch([removed(list(p.hashes))]))], False,
                     replay=mode, restart=True)
    if kind == "replay":
        mode = rng.choice(["never", "late", "flood", "bad_frames", "bad_seq", "below_start", "hole", "junk_payload",
                           "reversed", "legacy"])
        # a gap the replay must fill: two batches are lost, the first stores the prompt and the second evicts its
        # blocks, so whatever the replay answers, the prompt must not route WARM
        return Fault(f"replay:{mode}", [("lost", good), ("lost", batch([removed(list(p.hashes))])),
                                         ("seq", batch([removed([rng.getrandbits(64)])]))], False, replay=mode)
    what = rng.choice(["valid", "stores", "clears", "resets", "junk", "big"])  # flood
    n = rng.choice([200, 2000]) if what != "big" else 60
    # under the controller's --kv-event-max-message-bytes (8 MiB), with no batch header
    big = rng.randbytes(7 << 20) if what == "big" else b""
    frames: list[Any] = []
    for i in range(n):
        if what == "valid":
            frames.append(("seq", batch([removed([rng.getrandbits(64)])])))
        elif what == "stores":  # 64 new blocks each, past what the pool holds (the index's bound)
            frames.append(("seq", batch([stored([rng.getrandbits(64) for _ in range(64)], [],
                                                rng.getrandbits(64))])))
        elif what == "clears":
            frames.append(("seq", batch([{"type": "AllBlocksCleared"}] * 50)))
        elif what == "big":
            frames.append(("seq", big))
        elif what == "resets":
            frames.append(("at", (i % 3, batch([removed([7])]))))
        else:
            frames.append(("seq", rng.randbytes(64)))
    frames.append(("seq", good))  # the flood ends with the prompt's store: legal, indexed once the flood passes
    return Fault(f"flood:{what}x{n}", frames, True)


# ---------------------------------------------------------------- the controller

@dataclass
class Controller:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0


async def start_controller(tmp: Path) -> Controller:
    """A controller on a free port, on the store in `tmp` (a restart resumes its workers from it)."""
    log = tmp / "controller.log"
    at = log.stat().st_size if log.exists() else 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "controller.main", "--listen", "127.0.0.1:0", "--metrics-port", "-1",
         "--store", f"sqlite:///{tmp / 'kv.db'}", "--kv-faulty-hold", str(FAULTY_HOLD_S)],
        stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=tmp)
    for _ in range(600):
        m = re.search(r"listening on (\S+)", log.read_bytes()[at:].decode(errors="replace"))
        if m:
            return Controller(proc, m.group(1), log)
        if proc.poll() is not None:
            raise SystemExit(f"the controller exited: {log.read_text(errors='replace')[-2000:]}")
        await asyncio.sleep(0.1)  # NOTE: not time.sleep: a restarted controller's catch-up asks our ROUTER meanwhile
    proc.kill()
    raise SystemExit("the controller did not start in 60 s")


async def stop_controller(ctl: Controller) -> None:
    ctl.proc.terminate()
    for _ in range(300):
        if ctl.proc.poll() is not None:
            return
        await asyncio.sleep(0.05)
    ctl.proc.kill()


# ---------------------------------------------------------------- the run

@dataclass
class Findings:
    flags: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def flag(self, rnd: int, fault: str, what: str) -> None:
        line = f"round {rnd} ({fault}): {what}"
        print("FLAG", line, flush=True)
        self.flags.append(line)


class Fuzz:
    def __init__(self, args: argparse.Namespace, ctl: Controller, w: Worker, tmp: Path) -> None:
        self.args, self.ctl, self.w, self.tmp = args, ctl, w, tmp
        self.rng = random.Random(args.seed)
        self.found = Findings()
        self.log_at = 0
        self.connect()
        self.rss0 = 0
        self.rss_growth: list[float] = []  # MiB, each controller process's, from its warm-up (or start) to its end
        self.salt = ""
        self.last_fault = "-"

    def connect(self) -> None:
        self.ch = grpc.aio.insecure_channel(self.ctl.address)
        self.routes = RouteServiceStub(self.ch)
        self.workers = WorkerServiceStub(self.ch)

    async def restart(self) -> None:
        """The controller stops (SIGTERM: a graceful stop persists each rank's last seq) and starts again on its
        store: it resumes the worker and catches up by replay from each rank's epoch start."""
        self.rss_growth.append((self.ctl.rss_kib() - self.rss0) / 1024)
        await self.ch.close()
        await stop_controller(self.ctl)
        self.ctl = await start_controller(self.tmp)
        self.connect()
        for _ in range(200):  # until it lists the worker again
            with contextlib.suppress(grpc.aio.AioRpcError, IndexError):
                await self.rank()
                break
            await asyncio.sleep(0.05)
        self.rss0 = self.ctl.rss_kib()

    async def route(self, p: Prompt) -> Any:
        """The Route answer; a refusal because no worker serves (the worker is faulty: over its event budget) is
        an answer too, read as COLD."""
        try:
            return await self.routes.Route(route_pb2.RouteRequest(token_ids=p.tokens, model="m"), timeout=RPC_S)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and "no serving worker" in (e.details() or ""):
                return route_pb2.RouteResponse(verdict="COLD")
            raise

    async def rank(self) -> Any:
        r = await self.workers.ListWorkers(workers_pb2.ListWorkersRequest(), timeout=RPC_S)
        return r.workers[0].ranks[0]

    async def settled(self, seq: int, timeout: float = 6.0) -> bool:
        """Until the controller has read `seq` (its last_seq), or `timeout`."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if (await self.rank()).last_seq == seq:
                return True
            await asyncio.sleep(0.02)
        return False

    async def send_fault(self, f: Fault) -> None:
        w = self.w
        for fr in f.frames:
            if isinstance(fr, list):
                await w.send_frames(fr)
            elif fr[0] == "seq":
                await w.send(fr[1])
            elif fr[0] == "seq24":
                seq = w.seq
                w.seq += 1
                w.buffer[seq] = fr[1]
                await w.send_frames([b"", seq.to_bytes(8, "big") + os.urandom(16), fr[1]])
            elif fr[0] == "lost":  # kept for replay, never sent live
                w.buffer[w.seq] = fr[1]
                w.seq += 1
            else:
                seq, payload = fr[1]
                await w.send(payload, seq, buffer=False)
            await asyncio.sleep(0)

    def new_tracebacks(self) -> list[str]:
        text = self.ctl.log.read_text(errors="replace")
        new, self.log_at = text[self.log_at:], len(text)
        out = []
        for m in re.finditer(r"Traceback \(most recent call last\):\n(?:  .*\n)+(\S.*)", new):
            out.append(m.group(1)[:200])
        return out

    async def warm_within(self, p: Prompt, timeout: float) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if (await self.route(p)).verdict == "WARM":
                return True
            await asyncio.sleep(0.05)
        return False

    async def recover(self, rnd: int, f: Fault) -> None:
        """Valid events resume: a prompt stored now must route WARM (the faulty hold may delay it a round)."""
        t0 = time.monotonic()
        cleared = False
        while time.monotonic() - t0 < RECOVER_S:
            rk = await self.rank()
            if not rk.serving or rk.phase == "faulty":
                await asyncio.sleep(0.1)
                continue
            if f.poisons_groups and not cleared and time.monotonic() - t0 > 2.0:
                # a single-group rank that was told of another KV group fails closed until an epoch drop (by design)
                cleared = True
                self.found.counts["recovered_only_after_clear"] = self.found.counts.get(
                    "recovered_only_after_clear", 0) + 1
                await self.w.send(batch([{"type": "AllBlocksCleared"}]))
            q = new_prompt(self.rng, self.salt)
            seq = await self.w.send(batch([q.event(self.salt)]))
            await self.settled(seq, 3.0)
            if await self.warm_within(q, 1.0):
                return
        rk = await self.rank()
        self.found.flag(rnd, f.name, f"no WARM route {RECOVER_S:g} s after valid events resumed (rank: phase "
                        f"{rk.phase}, serving {rk.serving}, fence {rk.fence!r}, last_seq {rk.last_seq}, "
                        f"worker seq {self.w.seq - 1}, epoch {rk.epoch})")

    async def round(self, rnd: int) -> int:
        p = new_prompt(self.rng, self.salt)
        f = make_fault(self.rng, p, self.salt, self.w, self.args.only)
        self.last_fault = f.name
        self.found.counts[f.name.split(":")[0]] = self.found.counts.get(f.name.split(":")[0], 0) + 1
        self.w.replay_mode = f.replay
        try:
            await self.send_fault(f)
            if f.restart:
                await asyncio.sleep(0.2)  # the frames read before the stop
                await self.restart()
            # a valid marker: the controller has handled the fault once it has read it
            marker = await self.w.send(batch([removed([self.rng.getrandbits(64)])]))
            ok = await self.settled(marker, 14.0 if f.replay != "honest" else 6.0)
            self.w.replay_mode = "honest"
            if not ok:
                await asyncio.sleep(0.5)  # a hold or a replay still out: the checks below tell
            try:
                d = await self.route(p)
                await self.rank()
            except grpc.aio.AioRpcError as e:
                self.found.flag(rnd, f.name, f"the controller did not answer: {e.code()} {e.details()}")
                return 1
            if d.verdict == "WARM" and not f.legal:
                self.found.flag(rnd, f.name, f"WARM ({d.matched_tokens} tokens) on a prompt only a fault vLLM never "
                                "sends named")
            await self.recover(rnd, f)
        finally:
            self.w.replay_mode = "honest"
        for tb in self.new_tracebacks():
            self.found.flag(rnd, f.name, f"traceback in the controller's log: {tb}")
        if self.ctl.proc.poll() is not None:
            self.found.flag(rnd, f.name, "the controller exited")
            raise SystemExit(1)
        if self.args.verbose:
            print(f"{time.strftime('%H:%M:%S')} round {rnd}: {f.name} ({len(f.frames)} frames)", flush=True)
        return 1

    async def run(self) -> Findings:
        sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=1 << 16))).start()
        try:
            spec = workers_pb2.WorkerSpec(name="fz", url=sim.url, kv_events=self.w.pub_ep, replay=self.w.replay_ep,
                                          model="m", block_size=BS, hash_algo="sha256")
            await self.workers.RegisterWorker(workers_pb2.RegisterWorkerRequest(spec=spec), timeout=60)
            if self.args.verbose:
                print(f"controller pid {self.ctl.proc.pid} at {self.ctl.address}", flush=True)
            self.salt = (await self.route(Prompt([1] * BS, [0]))).cache_salt
            # warm-up: until the subscription is up (ZMQ's slow joiner) and a stored prompt routes WARM
            q = new_prompt(self.rng, self.salt)
            for _ in range(300):
                await self.w.send(batch([q.event(self.salt)]))
                if await self.warm_within(q, 0.1):
                    break
            else:
                raise SystemExit("warm-up: the controller never routed a stored prompt WARM")
            self.new_tracebacks()
            self.rss0 = self.ctl.rss_kib()
            rss_max, sent, rnd = self.rss0, 0, 0
            t_end = time.monotonic() + self.args.max_seconds
            while sent < self.args.frames and time.monotonic() < t_end:
                try:
                    sent += await self.round(rnd)
                except grpc.aio.AioRpcError as e:
                    self.found.flag(rnd, self.last_fault, f"the controller stopped answering: {e.code()} "
                                    f"{e.details()}; the run ends here")
                    break
                rnd += 1
                rss_max = max(rss_max, self.ctl.rss_kib())
            self.rss_growth.append((self.ctl.rss_kib() - self.rss0) / 1024)
            print(f"rounds {rnd}, replays served {self.w.replays}; controller RSS growth per process "
                  f"{', '.join(f'{g:+.0f}' for g in self.rss_growth)} MiB (max {rss_max / 1024:.0f} MiB); "
                  f"{self.found.counts}")
            if max(self.rss_growth) > self.args.max_rss_growth_mb:
                self.found.flag(rnd, "-", f"RSS grew {max(self.rss_growth):.0f} MiB in one controller's life")
            return self.found
        finally:
            await self.ch.close()
            await sim.stop()


async def main_async(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvfuzz-") as d:
        ctl = await start_controller(Path(d))
        ctx = zmq.asyncio.Context()
        w = Worker(ctx)
        fuzz = Fuzz(args, ctl, w, Path(d))
        try:
            found = await fuzz.run()
        finally:
            w.close()
            await stop_controller(fuzz.ctl)
            ctx.term()
            if args.keep_log:
                Path(args.keep_log).write_bytes(ctl.log.read_bytes())
    for line in found.flags:
        print("FLAG", line)
    print(f"seed {args.seed}: {len(found.flags)} finding(s)")
    return 1 if found.flags else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=200, help="faults to send (one round each; a flood counts once)")
    p.add_argument("--max-seconds", type=float, default=240.0, help="stop after this long whatever was sent")
    p.add_argument("--max-rss-growth-mb", type=float, default=100.0)
    p.add_argument("--only", choices=KINDS, default="", help="send faults of this kind only")
    p.add_argument("-v", "--verbose", action="store_true", help="print each round's fault")
    p.add_argument("--keep-log", default="", help="copy the controller's log here")
    return asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
