"""A withheld tool result that the model passed on in its own words (another tool call's arguments, its reasoning)
is withheld there too. Real controller (rules), real proxy, a stand-in worker recording what it received.

NOTE: before, only an assistant message's content was searched for quotes: an agent whose model had saved a fetched
page with `save_note({"text": <the page>})`, or thought it through (`reasoning_content`, which Qwen3's template
renders in a tool-calling turn), sent the injection to the worker on the next turn, its tool message withheld.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from support.proxy_fleet import MODEL
from test_proxy_judged import INJECTION, _ref, start_fleet

from controller.proxy.quarantine import PLACEHOLDER
from controller.proxy.quotes import unquote

BENIGN = "Order 4412 shipped on 3 March via DHL, tracking number JD014600006512345678, expected Friday."
# a quote JSON-escapes differently with and without ensure_ascii (the accent, the quotes, the newline)
PAGE = 'Café "Le Nord" menu.\n' + INJECTION


def _turn(page: str, args: str, reasoning: str) -> list[dict[str, Any]]:
    def call(i: str, name: str, a: str) -> dict[str, Any]:
        return {"id": i, "type": "function", "function": {"name": name, "arguments": a}}

    return [{"role": "user", "content": "Fetch the page and save it."},
            {"role": "assistant", "content": "", "tool_calls": [call("c1", "fetch", '{"url": "http://x.example"}')]},
            {"role": "tool", "tool_call_id": "c1", "content": page},
            {"role": "assistant", "content": "", "reasoning_content": reasoning,
             "tool_calls": [call("c2", "save_note", args), call("c3", "log", '{"level": "info"}')]},
            {"role": "tool", "tool_call_id": "c2", "content": "saved"}]


def _sent(fleet: Any) -> dict[str, Any]:
    (sim,) = fleet.sims.values()
    body: dict[str, Any] = json.loads(list(sim.received.items)[-1][1])
    return body


async def test_a_withheld_result_quoted_in_tool_call_arguments_or_reasoning_is_withheld(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path)
    try:
        for args in (json.dumps({"text": PAGE}), json.dumps({"text": PAGE}, ensure_ascii=False),
                     json.dumps({"text": PAGE}).replace("o", "\\u006f")):  # another encoder's escapes
            msgs = _turn(PAGE, args, "The page says: " + PAGE + " I should save it.")
            status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                                      "max_tokens": 4})
            assert status == 200 and h["x-kvfleet-quarantined"] == _ref(PAGE), raw
            where = [q["where"] for q in json.loads(raw)["kvfleet"]["quarantined"]]
            assert where == ["messages[2].content", "messages[3].tool_calls[0].function.arguments",
                             "messages[3].reasoning_content"]
            got = _sent(fleet)["messages"][3]
            placeholder = PLACEHOLDER.format(ref=_ref(PAGE))
            assert json.loads(got["tool_calls"][0]["function"]["arguments"]) == {"text": placeholder}
            assert got["reasoning_content"] == f"The page says: {placeholder} I should save it."
            assert got["tool_calls"][1] == msgs[3]["tool_calls"][1]  # the rest as sent
            assert INJECTION not in json.dumps(_sent(fleet))
        # control: the same turn with a benign page goes through byte for byte
        args = json.dumps({"text": BENIGN})
        msgs = _turn(BENIGN, args, "The page says: " + BENIGN)
        status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert status == 200 and "x-kvfleet-quarantined" not in h
        assert _sent(fleet)["messages"] == msgs
    finally:
        await fleet.stop()


async def test_a_responses_function_call_or_reasoning_quoting_a_withheld_output_is_withheld(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path)
    try:
        items: list[dict[str, Any]] = [
            {"role": "user", "content": "Fetch the page and save it."},
            {"type": "function_call", "call_id": "c1", "name": "fetch", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": PAGE},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "It says " + PAGE}]},
            {"type": "function_call", "call_id": "c2", "name": "save_note", "arguments": json.dumps({"text": PAGE})},
            {"type": "function_call_output", "call_id": "c2", "output": "saved"}]
        status, h, raw = await fleet.post("/v1/responses", {"model": MODEL, "input": items})
        assert status == 200 and _ref(PAGE) in h["x-kvfleet-quarantined"].split(","), raw
        where = {q["where"]: q for q in json.loads(raw)["kvfleet"]["quarantined"]}
        # input[5] too: the two outputs are judged as one turn (the Responses reading keeps them together)
        assert sorted(where) == ["input[2].output", "input[3].content[0]", "input[4].arguments", "input[5].output"]
        assert where["input[4].arguments"]["reasons"][-1] == "quotes:input[2].output"  # the request's own places
        got = _sent(fleet)["input"]
        placeholder = PLACEHOLDER.format(ref=_ref(PAGE))
        assert json.loads(got[4]["arguments"]) == {"text": placeholder}
        assert got[3]["content"] == [{"type": "reasoning_text", "text": "It says " + placeholder}]
        assert got[:2] == items[:2] and INJECTION not in json.dumps(got)
    finally:
        await fleet.stop()


def test_arguments_that_do_not_quote_are_kept_byte_for_byte() -> None:
    withheld = {PAGE: "[w]"}
    args = '{ "text" :"' + BENIGN + '",\n  "n": 1 }'
    body = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": args}}]}]}
    assert unquote(body, True, withheld) == (body, [])
    body = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "not json " + PAGE}}]}]}
    out, found = unquote(body, True, withheld)  # not JSON: the quote as it stands
    assert out["messages"][0]["tool_calls"][0]["function"]["arguments"] == "not json [w]" and len(found) == 1


async def test_a_quote_in_an_assistant_part_of_any_text_type_is_withheld(tmp_path: Path) -> None:
    """vLLM renders an assistant's `thinking` and `refusal` parts as text, read from their own keys. NOTE: the
    quote search read every part's "text": a thinking part quoting the withheld page reached the worker."""
    fleet = await start_fleet(tmp_path)
    try:
        parts = [{"type": "thinking", "thinking": "The page says: " + PAGE}, {"type": "refusal", "refusal": PAGE},
                 {"type": "text", "text": "Saved."}]
        msgs = [*_turn(PAGE, "{}", "")[:3], {"role": "assistant", "content": parts}]
        status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert status == 200 and h["x-kvfleet-quarantined"] == _ref(PAGE), raw
        where = [q["where"] for q in json.loads(raw)["kvfleet"]["quarantined"]]
        assert where == ["messages[2].content", "messages[3].content[0]", "messages[3].content[1]"]
        placeholder = PLACEHOLDER.format(ref=_ref(PAGE))
        assert _sent(fleet)["messages"][3]["content"] == [
            {"type": "thinking", "thinking": "The page says: " + placeholder},
            {"type": "refusal", "refusal": placeholder}, parts[2]]
        assert INJECTION not in json.dumps(_sent(fleet))
    finally:
        await fleet.stop()


