"""Assistant quotes of withheld tool results (controller/proxy/judged.py's `quotes`): every place of an assistant
message that the chat template renders and the model wrote, searched for a withheld text and the quote replaced by
its placeholder.

    content                          a string, or its parts' text (each read by its type, as vLLM does)
    tool_calls[k].function.arguments a JSON string: the text as sent, or JSON-escaped (`\\n`, `\\"`, `\\u00e9`, as
                                     json.dumps with or without ensure_ascii writes it); a quote still found in a
                                     decoded string value after that (another encoder's escapes: `\\/`, `\\u003c`)
                                     has the arguments written again by json.dumps with it replaced
    reasoning_content, reasoning     the model's reasoning, which templates render in an agent's tool-calling turns
                                     (Qwen3's `<think>` after the last user message)
    tool_calls[k].function.name      the name of a tool the model called (a withheld tool message's name quoted back)

NOTE: before, content alone was searched: a model that had passed a tool's output on to another tool
(`save_note({"text": <the output>})`) or thought it through handed the withheld bytes back to the worker on the next
turn, the tool message itself withheld. Pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from controller.proxy.errors import ProxyError
from controller.proxy.tool_parts import TEXT_PARTS

MIN_QUOTE = 32
CHUNK = MIN_QUOTE // 2  # any MIN_QUOTE characters of a text cover a whole chunk at a multiple of CHUNK
MAX_QUOTE_SCAN = 256 << 20  # characters of assistant text searched for quotes per request, at most (~0.1 s)
REASONING = ("reasoning_content", "reasoning")
Loc = tuple[str, int | None]  # ("content", None | part), ("arguments" | "name", call), (a REASONING field, None)


def _role(m: Any) -> str | None:
    role = m.get("role") if isinstance(m, dict) else None
    return role.strip().lower() if isinstance(role, str) else None


def _calls(m: dict[str, Any], key: str) -> Iterator[tuple[int, str]]:
    """Each tool call's function `key` ("arguments", "name") that is a string, with the call's index."""
    calls = m.get("tool_calls")
    for k, c in enumerate(calls if isinstance(calls, list) else []):
        f = c.get("function") if isinstance(c, dict) else None
        if isinstance(f, dict) and isinstance(f.get(key), str):
            yield k, f[key]


def _texts(m: Any) -> Iterator[tuple[Loc, str]]:
    """Each string of an assistant message the model wrote, where it sits."""
    if _role(m) != "assistant":
        return
    c = m.get("content")
    if isinstance(c, str):
        yield ("content", None), c
    elif isinstance(c, list):
        yield from ((("content", j), t) for j, p in enumerate(c)
                    if isinstance(t := p.get(_key(p)) if isinstance(p, dict) else p, str))
    yield from ((("arguments", k), a) for k, a in _calls(m, "arguments"))
    yield from ((("name", k), a) for k, a in _calls(m, "name"))
    yield from (((f, None), m[f]) for f in REASONING if isinstance(m.get(f), str))


def _key(part: dict[str, Any]) -> str:
    """The key of a content part's text, by its type as vLLM reads it (`thinking`, `refusal`, ...; else "text").
    NOTE: "text" alone was read: a `thinking` part quoting a withheld result reached the worker."""
    t = part.get("type")
    return TEXT_PARTS[t] if isinstance(t, str) and t in TEXT_PARTS else "text"


def _where(i: int, loc: Loc) -> str:
    field, at = loc
    if field == "content":
        return f"messages[{i}].content" + ("" if at is None else f"[{at}]")
    if field in ("arguments", "name"):
        return f"messages[{i}].tool_calls[{at}].function.{field}"
    return f"messages[{i}].{field}"


def _decoded(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _strings(v: Any) -> Iterator[str]:
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _strings(x)
    elif isinstance(v, list):
        for x in v:
            yield from _strings(x)


def _replaced(v: Any, fn: Any) -> Any:
    if isinstance(v, str):
        return fn(v)
    if isinstance(v, dict):
        return {k: _replaced(x, fn) for k, x in v.items()}
    if isinstance(v, list):
        return [_replaced(x, fn) for x in v]
    return v


def _forms(withheld: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """{a form of a withheld text (itself, JSON-escaped): (the text, its placeholder)}. The placeholders are ASCII
    with nothing JSON escapes, so each stands for itself in every form."""
    forms: dict[str, tuple[str, str]] = {}
    for t, p in withheld.items():
        if len(t) >= MIN_QUOTE:
            for f in (t, json.dumps(t)[1:-1], json.dumps(t, ensure_ascii=False)[1:-1]):
                forms.setdefault(f, (t, p))
    return forms


def _one(loc: Loc, text: str, maybe: list[str], forms: Mapping[str, tuple[str, str]]) -> tuple[str, list[str]]:
    """(`text` with every quote of a form in `maybe` replaced, the withheld texts it quoted)."""
    got: list[str] = []
    new = text
    for f in maybe:
        if f in new:
            got.append(forms[f][0])
            new = new.replace(f, forms[f][1])
    if loc[0] == "arguments" and (v := _decoded(new)) is not None:
        left = [f for f in maybe if forms[f][0] == f and any(f in s for s in _strings(v))]
        if left:  # another encoder's escapes: written again, the quotes replaced
            got += left

            def fn(s: str) -> str:
                for f in left:
                    s = s.replace(f, forms[f][1])
                return s

            new = json.dumps(_replaced(v, fn), ensure_ascii=False)
    return new, list(dict.fromkeys(got))


def _too_deep(i: int, loc: Loc) -> ProxyError:
    """The 400 for tool call arguments nested too deeply to decode and search (about 1,000 levels). NOTE: they were a
    RecursionError, the proxy's 500, whenever the request withheld a tool result (found reading the proxy's JSON
    walkers after a scripts/fuzz_proxy.py run). Not searched as text alone: a quote in them that another encoder
    escapes differently would reach the worker."""
    where = _where(i, loc)
    return ProxyError(400, f"{where} is JSON nested too deeply (about 1,000 levels) for the proxy to search it for "
                           "quotes of the tool results it withholds from this request; send the arguments less deeply "
                           "nested", where)


def _put(m: dict[str, Any], news: Mapping[Loc, str]) -> dict[str, Any]:
    """`m` with the texts at `news` replaced (copied, each list once)."""
    out = dict(m)
    for (field, at), new in news.items():
        if field == "content" and at is None:
            out["content"] = new
        elif field == "content":
            assert at is not None
            parts = out["content"] = out["content"] if out["content"] is not m["content"] else list(m["content"])
            parts[at] = {**parts[at], _key(parts[at]): new} if isinstance(parts[at], dict) else new
        elif field in ("arguments", "name"):
            assert at is not None
            calls = out["tool_calls"] = out["tool_calls"] if out["tool_calls"] is not m["tool_calls"] \
                else list(m["tool_calls"])
            call = calls[at]
            calls[at] = {**call, "function": {**call["function"], field: new}}
        else:
            out[field] = new
    return out


def unquote(
    body: dict[str, Any], chat: bool, withheld: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(`body` with every verbatim quote of a withheld text (key, MIN_QUOTE characters or more) in an assistant
    message replaced by its placeholder (value), where each sat and which text). The places searched: the module
    docstring.

    NOTE: linear in the assistant text, not (withheld texts x assistant text): a quote of MIN_QUOTE or more
    characters covers a whole CHUNK-aligned chunk of the text holding it, so only a withheld text one of whose
    CHUNK windows is such a chunk is searched for. Those searches are bounded (MAX_QUOTE_SCAN, else a 413).
    Before, each of 2,000 withheld texts was searched for in 6 MB of assistant text on the proxy's event loop:
    21 s in which no other tenant's request was served.
    """
    forms = _forms(withheld)
    msgs = body.get("messages") if chat else None
    if not forms or not isinstance(msgs, list):
        return body, []
    texts = [(i, loc, t) for i, m in enumerate(msgs) for loc, t in _texts(m) if len(t) >= MIN_QUOTE]
    read = [t for _, _, t in texts]
    for i, loc, t in texts:
        if loc[0] == "arguments":
            try:
                read += [s for s in _strings(_decoded(t)) if len(s) >= MIN_QUOTE]
            except RecursionError:
                raise _too_deep(i, loc) from None
    chunks = {t[q:q + CHUNK] for t in read for q in range(0, len(t) - CHUNK + 1, CHUNK)}
    # longest first: a withheld text inside a longer one (a piece of a turn withheld joined) must not cut the longer
    # one's quote before it is found
    maybe = sorted((f for f in forms if any(f[o:o + CHUNK] in chunks for o in range(CHUNK))), key=len, reverse=True)
    if (scan := len(maybe) * sum(map(len, read))) > MAX_QUOTE_SCAN:
        raise ProxyError(413, f"the assistant messages may quote {len(maybe)} of this request's withheld tool "
                              f"results; checking them would scan {scan:,} characters, over the proxy's limit of "
                              f"{MAX_QUOTE_SCAN:,}: send fewer withheld results or shorter assistant messages",
                         "messages")
    found: list[tuple[str, str]] = []
    changed: dict[int, dict[Loc, str]] = {}  # message -> {where in it: new text}
    for i, loc, text in texts:
        try:
            new, got = _one(loc, text, maybe, forms)
        except RecursionError:
            raise _too_deep(i, loc) from None
        found += [(_where(i, loc), t) for t in got]
        if got:
            changed.setdefault(i, {})[loc] = new
    out = list(msgs)
    for i, news in changed.items():  # NOTE: each message's lists copied once, however many of their items changed
        out[i] = _put(out[i], news)
    return ({**body, "messages": out} if found else body), found
