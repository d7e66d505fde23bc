"""`kvfleet sim-vllm`: a vLLM stand-in that speaks the real protocol (HTTP + ZMQ PUB + replay).

In-process use (several in one event loop):

    sim = SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=256)))
    await sim.start(); sim.url, sim.kv_events, sim.replay; await sim.stop()

The command runs the clock (latency and capacity model, docs/sim_vllm.md) in real time by default
(`--time-scale 1`); `SimEngineConfig` defaults to `time_scale=0`, instant answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections import deque
from typing import Any

from aiohttp import web

from fleet.app.testkit.sim_vllm.app import build_app
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.engine import SimEngine
from fleet.app.testkit.sim_vllm.loop import EngineLoop
from fleet.app.testkit.sim_vllm.parts import Received, SimConfig, StoredResponses
from fleet.app.testkit.sim_vllm.publisher import BindError, Publisher
from fleet.app.testkit.sim_vllm.wire import VllmAllBlocksCleared
from fleet.core.errors import InvalidArgument

__all__ = ["SimConfig", "SimVllm", "main"]  # SimConfig lives in parts.py; importers of main.py still find it

PORT_FLAGS = {"http": "--port", "kv_events": "--kv-events-port", "replay": "--replay-port"}  # BindError.what


class SimVllm:
    """One stand-in vLLM server (one DP rank): HTTP app, engine, publisher (what its routes read: `parts.Sim`)."""

    def __init__(self, cfg: SimConfig | None = None) -> None:
        self.cfg = cfg or SimConfig()
        self.middlewares: tuple[Any, ...] = ()  # aiohttp middlewares put first in its app (tests observe with them)
        self.publisher: Publisher | None = None
        self.engine = SimEngine(self.cfg.engine, self._publish)
        self.loop = EngineLoop(self.engine) if self.cfg.engine.time_scale > 0 else None
        self.received = Received()  # the completion requests it got (tests: bytes that must never arrive)
        self.responses = StoredResponses()
        self._runner: web.AppRunner | None = None
        self.port = 0
        # when (time.monotonic) a batch carrying AllBlocksCleared went out, the latest 256: a bench tells by it when
        # a reset behind a router's back first reached any router (bench/peers/report.py stale_raced)
        self.cleared_at: deque[float] = deque(maxlen=256)

    def _publish(self, events: list[object]) -> None:
        assert self.publisher is not None
        self.publisher.publish(events)
        if any(isinstance(e, VllmAllBlocksCleared) for e in events):
            self.cleared_at.append(time.monotonic())

    async def start(self) -> SimVllm:
        c = self.cfg
        self.publisher = Publisher(
            host=c.host,
            port=_at_rank(c.kv_events_port, c.dp_rank),
            replay_port=None if c.replay_port is None else _at_rank(c.replay_port, c.dp_rank),
            topic=c.topic,
            buffer_steps=c.buffer_steps,
            dp_rank=c.dp_rank,
            legacy_replay=c.legacy_replay,
        )
        self.publisher.start()
        if self.loop is not None:
            self.loop.start()
        # NOTE: like vLLM, a request whose client went away is aborted (handler cancelled), not left queued.
        app = build_app(self)
        app.middlewares[:0] = self.middlewares
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, c.host, c.port)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise BindError("http", c.host, c.port, os.strerror(e.errno) if e.errno else str(e)) from e
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.loop is not None:
            await self.loop.stop()  # NOTE: first, so that handlers of in-flight requests end
        if self._runner is not None:
            await self._runner.cleanup()
        if self.publisher is not None:
            await self.publisher.close()

    def restart(self) -> None:
        """A fast restart: empty cache, seq back to 0, replay buffer lost; same endpoints."""
        self.engine.restart()
        self.responses.items.clear()
        assert self.publisher is not None
        self.publisher.restart()

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.port}"

    @property
    def kv_events(self) -> str:
        """The PUB endpoint as vLLM is configured with it, what a worker registers: rank r binds its port + r."""
        assert self.publisher is not None
        return _configured(self.publisher.endpoint, self.cfg.dp_rank)

    @property
    def replay(self) -> str | None:
        assert self.publisher is not None
        ep = self.publisher.replay_endpoint
        return None if ep is None else _configured(ep, self.cfg.dp_rank)

    def endpoints(self) -> dict[str, object]:
        return {
            "url": self.url,
            "kv_events": self.kv_events,
            "replay": self.replay,
            "model": self.cfg.engine.model,
            "block_size": self.cfg.engine.block_size,
            "dp_rank_start": self.cfg.dp_rank,
        }


def _at_rank(port: int, dp_rank: int) -> int:
    """The port a rank binds, as vLLM's ZmqEventPublisher.offset_endpoint_port: the configured one + the global rank
    (0: the stand-in picks a free port, and reports it as rank dp_rank's of the configured port - dp_rank)."""
    return port + dp_rank if port else 0


def _configured(endpoint: str, dp_rank: int) -> str:
    host, port = endpoint.rsplit(":", 1)
    return f"{host}:{int(port) - dp_rank}"


def _parse(argv: list[str]) -> SimConfig:
    p = argparse.ArgumentParser(
        prog="kvfleet sim-vllm", description=__doc__.splitlines()[0] if __doc__ else None
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0 = pick)")
    p.add_argument("--kv-events-port", type=int, default=0, help="ZMQ PUB port (0 = pick)")
    p.add_argument("--replay-port", type=int, default=0, help="ZMQ replay ROUTER port (0 = pick, -1 = none)")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="the names it serves the model under, as vLLM's (default: --model); the first answers")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=SimEngineConfig().max_model_len,
                   help="context length, prompt and output together, as vLLM's (a longer request is a 400)")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--hash-algo", default="sha256", choices=["sha256", "sha256_cbor"])
    p.add_argument("--hash-extra-keys", default="tagged", choices=["tagged", "untagged"],
                   help="how a block's LoRA and cache_salt keys are hashed: domain-tagged, or as the plain strings the "
                   "events publish (vLLM releases before the tags)")
    p.add_argument(
        "--hash-seed", default=None, help="the PYTHONHASHSEED the worker runs with (default: unset)"
    )
    p.add_argument("--lora", action="append", default=[], help="NAME=PATH adapter (repeatable)")
    p.add_argument("--topic", default="")
    p.add_argument("--buffer-steps", type=int, default=10000)
    p.add_argument("--data-parallel-rank", type=int, default=0, metavar="N",
                   help="the global DP rank this server runs, as vLLM's (external DP load balancing): its KV events "
                        "bind --kv-events-port + N and --replay-port + N, and its batches and /metrics say N")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N", help="the deployment's DP ranks, as vLLM's")
    d = SimEngineConfig()
    g = p.add_argument_group(
        "clock", "latency and capacity model (docs/sim_vllm.md; defaults: 8B model, one H100)"
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per modelled second (0 = instant answers, no queueing; default 1)",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running sequences at most")
    g.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default=d.scheduling_policy,
                   help="vLLM's: fcfs, or priority (waiting requests run by their `priority`, lower first; a "
                        "non-zero priority is refused under fcfs, as vLLM does)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens per engine step (chunked prefill budget)",
    )
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=d.prefill_tokens_per_s,
        help="prefill throughput of uncached prompt tokens",
    )
    g.add_argument(
        "--step-overhead-s", type=float, default=d.step_overhead_s, help="fixed cost of every step"
    )
    g.add_argument(
        "--decode-base-s",
        type=float,
        default=d.decode_base_s,
        help="one forward pass at least (weights read once per step)",
    )
    g.add_argument(
        "--decode-per-seq-s",
        type=float,
        default=d.decode_per_seq_s,
        help="added per decoding sequence in the step",
    )
    a = p.parse_args(argv)
    try:  # NOTE: a host no address resolves to failed its first bind, said as "choose another --kv-events-port"
        socket.getaddrinfo(a.host, None)
    except (OSError, UnicodeError) as e:
        p.error(f"--host {a.host!r} is not an address this machine can listen on ({e})")
    for flag, value, least in (("--port", a.port, 0), ("--kv-events-port", a.kv_events_port, 0),
                               ("--replay-port", a.replay_port, -1)):
        if not least <= value <= 65535:
            p.error(f"{flag} must be a port, 0-65535 (0: pick a free one{'; -1: none' if least < 0 else ''}), "
                    f"got {value}")
    if a.buffer_steps < 0:
        p.error(f"--buffer-steps must be >= 0, got {a.buffer_steps}")
    _check_dp(p, a)
    bad = [x for x in a.lora if "=" not in x or not x.split("=", 1)[0] or not x.split("=", 1)[1]]
    if bad:
        p.error(f"--lora takes NAME=PATH, got {bad[0]!r}")
    loras = dict(x.split("=", 1) for x in a.lora)
    try:
        eng = SimEngineConfig(
            model=a.model,
            served_model_names=tuple(a.served_model_name),
            runtime_lora=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
            block_size=a.block_size,
            num_blocks=a.num_blocks,
            max_model_len=a.max_model_len,
            hash_algo=a.hash_algo,
            hash_seed=a.hash_seed,
            hash_extra_keys=a.hash_extra_keys,
            loras=loras,
            time_scale=a.time_scale,
            max_num_seqs=a.max_num_seqs,
            scheduling_policy=a.scheduling_policy,
            max_num_batched_tokens=a.max_num_batched_tokens,
            prefill_tokens_per_s=a.prefill_tokens_per_s,
            step_overhead_s=a.step_overhead_s,
            decode_base_s=a.decode_base_s,
            decode_per_seq_s=a.decode_per_seq_s,
        )
    except InvalidArgument as e:  # names the flag
        p.error(str(e))
    return SimConfig(
        engine=eng,
        host=a.host,
        port=a.port,
        kv_events_port=a.kv_events_port,
        replay_port=None if a.replay_port < 0 else a.replay_port,
        topic=a.topic,
        buffer_steps=a.buffer_steps,
        dp_rank=a.data_parallel_rank,
    )


def _check_dp(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """vLLM's DP flags, and the ports rank N binds (the configured ones + N) must be ports."""
    rank, size = a.data_parallel_rank, a.data_parallel_size
    if size < 1:
        p.error(f"--data-parallel-size must be >= 1, got {size}")
    if not 0 <= rank < size:
        p.error(f"--data-parallel-rank must be 0..{size - 1} (--data-parallel-size {size}), got {rank}")
    for flag, port in (("--kv-events-port", a.kv_events_port), ("--replay-port", a.replay_port)):
        if port > 0 and port + rank > 65535:
            p.error(f"{flag} {port} + --data-parallel-rank {rank} = {port + rank} is past 65535 (rank N binds the "
                    f"port + N, as vLLM)")


async def _serve(cfg: SimConfig) -> None:
    sim = await SimVllm(cfg).start()
    print(json.dumps(sim.endpoints()), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.stop()


def main(argv: list[str]) -> int:
    cfg = _parse(argv)
    try:
        asyncio.run(_serve(cfg))
    except KeyboardInterrupt:
        pass
    except BindError as e:
        print(f"kvfleet sim-vllm: error: {e}: choose another {PORT_FLAGS[e.what]}, or 0 to pick a free one",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
