"""EncodedBody: the /tokenize request and the forwarded body share one encoding of the messages (pure)."""

from __future__ import annotations

import json
from typing import Any

import msgspec

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


def _same(enc: EncodedBody, obj: dict[str, Any]) -> None:
    got = enc.encode(obj)
    assert got == msgspec.json.encode(obj)  # one encoding of the whole object, byte for byte
    assert json.loads(got) == obj  # and what any JSON parser (the worker's) reads back is the object


def test_the_bytes_are_the_whole_objects_encoding() -> None:
    # The tokenize cache is keyed by these bytes and the worker parses them: any difference from one encoding of
    # the object (a separator, an escape, a float) would change what is cached and what is forwarded.
    for body in _bodies():
        enc = EncodedBody(body)
        _same(enc, {**body, "cache_salt": "salt-of-acme"})
        _same(enc, body)
        if "model" in body:
            for chat in (True, False):
                try:
                    req = tokenize_request(body, chat)
                except Exception:
                    continue
                if isinstance(req, dict):
                    _same(enc, req)


def test_a_shared_value_is_encoded_once_and_a_replaced_one_is_not_reused() -> None:
    body = _bodies()[0]
    enc = EncodedBody(body)
    enc.encode(tokenize_request(body, True))  # type: ignore[arg-type]
    first = enc._done["messages"]
    enc.encode({**body, "cache_salt": "s"})
    assert enc._done["messages"] is first  # the forward reused the tokenize request's encoding
    other = {**body, "messages": [{"role": "user", "content": "a different list under the same key"}]}
    assert enc.encode(other) == msgspec.json.encode(other)  # same key, another object: encoded afresh
