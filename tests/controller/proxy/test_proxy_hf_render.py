"""`--tokenizer hf:PATH` renders a chat as vLLM does before its chat template runs (controller/proxy/conversation.py):
the local ids are the worker's /tokenize ids for the chats the parity probes do not spell out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.hf_tokenizer import build_hf_tokenizer
from support.proxy_fleet import MODEL, served, start_fleet, until

from controller.proxy import tokenize
from controller.proxy.conversation import conversation
from controller.proxy.tokenize import PROBES
from fleet.app.testkit.sim_vllm import tokenizer as simtok

TEXT = " ".join(f"word{i} is here." for i in range(60))  # 240 ids: 15 blocks of 16
PARTS = [{"role": "system", "content": [{"type": "text", "text": TEXT}, "Be brief."]},
         {"role": "user", "content": [{"type": "input_text", "text": "Plan a trip."}]}]


async def test_a_chat_of_text_parts_is_tokenized_as_the_workers_do(tmp_path: Path) -> None:
    """Content given as a list of text parts: vLLM joins their texts with "\\n" before templating, and so does the
    local tokenizer, so a repeat of the chat is WARM. Before, the template got the list itself and rendered its
    Python repr ("[{'type': 'text', ..."): 299 ids where the worker computes 260 (they differ from the 4th), so a
    repeat was routed COLD, away from the worker holding 256 of its tokens."""
    hf = build_hf_tokenizer(tmp_path / "tok", [TEXT, "Be brief.", "Plan a trip."])
    fleet = await start_fleet(tmp_path, num_workers=2, tokenizer=f"hf:{hf}")
    try:
        sim = next(iter(fleet.sims.values()))
        remote = await fleet.proxy.tokenizer._post_tokenize(sim.url, json.dumps(
            {"model": MODEL, "messages": PARTS}).encode())
        local = fleet.proxy.tokenizer._hf_ids({"messages": PARTS})
        print("local ids == the worker's /tokenize ids:", local == remote, len(local or ()), len(remote))
        assert local == remote == simtok.apply_chat_template(PARTS)
        rows = []
        for _ in range(2):
            status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": PARTS,
                                                                       "max_tokens": 2})
            assert status == 200, raw
            usage = json.loads(raw)["usage"]
            rows.append((h["x-kvfleet-verdict"], int(h["x-kvfleet-matched-tokens"]),
                         usage["prompt_tokens_details"]["cached_tokens"]))
            await until(lambda w=h["x-kvfleet-worker"]: fleet.blocks_known(w),
                        lambda n, p=usage["prompt_tokens"]: n >= p // 16)
        tokenize_calls = sum(len(served(s, "/tokenize")) for s in fleet.sims.values())
        print("turns (verdict, matched, worker-cached):", rows, "| worker /tokenize calls:", tokenize_calls)
        assert fleet.proxy.tokenizer.parity == {MODEL: True}
        assert tokenize_calls == len(PROBES) + 1  # the probes and the comparison above: the chats were local
        assert rows == [("COLD", 0, 0), ("WARM", 256, 256)]
    finally:
        await fleet.stop()


async def test_the_probes_refuse_a_local_render_of_parts_that_differs(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A local render that leaves the parts as a list (the code before) no longer passes parity: a probe is a chat
    of parts. Before, every probe was plain text and such a tokenizer was trusted."""
    monkeypatch.setattr(tokenize, "conversation", lambda msgs: msgs, raising=False)
    hf = build_hf_tokenizer(tmp_path / "tok", ["Plan a trip."])
    fleet = await start_fleet(tmp_path, num_workers=1, tokenizer=f"hf:{hf}")
    try:
        status, _, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Plan a trip."}]})
        print("parity of a render that keeps the parts as a list:", fleet.proxy.tokenizer.parity)
        assert status == 200, raw
        assert fleet.proxy.tokenizer.parity == {MODEL: False}
    finally:
        await fleet.stop()


