"""EncodedBody: the /tokenize request and the forwarded body share one encoding of the messages (pure)."""

from __future__ import annotations

import json
from typing import Any

from controller.proxy.tokenize import EncodedBody, tokenize_request


def _bodies() -> list[dict[str, Any]]:
    msgs = [{"role": "system", "content": "Ünïcode ✓ \U0001f600 \"quoted\" \\ back\nslash"},
            {"role": "user", "content": [{"type": "text", "text": "parts"}], "name": None}]
    return [
        {"model": "m", "messages": msgs, "temperature": 0.1, "max_tokens": 16, "stream": True,
         "stop": ["\n\n"], "logit_bias": {"50256": -100}, "top_p": 1e-07, "n": 1, "x": {"": []}},
        {"model": "m", "prompt": ["first", "second"], "add_special_tokens": False},
        {"model": "m", "prompt": "text", "\"odd\" key ✓": 1.5},
        {},
    ]


def test_the_bytes_are_json_dumps_bytes() -> None:
    # The tokenize cache is keyed by these bytes and the worker parses them: any difference from json.dumps (a
    # separator, an escape, a float) would change what is cached and what is forwarded.
    for body in _bodies():
        enc = EncodedBody(body)
        fwd = {**body, "cache_salt": "salt-of-acme"}
        assert enc.encode(fwd) == json.dumps(fwd).encode()
        assert enc.encode(body) == json.dumps(body).encode()
        if "model" in body:
            for chat in (True, False):
                try:
                    req = tokenize_request(body, chat)
                except Exception:
                    continue
                if isinstance(req, dict):
                    assert enc.encode(req) == json.dumps(req).encode()


def test_a_shared_value_is_encoded_once_and_a_replaced_one_is_not_reused() -> None:
    body = _bodies()[0]
    enc = EncodedBody(body)
    enc.encode(tokenize_request(body, True))  # type: ignore[arg-type]
    first = enc._done["messages"]
    enc.encode({**body, "cache_salt": "s"})
    assert enc._done["messages"] is first  # the forward reused the tokenize request's encoding
    other = {**body, "messages": [{"role": "user", "content": "a different list under the same key"}]}
    assert enc.encode(other) == json.dumps(other).encode()  # same key, another object: encoded afresh
