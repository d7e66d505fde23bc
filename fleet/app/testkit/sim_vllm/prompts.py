"""What the stand-in prefills for a completion or chat request, and what its /tokenize renders, as vLLM does.

Chat rendering. The chat completions request hands its template `add_generation_prompt` (default true),
`continue_final_message` (default false) and `documents` (when given) on top of the request's
`chat_template_kwargs`: a field the request sets wins over the same key in the kwargs. vLLM's /tokenize takes
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` but has no `documents` field (an
unknown field is ignored there), so a /tokenize request reaches the template's documents only through
`chat_template_kwargs`. Setting both `add_generation_prompt` and `continue_final_message` is a 400 on both routes.

Truncation (`truncate_prompt_tokens`, completions and chat completions). vLLM keeps the last k tokens of the
prompt (of the rendered chat, or of the prompt's ids), since a generating model's tokenizer truncates on the
left; a request whose `truncation_side` is "right" keeps the first k. None (or absent) truncates nothing; -1
stands for the longest prompt the request allows: the model's context length less the output tokens asked for
(`max_completion_tokens`, else `max_tokens`; a completion's `max_tokens` defaults to 16). A k over that, or a
value that is not an integer of at least -1, is a 400. /tokenize never truncates.

Batches (`completion_prompts`). A completion's `prompt` is one prompt (a string, or a list of token ids) or a batch of
them (a list of strings, or a list of token-id lists; an id is what pydantic's lax mode reads as an int: 1000.0,
"1000", true); vLLM runs each prompt of a batch as its own engine request,
and each of those `n` times (`num_choices`). Anything else (an empty list, a list mixing the shapes) is a 400.
"""

from __future__ import annotations

from typing import Any

from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.app.testkit.sim_vllm.context import requested_output
from fleet.core.errors import InvalidArgument
from fleet.core.lax import lax_token_ids

SHAPES = ("prompt must be a string, a list of token ids, a non-empty list of strings or a non-empty list of token-id "
          "lists (not a mix)")


def _ids(p: list[Any], where: str) -> list[int]:
    try:
        return lax_token_ids(p)
    except ValueError as e:
        raise InvalidArgument(f"{SHAPES}: {where}{e}") from None


def completion_prompts(p: Any) -> list[list[int]]:
    """The ids of each prompt a completion's `prompt` holds, in order (one, or a batch's), read as vLLM's union of
    shapes reads it (pydantic's lax mode: 1000.0, "1000" and true are token ids; fleet.core.lax.lax_token_ids)."""
    if isinstance(p, str):
        return [tok.tokenize(p)]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [tok.tokenize(x) for x in p]
        if all(isinstance(x, list) for x in p):
            return [_ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
        return [_ids(p, "prompt")]
    raise InvalidArgument(SHAPES)


def num_choices(body: dict[str, Any]) -> int:
    """`n`, the sequences run for each prompt (default 1); vLLM's own words for one under 1."""
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgument(f"n must be an integer, got {n!r}")
    if n < 1:
        raise InvalidArgument(f"n must be at least 1, got {n}.")
    return n


def chat_ids(body: dict[str, Any], *, tokenize_route: bool = False) -> list[int]:
    """The rendered chat's ids for a chat completions body (or, `tokenize_route`, for a /tokenize body)."""
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise InvalidArgument("chat_template_kwargs must be an object")
    gen = body.get("add_generation_prompt", True)
    cont = body.get("continue_final_message", False)
    docs = kw.get("documents") if tokenize_route or body.get("documents") is None else body["documents"]
    if gen and cont:
        raise InvalidArgument("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    return tok.apply_chat_template(body["messages"], add_generation_prompt=bool(gen),
                                   continue_final_message=bool(cont), documents=docs)


def max_input_tokens(body: dict[str, Any], chat: bool, max_model_len: int) -> int:
    """The longest prompt the request allows: the context length less the output tokens it asks for."""
    return max_model_len - (requested_output(body, chat)[0] or 0)


def truncated(ids: list[int], body: dict[str, Any], chat: bool, max_model_len: int) -> list[int]:
    """`ids` as the engine prefills them under the request's `truncate_prompt_tokens` (and `truncation_side`)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        raise InvalidArgument(f"truncate_prompt_tokens must be an integer of at least -1, got {k!r}")
    limit = max_input_tokens(body, chat, max_model_len)
    if k > limit:
        raise InvalidArgument(f"truncate_prompt_tokens={k} cannot be greater than max_model_len - max_tokens = "
                              f"{limit}. Please request a smaller truncation size.")
    k = limit if k == -1 else k
    if k >= len(ids):
        return ids
    return ids[:k] if body.get("truncation_side") == "right" else ids[len(ids) - k:]