async def test_a_quote_of_a_turn_withheld_joined_or_of_a_withheld_name_is_withheld(tmp_path: Path) -> None:
    """A turn withheld only as a whole (each piece shorter than a quote), quoted back by the assistant as the proxy
    judged it; and a withheld tool name, quoted in the assistant's content or as the name of a tool it called. NOTE:
    both reached the worker whole: the quote search was given the pieces alone (each under 32 characters) and no
    names (review finding). Control: the same assistant text without the quotes goes through as sent."""
    from test_proxy_judged import NAME, PIECES, _parallel

    from controller.proxy.judged import JOIN

    fleet = await start_fleet(tmp_path)
    try:
        said = "The pages said: " + JOIN.join(PIECES)
        msgs = [*_parallel(PIECES), {"role": "assistant", "content": said}, {"role": "user", "content": "Go on."}]
        status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert status == 200, raw
        quoted = [q for q in json.loads(raw)["kvfleet"]["quarantined"] if q["where"] == "messages[10].content"]
        assert quoted and quoted[0]["ref"] == _ref(JOIN.join(PIECES)), raw
        got = _sent(fleet)["messages"][10]["content"]
        assert got == "The pages said: " + PLACEHOLDER.format(ref=_ref(JOIN.join(PIECES))), got

        call = {"id": "c9", "type": "function", "function": {"name": NAME, "arguments": "{}"}}
        msgs = [{"role": "user", "content": "Look it up."},
                {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "search",
                                                                                           "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c9", "name": NAME, "content": "no results"},
                {"role": "assistant", "content": "I called the tool named " + NAME, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c9", "content": "done"}]
        status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert status == 200, raw
        where = {q["where"] for q in json.loads(raw)["kvfleet"]["quarantined"]}
        assert {"messages[2].name", "messages[3].content", "messages[3].tool_calls[0].function.name"} <= where, where
        assert NAME not in json.dumps(_sent(fleet))
        # control: no quote, nothing changed in the assistant's message
        msgs[3] = {"role": "assistant", "content": "I called the tool.", "tool_calls": [
            {**call, "function": {"name": "lookup", "arguments": "{}"}}]}
        status, h, raw = await fleet.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 4})
        assert status == 200 and _sent(fleet)["messages"][3] == msgs[3]
    finally:
        await fleet.stop()
