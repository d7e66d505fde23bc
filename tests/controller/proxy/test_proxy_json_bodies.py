"""Request bodies read as vLLM's server reads them, and the errors of the proxy's own prompt checks.

vLLM parses a body with json.loads on its bytes, which takes a UTF-8 byte order mark and UTF-16 or UTF-32 text; the
proxy refused them ("invalid character (byte 0)"). An empty token-id prompt of a batch was named a shape error
("must be a string, a list of token ids, or a list of those") where the batch was a list of token-id lists.
"""

from __future__ import annotations

import json

from support.proxy_fleet import MODEL, Fleet, served

BODY = {"model": MODEL, "prompt": "hello there, general kenobi", "max_tokens": 2}
JSON = {"Content-Type": "application/json"}


async def _post(fleet: Fleet, data: bytes) -> tuple[int, dict]:
    async with fleet.http.post(fleet.proxy.url + "/v1/completions", data=data,
                               headers={**JSON, **fleet.headers()}) as r:
        return r.status, await r.json()


async def test_a_body_with_a_byte_order_mark_or_in_utf16_is_answered_as_vllm_does(fleet: Fleet) -> None:
    raw = json.dumps(BODY).encode()
    status, plain = await _post(fleet, raw)  # control: the same request as plain UTF-8
    assert status == 200, plain
    for name, data in (("UTF-8 BOM", b"\xef\xbb\xbf" + raw), ("UTF-16", json.dumps(BODY).encode("utf-16")),
                       ("UTF-32-LE", json.dumps(BODY).encode("utf-32-le"))):
        status, doc = await _post(fleet, data)
        print(f"{name}: {status} {str(doc)[:100]}")
        assert status == 200, (name, doc)
        assert [c["text"] for c in doc["choices"]] == [c["text"] for c in plain["choices"]]  # the same prompt ran
        assert doc["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    sent = [r for s in fleet.sims.values() for _, r, _ in s.received.items]  # the bodies the workers got
    assert sent and all(not r.startswith("\ufeff") and '"prompt"' in r for r in sent)  # re-encoded, no mark
    status, doc = await _post(fleet, b"\xef\xbb\xbf" + b'{"model": ')  # still malformed: 400
    assert status == 400 and "not valid JSON" in doc["error"]["message"]


async def test_an_empty_token_id_prompt_is_named_as_such(fleet: Fleet) -> None:
    before = sum(len(served(s, "/v1/completions")) for s in fleet.sims.values())
    for prompt in ([], [[]], [[1, 2], []]):
        status, doc = await _post(fleet, json.dumps({**BODY, "prompt": prompt}).encode())
        err = doc["error"]
        print(f"{prompt}: {status} {err['message']}")
        assert status == 400 and err["param"] == "prompt"
        assert "cannot be empty" in err["message"] and "at least one id" in err["message"], err
    for prompt in ({"a": 1}, [1, "a"]):  # control: a prompt of the wrong shape is still named so
        status, doc = await _post(fleet, json.dumps({**BODY, "prompt": prompt}).encode())
        assert status == 400 and "must be a string, a list of token ids" in doc["error"]["message"]
    assert sum(len(served(s, "/v1/completions")) for s in fleet.sims.values()) == before  # none reached a worker
