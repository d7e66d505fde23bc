"""The stand-in's vLLM routes beyond the completions: /detokenize, the pooling family (/v1/embeddings, /pooling,
/score, /v1/score, /rerank, /v1/rerank, /v2/rerank, /classify), /v1/responses, and (with `runtime_lora`, vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING) /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's answer shapes.

NOTE: answered at once from the tokenized input, deterministically (a function of its ids): they do not go through
the engine, so they take no queue slot, publish no KV events, and a sleeping stand-in answers them (a sleeping vLLM
queues them). /v1/responses answers `stream: true` with a 400; the proxy tests need only its non-streamed shape. Its
answers are stored (`parts.StoredResponses`) for `previous_response_id`, GET /v1/responses/{id} and cancel.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.completions import body_of, unknown_model
from fleet.app.testkit.sim_vllm.parts import Sim
from fleet.core.errors import InvalidArgument
from fleet.core.lax import stream_of

Handler = Callable[[web.Request], Awaitable[web.Response]]
NUM_DIMS = 8  # of a stand-in embedding


def _ids(text: Any) -> list[int]:
    """One input's ids: a string is tokenized, a list of ints is already ids."""
    if isinstance(text, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in text):
        return list(text)
    return tok.tokenize(text)


def _inputs(value: Any) -> list[list[int]]:
    """An `input` (or `text_2`, `documents`) as vLLM takes it: one string or id list, or a list of those."""
    if isinstance(value, list) and value and not all(isinstance(t, int) for t in value):
        return [_ids(v.get("text") if isinstance(v, dict) else v) for v in value]
    return [_ids(value)]


def _unit(ids: list[int], salt: int = 0) -> float:
    """A deterministic number in [0, 1) from the ids."""
    return (zlib.crc32(bytes(str(ids), "ascii"), salt) % 10_000) / 10_000


def _vector(ids: list[int]) -> list[float]:
    return [_unit(ids, k) for k in range(NUM_DIMS)]


def _usage(n: int) -> dict[str, Any]:
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


def _listed(kind: str, model: str, data: list[dict[str, Any]], n: int) -> dict[str, Any]:
    return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": _usage(n)}


def _embeddings(body: dict[str, Any], model: str) -> dict[str, Any]:
    ins = _inputs(body.get("input"))
    data = [{"index": i, "object": "embedding", "embedding": _vector(ids)} for i, ids in enumerate(ins)]
    return _listed("embd", model, data, sum(map(len, ins)))


def _pooling(body: dict[str, Any], model: str) -> dict[str, Any]:
    ins = _inputs(body.get("input"))
    data = [{"index": i, "object": "pooling", "data": _vector(ids)} for i, ids in enumerate(ins)]
    return _listed("pool", model, data, sum(map(len, ins)))


def _classify(body: dict[str, Any], model: str) -> dict[str, Any]:
    ins = _inputs(body.get("input"))
    data = []
    for i, ids in enumerate(ins):
        p = _unit(ids)
        data.append({"index": i, "label": "LABEL_1" if p >= 0.5 else "LABEL_0", "probs": [1 - p, p], "num_classes": 2})
    return _listed("classify", model, data, sum(map(len, ins)))


def _score(body: dict[str, Any], model: str) -> dict[str, Any]:
    first, seconds = _ids(body.get("text_1")), _inputs(body.get("text_2"))
    data = [{"index": i, "object": "score", "score": _unit(first + ids)} for i, ids in enumerate(seconds)]
    return _listed("score", model, data, sum(len(first) + len(ids) for ids in seconds))


def _rerank(body: dict[str, Any], model: str) -> dict[str, Any]:
    query, docs = _ids(body.get("query")), body.get("documents")
    if not isinstance(docs, list):
        raise InvalidArgument("'documents' must be a list")
    texts = [d.get("text") if isinstance(d, dict) else d for d in docs]
    ins = [_ids(t) for t in texts]
    results: list[dict[str, Any]] = [{"index": i, "document": {"text": t}, "relevance_score": _unit(query + ids)}
                                     for i, (t, ids) in enumerate(zip(texts, ins, strict=True))]
    results.sort(key=lambda r: -float(r["relevance_score"]))
    n = sum(len(query) + len(ids) for ids in ins)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": n},
            "results": results[: body.get("top_n") or len(results)]}


def _response(body: dict[str, Any], model: str, previous: dict[str, Any] | None) -> tuple[dict[str, Any], list[int]]:
    """/v1/responses, non-streamed: `input` is a string or a list of message items; `previous` the stored response a
    `previous_response_id` names (its conversation comes first). The answer, and the ids of the conversation."""
    if stream_of(body):
        raise InvalidArgument('the stand-in answers /v1/responses unstreamed only: send it without "stream": true '
                              "(a vLLM server streams it; docs/sim_vllm.md lists what the stand-in leaves out)")
    items = body.get("input")
    ids = (tok.apply_chat_template(_as_messages(items)) if isinstance(items, list) else tok.tokenize(items))
    if previous is not None:
        ids = [*previous["kvfleet_sim_ids"], *ids]
    out = tok.synthetic_output(ids, int(body.get("max_output_tokens") or 16))
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "completed",
               "content": [{"type": "output_text", "text": tok.detokenize(out), "annotations": []}]}
    usage = {"input_tokens": len(ids), "output_tokens": len(out), "total_tokens": len(ids) + len(out),
             "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
    answer = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": model,
              "status": "completed", "output": [message], "usage": usage,
              "previous_response_id": previous["id"] if previous is not None else None}
    return answer, [*ids, *out]


