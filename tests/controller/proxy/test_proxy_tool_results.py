"""Where the proxy finds tool results, and how it rewrites them (pure: no fleet)."""

from __future__ import annotations

from typing import Any

from controller.proxy.quarantine import rewrite, tool_results


def _upper(text: str, where: str) -> str | None:
    return None if "keep" in text else f"<{where}>"


def test_chat_tool_and_function_messages_string_or_parts() -> None:
    parts: list[Any] = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
                        {"type": "text", "text": "b"}]
    body = {"model": "m", "messages": [
        {"role": "user", "content": "not a tool result"},
        {"role": "tool", "tool_call_id": "1", "content": "weather"},
        {"role": "function", "name": "f", "content": parts},
        {"role": "tool", "tool_call_id": "2", "content": "keep me"},
        {"role": "tool", "tool_call_id": "3", "content": None},
    ]}
    assert tool_results(body, chat=True) == [("messages[1].content", "weather"), ("messages[2].content", "ab"),
                                             ("messages[3].content", "keep me")]
    out = rewrite(body, True, _upper)
    assert [m["content"] for m in out["messages"]] == [
        "not a tool result", "<messages[1].content>", "<messages[2].content>", "keep me", None]
    assert out["messages"][1]["tool_call_id"] == "1"  # the rest of the message is kept
    assert body["messages"][1]["content"] == "weather" and body["messages"][2]["content"] is parts  # not mutated


def test_completions_envelope_in_string_and_batched_prompts() -> None:
    p = "sys <tool_result>one</tool_result> mid <tool_result>keep\ntwo</tool_result> end"
    assert tool_results({"prompt": p}, chat=False) == [("prompt@17", "one"), ("prompt@52", "keep\ntwo")]
    assert rewrite({"prompt": p}, False, _upper)["prompt"] == (
        "sys <tool_result><prompt@17></tool_result> mid <tool_result>keep\ntwo</tool_result> end")
    batched = {"prompt": ["<tool_result>x</tool_result>", "no tools"]}
    assert rewrite(batched, False, _upper)["prompt"] == ["<tool_result><prompt[0]@13></tool_result>", "no tools"]
    ids = {"prompt": [1, 2, 3]}
    assert tool_results(ids, chat=False) == [] and rewrite(ids, False, _upper) is ids  # ids: not inspectable
