"""The context-length checks vLLM makes before a completion or chat request runs (`max_model_len`).

vLLM renders every prompt of a request (each prompt of a completion's batch, or the rendered chat) and checks
each against the model's context length before it hands any of them to the engine, so one prompt too long
refuses the whole request with a 400 and nothing runs:

- the output asked for: a chat request's `max_completion_tokens`, else its `max_tokens`; a completion's
  `max_tokens`, 16 when the request does not name it. Over `max_model_len` alone, it is refused before any
  prompt is read.
- each prompt (after `truncate_prompt_tokens`): longer than `max_model_len` less that output, it is refused.
- a request that asks for no output count (a chat request without either field, or `max_tokens: null`) may run
  to `max_model_len` less its prompt's length in vLLM, where a real model stops at its end-of-sequence token
  long before; the stand-in has no end of sequence (every request runs to its output count), so such a request
  runs 16 tokens, as a completion without `max_tokens` does. A prompt of exactly `max_model_len` tokens leaves no
  room for the one token it must compute, and the engine refuses it.

The words are vLLM's; a refusal names its parameter and value as vLLM's validation errors do.
"""

from __future__ import annotations

from typing import Any

from fleet.core.errors import InvalidArgument

COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when the request gives none


def requested_output(body: dict[str, Any], chat: bool) -> tuple[int | None, str]:
    """The output tokens the request asks for (None: it names none) and the field that asked."""
    if chat and body.get("max_completion_tokens") is not None:
        out, param = body["max_completion_tokens"], "max_completion_tokens"
    elif chat:
        out, param = body.get("max_tokens"), "max_tokens"
    else:
        out, param = body.get("max_tokens", COMPLETION_MAX_TOKENS), "max_tokens"
    if out is not None and (isinstance(out, bool) or not isinstance(out, int)):
        raise InvalidArgument(f"{param} must be an integer, got {out!r}")
    return out, param


def check_output(body: dict[str, Any], chat: bool, max_model_len: int) -> int | None:
    """The output tokens asked for, refused (400) when they alone pass the context length."""
    out, param = requested_output(body, chat)
    if out is not None and out > max_model_len:
        raise InvalidArgument(f"{param}={out} cannot be greater than max_model_len=max_total_tokens={max_model_len}. "
                              f"Please request fewer output tokens. (parameter={param}, value={out})")
    return out


def check_prompt(num_tokens: int, out: int | None, max_model_len: int) -> None:
    """Refuse (400) a prompt of `num_tokens` that leaves no room for the output asked for (`out`)."""
    limit = max_model_len - (out or 0)
    if num_tokens > limit:
        raise InvalidArgument(
            f"You passed {num_tokens} input tokens and requested {out or 0} output tokens. However, the model's "
            f"context length is only {max_model_len} tokens, resulting in a maximum input length of {limit} tokens. "
            f"Please reduce the length of the input prompt. (parameter=input_tokens, value={num_tokens})")
    if num_tokens == max_model_len:  # NOTE: the engine's own check: no room for the one token it must compute
        raise InvalidArgument(
            f"The decoder prompt (length {num_tokens}) plus the number of requested output tokens (at least 1) is "
            f"longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is no smaller "
            "than the number of text tokens (prompt + requested output tokens).")


def output_len(out: int | None, num_tokens: int, max_model_len: int) -> int:
    """The output a prompt of `num_tokens` runs to: what was asked, else COMPLETION_MAX_TOKENS within what the context
    leaves. NOTE: not all the context leaves, as vLLM allows: with no end of sequence here, a chat without an output
    count (the demo's, many tests') would run about 8,000 tokens where a real model stops after a few dozen."""
    return out if out is not None else min(COMPLETION_MAX_TOKENS, max_model_len - num_tokens)
