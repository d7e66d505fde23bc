"""aiohttp routes of the stand-in: vLLM's dev-mode endpoints with their 0.33.0 response bodies."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from controller.sim_vllm import tokenizer as tok
from controller.sim_vllm.engine import EnginePaused, EngineRestarted
from fleet.errors import InvalidArgument

if TYPE_CHECKING:
    from controller.sim_vllm.main import SimVllm

VERSION = "0.33.0"


def _j(body: Any, status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


def _bool(q: str | None, default: bool) -> bool | None:
    if q is None:
        return default
    return {"true": True, "1": True, "false": False, "0": False}.get(q.lower())


def build_app(sim: SimVllm) -> web.Application:
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
        eng.sleep(level, mode)
        return _j({"status": "sleeping", "level": level})

    async def wake_up(req: web.Request) -> web.Response:
        tags = req.query.getall("tags", None)
        awake = eng.wake_up(list(tags) if tags else None)
        return _j({"status": "awake" if awake else "sleeping", "tags": list(tags) if tags else None})

    async def pause(req: web.Request) -> web.Response:
        mode, clear = req.query.get("mode", "abort"), _bool(req.query.get("clear_cache"), True)
        if mode not in ("abort", "wait", "keep") or clear is None:
            return _j({"error": f"invalid pause mode {mode!r} or clear_cache"}, 400)
        eng.pause(mode, clear)
        return _j({"status": "paused"})

    async def resume(req: web.Request) -> web.Response:
        eng.resume()
        return _j({"status": "resumed"})

    async def reset(req: web.Request) -> web.Response:
        return _j({"success": eng.reset_prefix_cache()})

    async def release(req: web.Request) -> web.Response:
        if not eng.release_kv_cache_memory():
            return _j({"error": "release_kv_cache_memory needs a completed pause with all memory resident"}, 400)
        return _j({"status": "kv_cache_released"})

    async def server_info(req: web.Request) -> web.Response:
        c = sim.cfg.engine
        return _j({"vllm_config": {"model_config": {"model": c.model, "max_model_len": c.max_model_len},
                                   "cache_config": {"block_size": c.block_size, "enable_prefix_caching": True,
                                                    "prefix_caching_hash_algo": c.hash_algo}},
                   "vllm_env": {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1", "VLLM_SERVER_DEV_MODE": "1"},
                   "system_env": {}})

    async def models(req: web.Request) -> web.Response:
        c, now = sim.cfg.engine, int(eng.start_time)
        data = [{"id": c.model, "object": "model", "created": now, "owned_by": "vllm", "root": c.model,
                 "parent": None, "max_model_len": c.max_model_len}]
        data += [{"id": n, "object": "model", "created": now, "owned_by": "vllm", "root": p, "parent": c.model,
                  "max_model_len": c.max_model_len} for n, p in sorted(c.loras.items())]
        return _j({"object": "list", "data": data})

    async def tokenize(req: web.Request) -> web.Response:
        body = await _body(req)
        ids = tok.apply_chat_template(body["messages"]) if "messages" in body else tok.tokenize(body.get("prompt"))
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
        return _j({"block_hashes": eng.resident_external(), "is_sleeping": eng.is_sleeping(),
                   "serving": not eng.is_sleeping(), "seq": sim.publisher.seq if sim.publisher else -1, "start_time": eng.start_time})

    async def is_sleeping(req: web.Request) -> web.Response:
        return _j({"is_sleeping": eng.is_sleeping()})

    async def is_paused(req: web.Request) -> web.Response:
        return _j({"is_paused": eng.paused_by == "pause"})

    async def health(req: web.Request) -> web.Response:
        return web.Response(status=200)  # NOTE: 200 while asleep or paused, as vLLM

    async def version(req: web.Request) -> web.Response:
        return _j({"version": VERSION})

    async def metrics(req: web.Request) -> web.Response:
        return web.Response(text=metrics_text(sim), content_type="text/plain")

    async def complete(req: web.Request) -> web.StreamResponse:
        return await completions(sim, req, chat=False)

    async def chat(req: web.Request) -> web.StreamResponse:
        return await completions(sim, req, chat=True)

    for path, h in (("/sleep", sleep), ("/wake_up", wake_up), ("/pause", pause), ("/resume", resume),
                    ("/reset_prefix_cache", reset), ("/release_kv_cache_memory", release), ("/tokenize", tokenize),
                    ("/v1/completions", complete), ("/v1/chat/completions", chat), ("/sim/restart", restart),
                    ("/sim/drop_next_events", drop)):
        r.add_post(path, h)
    async def kv_event_sources(req: web.Request) -> web.Response:
        pub = sim.publisher
        assert pub is not None
        return _j({"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub.endpoint,
                         "replay_endpoint": pub.replay_endpoint, "buffer_steps": sim.cfg.buffer_steps,
                         "topic": sim.cfg.topic}})

    for path, h in (("/kv_event_sources", kv_event_sources), ("/is_sleeping", is_sleeping), ("/is_paused", is_paused), ("/server_info", server_info),
                    ("/health", health), ("/version", version), ("/v1/models", models), ("/metrics", metrics),
                    ("/sim/cache", cache)):
        r.add_get(path, h)
    app.middlewares.append(_errors)  # type: ignore[arg-type]  # aiohttp types the decorator loosely
    return app


@web.middleware
async def _errors(req: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(req)
    except (InvalidArgument, KeyError, ValueError, TypeError) as e:
        return _j({"error": {"message": str(e), "type": "BadRequestError", "code": 400}}, 400)


async def _body(req: web.Request) -> dict[str, Any]:
    try:
        body = await req.json()
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidArgument("body must be a JSON object")
    return body


def _prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
    if chat:
        return tok.apply_chat_template(body["messages"])
    p = body.get("prompt")
    if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    return tok.tokenize(p)


async def completions(sim: SimVllm, req: web.Request, *, chat: bool) -> web.StreamResponse:
    body = await _body(req)
    c = sim.cfg.engine
    model = body.get("model", c.model)
    if model != c.model and model not in c.loras:
        return _j({"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                             "code": 404}}, 404)
    ids = _prompt_ids(body, chat)
    n = int(body.get("max_tokens") or 16)
    report_full = (body.get("extra_args") or {}).get("kv_cache_report_mode") == "full"
    try:
        res = await sim.engine.run(ids, lora=model if model in c.loras else None,
                                   cache_salt=body.get("cache_salt"), report_full=report_full)
    except (EnginePaused, EngineRestarted) as e:
        return _j({"error": {"message": str(e), "type": "ServiceUnavailableError", "code": 503}}, 503)
    out = tok.synthetic_output(ids, n)
    text = tok.detokenize(out)
    usage = {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n,
             "prompt_tokens_details": {"cached_tokens": res.num_cached_tokens}}
    rid, created = f"cmpl-{sim.engine.queries}", int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    if not body.get("stream"):
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                   "finish_reason": "length"} if chat else
                                  {"index": 0, "text": text, "finish_reason": "length"})
        return _j({"id": rid, "object": kind, "created": created, "model": model, "choices": [choice],
                   "usage": usage})
    return await _stream(req, rid, created, model, out, usage, chat)


async def _stream(req: web.Request, rid: str, created: int, model: str, out: list[int], usage: dict[str, Any],
                  chat: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(req)
    kind = "chat.completion.chunk" if chat else "text_completion"
    for i, t in enumerate(out):
        piece = tok.detokenize([t])
        fin = "length" if i == len(out) - 1 else None
        choice = {"index": 0, "delta": {"content": piece}, "finish_reason": fin} if chat else \
            {"index": 0, "text": piece, "finish_reason": fin}
        chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
        await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
    final = {"id": rid, "object": kind, "created": created, "model": model, "choices": [], "usage": usage}
    await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
    await resp.write_eof()
    return resp


def metrics_text(sim: SimVllm) -> str:
    """Prometheus text: the vLLM series the controller reads, labelled as vLLM labels them."""
    e, c = sim.engine, sim.cfg.engine
    lab = f'engine="0",model_name="{c.model}"'
    used = e.running / max(c.num_blocks - 1, 1)
    lines = ["# HELP vllm:engine_sleep_state Engine sleep state", "# TYPE vllm:engine_sleep_state gauge"]
    lines += [f'vllm:engine_sleep_state{{{lab},sleep_state="{k}"}} {float(v)}' for k, v in e.sleep_state.items()]
    lines += ["# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {float(e.running)}",
              "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lab}}} {float(e.waiting)}",
              "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{lab}}} {used}",
              "# TYPE vllm:prefix_cache_queries_total counter",
              f"vllm:prefix_cache_queries_total{{{lab}}} {float(e.queries)}",
              "# TYPE vllm:prefix_cache_hits_total counter", f"vllm:prefix_cache_hits_total{{{lab}}} {float(e.hits)}",
              "# TYPE vllm:cache_config_info gauge",
              f'vllm:cache_config_info{{block_size="{c.block_size}",enable_prefix_caching="True",engine="0",'
              f'prefix_caching_hash_algo="{c.hash_algo}"}} 1.0',
              "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {e.start_time}"]
    if e.sleep_ops:  # created lazily on the first sleep-mode call, as vLLM does: absent != 0
        lines.append("# TYPE vllm:sleep_mode_operation_duration_seconds histogram")
        for op, n in sorted(e.sleep_ops.items()):
            lines += [f'vllm:sleep_mode_operation_duration_seconds_bucket{{{lab},operation="{op}",le="+Inf"}} {float(n)}',
                      f'vllm:sleep_mode_operation_duration_seconds_count{{{lab},operation="{op}"}} {float(n)}',
                      f'vllm:sleep_mode_operation_duration_seconds_sum{{{lab},operation="{op}"}} {0.001 * n}']
    return "\n".join(lines) + "\n"
