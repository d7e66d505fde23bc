"""Bad input gets an OpenAI-style error body with the right status, touches no worker, and the proxy stays up."""

from __future__ import annotations

import json

from support.proxy_fleet import MODEL, Fleet, served

GOOD = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
JSON = {"Content-Type": "application/json"}


def _cases(fleet: Fleet) -> list[tuple[str, str, str, bytes, dict[str, str], int]]:
    a, b = fleet.headers("a"), fleet.headers("b")
    big = json.dumps({"model": MODEL, "prompt": "x" * (fleet.proxy.cfg.max_body_bytes + 1)}).encode()
    chat = "/v1/chat/completions"
    return [
        ("malformed JSON", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": ', a, 400),
        ("not UTF-8", "POST", "/v1/completions", b"\xff\xfe{}", a, 400),
        ("JSON but not an object", "POST", "/v1/completions", b"[1, 2, 3]", a, 400),
        ("model not a string", "POST", "/v1/completions", b'{"model": 5, "prompt": "hi"}', a, 400),
        ("stream not what vLLM reads as a bool", "POST", "/v1/completions",
         b'{"model": "sim-model", "prompt": "hi", "stream": "maybe"}', a, 400),
        ("prompt of wrong type", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": {"a": 1}}', a, 400),
        ("messages not a list", "POST", chat, b'{"model": "sim-model", "messages": "hi"}', a, 400),
        # (a message without content is empty text, as vLLM renders it: OpenAI's tool-calling turn has none)
        ("message content neither text nor parts", "POST", chat,
         b'{"model": "sim-model", "messages": [{"role": "user", "content": 7}]}', a, 400),
        ("NaN (not JSON; was forwarded)", "POST", "/v1/completions",
         b'{"model": "sim-model", "prompt": "hi", "temperature": NaN}', a, 400),
        ("Infinity (not JSON)", "POST", chat,
         b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', a, 400),
        ("a number past a double's range (was read as infinity and forwarded)", "POST", "/v1/completions",
         b'{"model": "sim-model", "prompt": "hi", "temperature": 1e400}', a, 400),
        ("a lone surrogate escape", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": "\\ud800"}', a, 400),
        ("deeply nested JSON (was a 500)", "POST", "/v1/completions",
         b'{"model": "sim-model", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", a, 400),
        # (a bool, a whole float or a string of digits is an id to vLLM: test_proxy_lax_token_ids.py)
        ("token ids with a fraction", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": [1, 2.5]}', a, 400),
        ("token ids with a word", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": [[1, "two"]]}', a, 400),
        ("token ids out of range", "POST", "/v1/completions", b'{"model": "sim-model", "prompt": [1, -5]}', a, 400),
        ("unknown model", "POST", "/v1/completions", b'{"model": "gpt-17", "prompt": "hi"}', a, 404),
        ("oversized body", "POST", "/v1/completions", big, a, 413),
        ("missing token", "POST", "/v1/completions", GOOD, {}, 401),
        ("wrong token", "POST", "/v1/completions", GOOD, {"Authorization": "Bearer kvf_not-a-token"}, 401),
        ("malformed Authorization", "POST", "/v1/completions", GOOD, {"Authorization": "Basic dXNlcg=="}, 401),
        ("missing token on /v1/models", "GET", "/v1/models", b"", {}, 401),
        ("tenant token on the operator view", "GET", "/v1/workers", b"", b, 403),
        ("unknown path", "GET", "/v1/audio/transcriptions", b"", a, 404),
        ("wrong method", "GET", "/v1/completions", b"", a, 405),
    ]


async def test_bad_input_table(fleet: Fleet) -> None:
    before = {n: len(served(s, "/v1/completions")) + len(served(s, "/v1/chat/completions"))
              for n, s in fleet.sims.items()}
    for name, method, path, data, headers, want in _cases(fleet):
        async with fleet.http.request(method, fleet.proxy.url + path, data=data, headers={**JSON, **headers}) as r:
            status, body = r.status, await r.json()
        err = body["error"]
        print(f"{name:36s} -> {status} {err['type']}: {err['message'][:90]}")
        assert status == want, (name, status, body)
        assert err["code"] == want and isinstance(err["message"], str) and err["message"] and err["type"]
        if want == 413:  # what to change, not only the limit (it named the limit only)
            assert "send a smaller one" in err["message"] and "--max-body-bytes" in err["message"]
        if name.startswith("missing token"):  # HTTP advice, not the controller's gRPC one (it named FleetClient)
            assert "send 'Authorization: Bearer <token>'" in err["message"] and "FleetClient" not in err["message"]
    async def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(9):
            yield b" " * (1 << 20)

    async with fleet.http.post(fleet.proxy.url + "/v1/completions", data=chunks(), headers=fleet.headers()) as r:
        assert r.status == 413 and (err := (await r.json())["error"])["code"] == 413
        assert "send a smaller one" in err["message"] and "--max-body-bytes" in err["message"]
    after = {n: len(served(s, "/v1/completions")) + len(served(s, "/v1/chat/completions"))
             for n, s in fleet.sims.items()}
    assert after == before  # no bad request reached a worker's completion endpoint
    # the proxy is still up and serving
    async with fleet.http.post(fleet.proxy.url + "/v1/completions", data=GOOD, headers={**JSON, **fleet.headers()}) as r:
        assert r.status == 200 and (await r.json())["choices"]
    async with fleet.http.get(fleet.proxy.url + "/v1/workers", headers=fleet.headers("op")) as r:
        assert r.status == 200 and len((await r.json())["data"]) == 3  # control: the operator may list them


async def test_what_vllm_takes_without_a_model_or_with_a_null_stream_is_served(fleet: Fleet) -> None:
    """NOTE: a request with no model, a null model or a null stream was a 400 here; vLLM serves it (its one model;
    a null stream is not a stream). The fleet here serves one model, so that is the one the worker is asked for."""
    for body in ({"prompt": "hello", "max_tokens": 1}, {"model": None, "prompt": "hello", "max_tokens": 1},
                 {"model": "", "prompt": "hello", "max_tokens": 1},
                 {"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": None},
                 {"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": "false"},
                 {"model": MODEL, "prompt": "hello", "max_tokens": 1, "stream": 0.0}):
        async with fleet.http.post(fleet.proxy.url + "/v1/completions", json=body, headers=fleet.headers()) as r:
            status, doc = r.status, await r.json()
        assert status == 200 and doc["choices"], (body, status, doc)
        assert doc.get("model") in (None, MODEL)


def test_stream_is_read_as_vllms_request_models_read_a_bool() -> None:
    """The proxy reads `stream` as pydantic's lax mode does (vLLM's request models): the same answer, or the same
    refusal, for each value. NOTE: "true", "yes" and 1.0 were the proxy's 400 (review finding)."""
    from pydantic import TypeAdapter, ValidationError

    from fleet.core.lax import lax_bool

    vllm = TypeAdapter(bool | None)
    values = [True, False, 0, 1, 2, -1, 0.0, 1.0, 0.5, "true", "True", "TRUE", " true", "yes", "on", "1", "t", "y",
              "false", "off", "no", "0", "f", "n", "", "maybe", "1.0", [], {}, [True], None]
    for v in values:
        try:
            want: bool | None | str = vllm.validate_python(v)
        except ValidationError:
            want = "refused"
        got = lax_bool(v)
        assert (got if got is not None or v is None else "refused") == want, (v, got, want)
