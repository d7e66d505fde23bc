"""The stand-in renders and truncates prompts as vLLM does (fleet/app/testkit/sim_vllm/prompts.py)."""

from __future__ import annotations

import pytest

from fleet.app.testkit.sim_vllm import prompts
from fleet.app.testkit.sim_vllm import tokenizer as tok
from fleet.core.errors import InvalidArgument

MSGS = [{"role": "user", "content": "hello there"}]
DOCS = [{"title": "T", "text": "some text"}]


def test_truncation_keeps_the_last_k_tokens_unless_asked_for_the_first() -> None:
    ids = list(range(100, 120))
    assert prompts.truncated(ids, {}, False, 8192) == ids
    assert prompts.truncated(ids, {"truncate_prompt_tokens": 5}, False, 8192) == ids[-5:]
    assert prompts.truncated(ids, {"truncate_prompt_tokens": 5, "truncation_side": "right"}, False, 8192) == ids[:5]
    assert prompts.truncated(ids, {"truncate_prompt_tokens": 50}, False, 8192) == ids
    # -1: the context length less the output asked for (a completion's max_tokens defaults to 16)
    assert prompts.truncated(ids, {"truncate_prompt_tokens": -1}, False, 26) == ids[-10:]
    assert prompts.truncated(ids, {"truncate_prompt_tokens": -1, "max_completion_tokens": 20}, True, 26) == ids[-6:]
    for bad in ({"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "5"}, {"truncate_prompt_tokens": 20}):
        with pytest.raises(InvalidArgument, match="truncate_prompt_tokens"):
            prompts.truncated(ids, bad, False, 30)


def test_documents_reach_the_template_from_the_field_in_chat_and_from_the_kwargs_in_tokenize() -> None:
    plain, with_docs = tok.apply_chat_template(MSGS), tok.apply_chat_template(MSGS, documents=DOCS)
    assert with_docs[-len(plain):] == plain and len(with_docs) > len(plain)
    assert prompts.chat_ids({"messages": MSGS, "documents": DOCS}) == with_docs
    assert prompts.chat_ids({"messages": MSGS, "documents": DOCS}, tokenize_route=True) == plain  # ignored there
    kw = {"messages": MSGS, "chat_template_kwargs": {"documents": DOCS}}
    assert prompts.chat_ids(kw, tokenize_route=True) == prompts.chat_ids(kw) == with_docs


def test_continue_final_message_leaves_the_last_message_open() -> None:
    open_ = prompts.chat_ids({"messages": MSGS, "continue_final_message": True, "add_generation_prompt": False})
    assert open_ == tok.apply_chat_template(MSGS, add_generation_prompt=False)[:-2]  # no <|im_end|>\n
    with pytest.raises(InvalidArgument, match="Cannot set both"):
        prompts.chat_ids({"messages": MSGS, "continue_final_message": True})