def test_conversation_renders_content_and_keeps_the_fields_vllm_keeps() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
    msgs = [{"role": "system", "content": ["a", {"type": "refusal", "refusal": "b"}, {"type": "text", "text": None},
                                           {"type": "thinking", "thinking": "c"}], "x": 1},
            {"role": "assistant", "content": None, "tool_calls": [call], "name": "bot", "tool_call_id": "t"},
            {"role": "tool", "content": [{"type": "text", "text": "42"}], "tool_call_id": "c1", "name": 7}]
    assert conversation(msgs) == [
        {"role": "system", "content": "a\nb\nc"},
        {"role": "assistant", "content": "", "tool_calls": [call], "name": "bot"},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert conversation([{"role": "user", "content": ["look", image]}]) is None  # the workers' /tokenize
    assert conversation([{"role": "user", "content": [{"type": "text", "text": 5}]}]) is None


def bos_tokenizer() -> tokenize.Tokenizer:
    """A proxy Tokenizer whose local tokenizer adds a BOS (id 1) when asked to, with a template that writes each
    tool call's arguments as JSON: what the special-tokens and tool-call renders depend on."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "<bos>": 1}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(" ", "removed")
    tk.add_special_tokens([AddedToken("<bos>", special=True)])
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", bos_token="<bos>")
    fast.chat_template = ("{% for m in messages %}<s_{{ m.role }}>{{ m.content }}{% for tc in m.tool_calls or [] %}"
                          "<call>{{ tc.function.name }} {{ tc.function.arguments | tojson }}{% endfor %}{% endfor %}"
                          "{% if add_generation_prompt %}<s_assistant>{% endif %}")
    tok = tokenize.Tokenizer.__new__(tokenize.Tokenizer)
    tok._hf = fast
    return tok


def test_a_chats_add_special_tokens_is_applied_as_vllm_applies_it() -> None:
    """vLLM renders the chat, then tokenizes the text with the request's `add_special_tokens` (default false for a
    chat, true for a prompt; read as its models read a bool). Before, a chat's flag was ignored: [0] where vLLM
    prefills [1, 0] for true; and a prompt's "false" (a string) was taken as true."""
    tok, msgs = bos_tokenizer(), [{"role": "user", "content": "hi"}]
    text = tok._hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    got = {flag: tok._hf_ids({"messages": msgs, **({} if flag is None else {"add_special_tokens": flag})})
           for flag in (None, False, True, "yes", "off")}
    print("local ids by add_special_tokens:", got)
    assert got == {None: [0], False: [0], True: [1, 0], "yes": [1, 0], "off": [0]}
    assert got[True] == tok._hf(text, add_special_tokens=True)["input_ids"]  # vLLM's own call
    assert tok._hf_ids({"prompt": "hi"}) == [1, 0]
    assert tok._hf_ids({"prompt": "hi", "add_special_tokens": "false"}) == [0]


def test_tool_call_arguments_reach_the_template_decoded_as_vllm_decodes_them() -> None:
    """vLLM json.loads each assistant tool call's `arguments` before the template runs ({} when it is not JSON) and
    drops an empty `tool_calls`. Before, the template got the JSON string: `tojson` wrote it quoted and escaped,
    "{\\"city\\": \\"Paris\\"}" where vLLM writes {"city": "Paris"}."""
    tok = bos_tokenizer()
    call = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Paris"}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "put", "arguments": "{city"}}
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call, bad]},
            {"role": "assistant", "content": "ok", "tool_calls": []}]
    sent = json.dumps(msgs)
    text = tok._hf.apply_chat_template(conversation(msgs), tokenize=False, add_generation_prompt=False)
    print("local rendering:", text)
    assert text == '<s_user>weather?<s_assistant><call>get {"city": "Paris"}<call>put {}<s_assistant>ok'
    assert "tool_calls" not in (conversation(msgs) or [])[2]
    assert json.dumps(msgs) == sent  # the request's own messages are forwarded as sent
