"""What a worker prefills that the ids of its /tokenize leave out. Pure.

The chat's `documents`: vLLM's chat completions hand them to the template over the same key of
`chat_template_kwargs`; its /tokenize has no such field and ignores it, so the proxy asks /tokenize with them in
`chat_template_kwargs` (with_documents).

`truncate_prompt_tokens` (completions and chat completions): vLLM keeps the last k tokens of the prompt: of the
rendered chat, of the prompt's ids, or of a batch's each prompt; the tokenizer of a generating model truncates on
the left, and a request whose `truncation_side` is "right" keeps the first k instead. None truncates nothing; -1
stands for the longest prompt the request allows (the model's context length, from its /v1/models card, less the
output tokens the request asks for: `max_completion_tokens`, else `max_tokens`; a completion's `max_tokens` is 16
when not given). vLLM's /tokenize takes no such field, so the proxy truncates the ids it gets (kept, prefilled).

NOTE: routed by the whole prompt, a truncated request was claimed WARM on the worker holding the untruncated prompt,
for all of it, where the worker reused none (its first block differs), and a resent truncated prompt never matched
the blocks the worker did keep. Without its documents, a chat was claimed WARM on a worker holding the plain
conversation, for all of it, where the worker reused none (tests/controller/proxy/test_proxy_prompt_inputs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

COMPLETION_MAX_TOKENS = 16  # vLLM's max_tokens for a completion that gives none


def with_documents(req: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The /tokenize request with the chat's `documents` in its `chat_template_kwargs`.

    NOTE: vLLM's chat completions hand `documents` to the template over the same key of `chat_template_kwargs`; its
    /tokenize has no such field and ignores it. So the ids were the conversation's without its documents: routed WARM
    on a worker holding the plain conversation, for all of it, where the worker reused none (the documents come first
    in a RAG template). Kwargs that are not an object are the worker's 400 and are left as they are."""
    docs, kw = body.get("documents"), req.get("chat_template_kwargs")
    if docs is None or not (kw is None or isinstance(kw, dict)):
        return req
    return {**req, "chat_template_kwargs": {**(kw or {}), "documents": docs}}


def _max_output_tokens(body: dict[str, Any], chat: bool) -> int:
    if not chat:
        out = body.get("max_tokens", COMPLETION_MAX_TOKENS)
    elif (out := body.get("max_completion_tokens")) is None:
        out = body.get("max_tokens")
    return out if isinstance(out, int) and not isinstance(out, bool) else 0  # NOTE: a bad value is the worker's 400


def kept(body: dict[str, Any], chat: bool, context_len: Callable[[], int | None]) -> int | None:
    """How many of the prompt's tokens the worker keeps: None, all of them; 0, none known (routed by load alone).
    `context_len()`: the model's context length from its card, or None; asked only for -1 (NOTE: it looks over
    every worker's cards, so not on every request).

    None known: -1 where the card gave no context length, and a value that is not an integer of at least -1. NOTE:
    such a value is forwarded as sent, for the worker to take or refuse in its own words (vLLM's validation reads a
    numeric string or a bool as an integer, too)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k < -1:
        return 0
    if k == -1:
        n = context_len()
        return 0 if n is None else max(0, n - _max_output_tokens(body, chat))
    return k


def prefilled(ids: Sequence[int], body: dict[str, Any], k: int | None) -> Sequence[int]:
    """`ids` as the worker prefills them when it keeps `k` of them (kept())."""
    if k is None or k >= len(ids):
        return ids
    if k <= 0:
        return []  # the worker refuses it (an empty prompt), or which tokens are kept is unknown
    return ids[:k] if body.get("truncation_side") == "right" else ids[len(ids) - k:]
