"""aiohttp routes of the stand-in: vLLM's dev-mode endpoints with their 0.33.0 response bodies."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fleet.app.testkit.sim_vllm import prompts
from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.completions import body_of, completions, unknown_model
from fleet.app.testkit.sim_vllm.extra_routes import (
    ANSWERS,
    answering,
    detokenizing,
    lora_updating,
    responding,
)
from fleet.app.testkit.sim_vllm.metrics import metrics_text
from fleet.app.testkit.sim_vllm.parts import Sim
from fleet.app.testkit.sim_vllm.publisher import PUB_HWM
from fleet.core.errors import InvalidArgument
from fleet.core.lax import lax_bool

VERSION = "0.33.0"


def _j(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _bool(q: str | None, default: bool) -> bool | None:
    """A bool query parameter as FastAPI reads one (pydantic's lax mode: yes/no, on/off, t/f, ... in any case); None
    for a value it refuses (a 422). NOTE: true/1/false/0 alone were read (review finding)."""
    return default if q is None else lax_bool(q)


def build_app(sim: Sim) -> web.Application:
    app = web.Application()
    eng = sim.engine
    r = app.router

    async def sleep(req: web.Request) -> web.Response:
        try:
            level = int(req.query.get("level", "1"))
        except ValueError:
            return _j({"detail": "level must be an int"}, 422)
        mode = req.query.get("mode", "abort")
        if level not in (0, 1, 2) or mode not in ("abort", "wait", "keep"):
            return _j({"detail": "invalid level or mode"}, 422)
        with eng.ops.record("sleep"):  # in flight until the sleep has completed (sleep_ops.py)
            eng.sleep(level, mode)
            if mode == "wait":  # NOTE: vLLM's sleep pauses first, as /pause does, and answers once the drain is done
                await eng.drained()
        return _j({"status": "sleeping", "level": level})

    async def wake_up(req: web.Request) -> web.Response:
        tags = req.query.getall("tags", None)
        with eng.ops.record("wake"):
            awake = eng.wake_up(list(tags) if tags else None)
        return _j({"status": "awake" if awake else "sleeping", "tags": list(tags) if tags else None})

    async def pause(req: web.Request) -> web.Response:
        mode, clear = req.query.get("mode", "abort"), _bool(req.query.get("clear_cache"), True)
        if clear is None:  # NOTE: FastAPI's Query validation, as vLLM's level=3 (it was a 400; review finding)
            return _j({"detail": "clear_cache must be a boolean"}, 422)
        if mode not in ("abort", "wait", "keep"):
            return _j({"error": f"invalid pause mode {mode!r}"}, 400)
        eng.pause(mode, clear)
        if mode == "wait":  # NOTE: vLLM answers once the requests in flight have finished; this answered at once
            await eng.drained()
        return _j({"status": "paused"})

    async def resume(req: web.Request) -> web.Response:
        eng.resume()
        return _j({"status": "resumed"})

    async def reset(req: web.Request) -> web.Response:
        preempt = _bool(req.query.get("reset_running_requests"), False)
        if preempt is None:
            return _j({"detail": "reset_running_requests must be a boolean"}, 422)
        return _j({"success": eng.reset_prefix_cache(reset_running_requests=preempt)})

    async def release(req: web.Request) -> web.Response:
        with eng.ops.record("release_kv_cache_memory"):  # vLLM counts a refused one too (its engine raised)
            released = eng.release_kv_cache_memory()
        if not released:
            return _j(
                {"error": "release_kv_cache_memory needs a completed pause with all memory resident"}, 400
            )
        return _j({"status": "kv_cache_released"})

    async def server_info(req: web.Request) -> web.Response:
        c = sim.cfg.engine
        return _j(
            {
                "vllm_config": {
                    "model_config": {"model": c.model, "max_model_len": c.max_model_len},
                    "cache_config": {
                        "block_size": c.block_size,
                        "enable_prefix_caching": True,
                        "prefix_caching_hash_algo": c.hash_algo,
                    },
                },
                "vllm_env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1", "VLLM_SERVER_DEV_MODE": "1"},
                "system_env": {},
            }
        )

    async def models(req: web.Request) -> web.Response:
        c, now = sim.cfg.engine, int(eng.start_time)
        data = [  # NOTE: as vLLM lists --served-model-name: one card per name, each with the model's path as root
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": c.model,
                "parent": None,
                "max_model_len": c.max_model_len,
            }
            for name in c.names
        ]
        data += [
            {
                "id": n,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": p,
                "parent": c.names[0],
                "max_model_len": c.max_model_len,
            }
            for n, p in sorted(c.loras.items())
        ]
        return _j({"object": "list", "data": data})

    async def tokenize(req: web.Request) -> web.Response:
        body = await body_of(req)
        refused = unknown_model(sim.cfg.engine, body.get("model") or sim.cfg.engine.names[0])
        if refused is not None:
            return refused
        # NOTE: rendered as vLLM's /tokenize does: no `documents` field, no truncation (prompts.py)
        ids = prompts.chat_ids(body, tokenize_route=True) if "messages" in body else tok.tokenize(body.get("prompt"))
        return _j({"tokens": ids, "count": len(ids), "max_model_len": sim.cfg.engine.max_model_len})

    async def restart(req: web.Request) -> web.Response:
        sim.restart()
        return _j({"status": "restarted", "start_time": eng.start_time})

    async def drop(req: web.Request) -> web.Response:
        pub = sim.publisher
        assert pub is not None
        pub.drop_next += int(req.query.get("n", "1"))
        return _j({"drop_next": pub.drop_next})

    async def cache(req: web.Request) -> web.Response:
        return _j(
            {
                "block_hashes": eng.resident_external(),
                "is_sleeping": eng.is_sleeping(),
                "serving": not eng.is_sleeping(),
                "seq": sim.publisher.seq if sim.publisher else -1,
                "start_time": eng.start_time,
            }
        )

    async def is_sleeping(req: web.Request) -> web.Response:
        return _j({"is_sleeping": eng.is_sleeping()})

    async def is_paused(req: web.Request) -> web.Response:
        return _j({"is_paused": eng.paused_by is not None})  # vLLM: the scheduler paused, a sleep's pause included

    async def health(req: web.Request) -> web.Response:
        return web.Response(status=200)  # NOTE: 200 while asleep or paused, as vLLM

    async def version(req: web.Request) -> web.Response:
        return _j({"version": VERSION})

    async def metrics(req: web.Request) -> web.Response:
        return web.Response(text=metrics_text(sim.engine, sim.cfg.dp_rank), content_type="text/plain")

    async def complete(req: web.Request) -> web.StreamResponse:
        return await completions(sim, req, chat=False)

    async def chat(req: web.Request) -> web.StreamResponse:
        return await completions(sim, req, chat=True)

    for path, h in (
        ("/sleep", sleep),
        ("/wake_up", wake_up),
        ("/pause", pause),
        ("/resume", resume),
        ("/reset_prefix_cache", reset),
        ("/release_kv_cache_memory", release),
        ("/tokenize", tokenize),
        ("/v1/completions", complete),
        ("/v1/chat/completions", chat),
        ("/sim/restart", restart),
        ("/sim/drop_next_events", drop),
        ("/detokenize", detokenizing(sim)),
        *((p, answering(sim, answer)) for p, answer in ANSWERS.items()),
        *(lora_updating(sim).items() if sim.cfg.engine.runtime_lora else ()),
    ):
        r.add_post(path, h)
    for (method, path), h in responding(sim).items():
        r.add_route(method, path, h)

    async def kv_event_sources(req: web.Request) -> web.Response:
        pub = sim.publisher
        assert pub is not None
        return _j(
            {
                str(sim.cfg.dp_rank): {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint,
                    "buffer_steps": sim.cfg.buffer_steps,
                    "hwm": PUB_HWM,
                    "max_queue_size": PUB_HWM,   # vLLM's default, as hwm's (the stand-in publishes in its step)
                    "topic": sim.cfg.topic,
                }
            }
        )

    for path, h in (
        ("/kv_event_sources", kv_event_sources),
        ("/is_sleeping", is_sleeping),
        ("/is_paused", is_paused),
        ("/server_info", server_info),
        ("/health", health),
        ("/version", version),
        ("/v1/models", models),
        ("/metrics", metrics),
        ("/sim/cache", cache),
    ):
        r.add_get(path, h)
    app.middlewares.append(_errors)  # type: ignore[arg-type]  # aiohttp types the decorator loosely
    return app


@web.middleware
async def _errors(
    req: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(req)
    except (InvalidArgument, KeyError, ValueError, TypeError) as e:
        message = str(e)  # NOTE: vLLM's error body always has "param": the parameter its validation error names
        param = m.group(1) if (m := _PARAMETER.search(message)) else None
        return _j({"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}, 400)


_PARAMETER = re.compile(r"\(parameter=(\w+), value=[^)]*\)$")  # how vLLM's validation errors end
