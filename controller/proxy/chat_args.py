"""The arguments a local Hugging Face tokenizer's `apply_chat_template` gets for a /tokenize chat request. Pure.

vLLM merges the request's `chat_template_kwargs` with the request's own chat fields (`add_generation_prompt`,
default true; `continue_final_message`, default false; `chat_template` and `tools` when given): a field the request
sets wins over the same key in the kwargs, and a field left out or null leaves the kwargs' value. `tokenize` in
the kwargs is dropped (vLLM decides that itself; the proxy always tokenizes). Kwargs that are not an object are a 400.

NOTE: the kwargs were passed beside the fields, so a key in both (`add_generation_prompt`, `tools`, ...) made the
call a TypeError ("multiple values for keyword argument"): the chat got the proxy's 500 where the workers' /tokenize
answers (tests/controller/proxy/test_proxy_hf_tokenizer.py).
"""

from __future__ import annotations

from typing import Any

from controller.proxy.errors import ProxyError
from fleet.core.lax import lax_bool

# the request's own fields and their values when left out (None: no value of its own)
OWN_FIELDS: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False, "chat_template": None,
                              "tools": None}


def chat_template_args(req: dict[str, Any]) -> dict[str, Any]:
    """`apply_chat_template`'s keyword arguments (all but the messages and `tokenize`) for a /tokenize chat `req`."""
    kw = req.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):  # NOTE: was a TypeError too (a 500); vLLM's own validation answers 400
        raise ProxyError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs")
    own = {k: v for k, default in OWN_FIELDS.items() if (v := req.get(k, default)) is not None}
    return {k: v for k, v in {**kw, **own}.items() if k != "tokenize"}


def add_special_tokens(req: dict[str, Any], chat: bool) -> bool:
    """Whether vLLM adds the tokenizer's special tokens (a BOS) when it tokenizes `req`'s text (a chat's rendered
    template, or a prompt): the request's `add_special_tokens` as vLLM's models read a bool; left out, false for a
    chat (its template writes them) and true for a prompt. A value vLLM refuses is its 400: the default here.

    NOTE: a chat's flag was ignored (apply_chat_template tokenizes with false), so a chat sent with true had one id
    fewer than the worker prefilled; a prompt's "false" (a string) was taken as true.
    """
    flag = lax_bool(req.get("add_special_tokens"))
    return not chat if flag is None else flag