def _as_messages(items: list[Any]) -> list[Any]:
    """A Responses `input` as chat messages to tokenize: message items as they are, a tool call as the assistant's
    text, its reasoning as its text, a tool's output (`*_output` items) as a tool message (vLLM renders each item type in its own way)."""
    out: list[Any] = []
    for item in items:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "function_call":
            out.append({"role": "assistant", "content": f"{item.get('name')}({item.get('arguments')})"})
        elif kind == "reasoning":  # vLLM: the assistant's reasoning, its first content text (else summary text)
            parts = item.get("content") or item.get("summary") or [{}]
            if not isinstance(parts, list) or not isinstance(parts[0], dict):  # NOTE: parts[0].get was a 500, or a 400
                # saying "0" (found by scripts/fuzz_proxy.py); vLLM's item model refuses it (400)
                raise InvalidArgument("a reasoning item's content and summary must be lists of objects")
            out.append({"role": "assistant", "content": str(parts[0].get("text", ""))})
        elif isinstance(kind, str) and kind.endswith("_output"):
            output = item.get("output")
            out.append({"role": "tool", "content": output if isinstance(output, str | list) else str(output)})
        else:
            out.append(item)
    return out


def _not_found(rid: str) -> web.Response:
    """vLLM's answer for a response id its store does not hold."""
    return web.json_response({"error": {"message": f"Response with id '{rid}' not found.",
                                        "type": "invalid_request_error", "param": "response_id", "code": 404}},
                             status=404)


def responding(sim: Sim) -> dict[tuple[str, str], Handler]:
    """POST /v1/responses, GET /v1/responses/{id} and POST /v1/responses/{id}/cancel, with the stand-in's store
    (`sim.responses`): a response is stored unless `store` is false, and a `previous_response_id` it does not hold is
    vLLM's 404."""

    async def create(req: web.Request) -> web.Response:
        body, model, refused = await _received(sim, req)
        if refused:
            return refused
        prev = body.get("previous_response_id")
        previous = sim.responses.items.get(prev) if isinstance(prev, str) else None
        if prev is not None and previous is None:
            return _not_found(str(prev))
        answer, ids = _response(body, model, previous)
        if body.get("store", True):
            sim.responses.add({**answer, "kvfleet_sim_ids": ids})
        return web.json_response(answer)

    async def retrieve(req: web.Request) -> web.Response:
        rid = req.match_info["response_id"]
        got = sim.responses.items.get(rid)
        if got is None:
            return _not_found(rid)
        return web.json_response({k: v for k, v in got.items() if k != "kvfleet_sim_ids"})

    async def cancel(req: web.Request) -> web.Response:
        rid = req.match_info["response_id"]
        if rid not in sim.responses.items:
            return _not_found(rid)
        return web.json_response({"error": {"message": "Cannot cancel a synchronous response.",
                                             "type": "invalid_request_error", "param": None, "code": 400}}, status=400)

    return {("POST", "/v1/responses"): create, ("GET", "/v1/responses/{response_id}"): retrieve,
            ("POST", "/v1/responses/{response_id}/cancel"): cancel}


ANSWERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "/v1/embeddings": _embeddings, "/pooling": _pooling, "/classify": _classify,
    "/score": _score, "/v1/score": _score,
    "/rerank": _rerank, "/v1/rerank": _rerank, "/v2/rerank": _rerank,
}


def answering(sim: Sim, answer: Callable[[dict[str, Any], str], dict[str, Any]]) -> Handler:
    """The route for one of ANSWERS: the model checked as vLLM checks it, the request recorded (`sim.received`)."""

    async def handler(req: web.Request) -> web.Response:
        body, model, refused = await _received(sim, req)
        return refused or web.json_response(answer(body, model))

    return handler


async def _received(sim: Sim, req: web.Request) -> tuple[dict[str, Any], str, web.Response | None]:
    """The request's body, recorded (`sim.received`); the model that answers it (an adapter's name, else the served
    model's first name); vLLM's 404 when it names a model the stand-in does not serve (else None)."""
    body = await body_of(req)
    sim.received.add(req.path, await req.text(), body)
    c = sim.cfg.engine
    model = body.get("model") or c.names[0]
    return body, model if model in c.loras else c.names[0], unknown_model(c, model)


def detokenizing(sim: Sim) -> Handler:
    """POST /detokenize {model, tokens} -> {"prompt": text}, as vLLM answers it."""

    async def handler(req: web.Request) -> web.Response:
        body = await body_of(req)
        refused = unknown_model(sim.cfg.engine, body.get("model") or sim.cfg.engine.names[0])
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidArgument("'tokens' must be a list of token ids")
        return refused or web.json_response({"prompt": tok.detokenize(ids)})

    return handler


def _error(message: str, kind: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def lora_updating(sim: Sim) -> dict[str, Handler]:
    """POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}, with vLLM's
    answers: a text/plain "Success: ..." or its error. The adapter is served (and listed by /v1/models) at once."""
    loras = sim.cfg.engine.loras  # NOTE: the prefix cache hashes with this very dict

    async def load(req: web.Request) -> web.Response:
        body = await body_of(req)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name in loras:
            return _error(f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput", 400)
        loras[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(req: web.Request) -> web.Response:
        name = (await body_of(req)).get("lora_name")
        if not isinstance(name, str) or not name:
            return _error("either 'lora_name' and 'lora_int_id' needs to be provided.", "InvalidUserInput", 400)
        if loras.pop(name, None) is None:
            return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    return {"/v1/load_lora_adapter": load, "/v1/unload_lora_adapter": unload}
