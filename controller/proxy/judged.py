"""What the proxy has judged beyond each tool result alone: what the model reads (issue #28).

    names      a tool message's `name` (chat templates may render it into the prompt): judged as a text of
               its own, "messages[i].name"; quarantined, it is replaced by NAME_PLACEHOLDER
    turns      the tool results of one turn, judged together: a run of consecutive tool messages (chat; a
               message of another role ends the run) or of <tool_result> spans with only whitespace between
               them (one prompt string). The members' texts as the client sent them, joined in order with
               JOIN (not with the pieces withheld alone as their placeholders: a piece caught alone would
               otherwise cut the phrase the whole is caught by, and the rest would reach the model);
               quarantined, every member not already withheld gets the placeholder naming the joined ref. A run longer than
               MAX_JOINED bytes is judged in windows of at most that many bytes, each overlapping the last
               by one member; a member larger than MAX_JOINED is judged alone only
    quotes     an assistant message's content that contains a withheld tool result's text verbatim (at least
               MIN_QUOTE characters): the quote is replaced by that result's placeholder, so the model is not
               handed the withheld bytes back through its own earlier answer. Assistant content is otherwise
               not judged: the client writes it as freely as a user message (which is not judged either), and
               judging the model's own prose would cost CPU on every turn and withhold answers that discuss
               attacks (docs/quarantine_path.md)

Pure functions over the request body; controller/proxy/quarantine.py calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from controller.proxy.errors import ProxyError
from controller.proxy.tool_parts import ENVELOPE, envelope_parts

JOIN = "\n"
NAME_PLACEHOLDER = "[tool name withheld: quarantined by kvfleet]"
MIN_QUOTE = 32
CHUNK = MIN_QUOTE // 2  # any MIN_QUOTE characters of a text cover a whole chunk at a multiple of CHUNK
MAX_QUOTE_SCAN = 256 << 20  # characters of assistant text searched for quotes per request, at most (~0.1 s)
MAX_JOINED = 1 << 20


def _role(m: Any) -> str | None:
    role = m.get("role") if isinstance(m, dict) else None
    return role.strip().lower() if isinstance(role, str) else None


def tool_names(body: dict[str, Any], chat: bool, roles: tuple[str, ...]) -> list[tuple[str, str]]:
    """("messages[i].name", name) of every tool message (a role in `roles`) with a non-empty string name."""
    msgs = body.get("messages") if chat else None
    return [
        (f"messages[{i}].name", m["name"])
        for i, m in enumerate(msgs if isinstance(msgs, list) else [])
        if _role(m) in roles and isinstance(m.get("name"), str) and m["name"]
    ]


def rename(body: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`body` with messages[i].name replaced where `names` has "messages[i].name" (not mutated)."""
    if not names:
        return body
    msgs = list(body["messages"])
    for where, new in names.items():
        i = int(where[len("messages[") : where.index("]")])
        msgs[i] = {**msgs[i], "name": new}
    return {**body, "messages": msgs}


def turns(body: dict[str, Any], chat: bool, roles: tuple[str, ...]) -> list[list[str]]:
    """The `where`s of each turn with two tool results or more, in order (see the module docstring)."""
    runs: list[list[str]] = [[]]
    if chat:
        msgs = body.get("messages")
        for i, m in enumerate(msgs if isinstance(msgs, list) else []):
            if _role(m) not in roles:
                runs.append([])
            elif m.get("content") is not None:
                runs[-1].append(f"messages[{i}].content")
    else:
        p = body.get("prompt")
        prompts = (
            [("prompt", p)]
            if isinstance(p, str)
            else [(f"prompt[{i}]", x) for i, x in enumerate(p) if isinstance(x, str)]
            if isinstance(p, list)
            else []
        )
        for where, text in prompts:
            runs.append([])
            end = None
            for m in ENVELOPE.finditer(text):
                if end is not None and text[end : m.start()].strip():
                    runs.append([])
                runs[-1].extend(f"{where}@{at}" for at, _ in envelope_parts(m))
                end = m.end()
    return [r for r in runs if len(r) > 1]


def windows(run: list[str], size: Callable[[str], int], limit: int = MAX_JOINED) -> list[list[str]]:
    """`run` cut into windows whose members' sizes add up to at most `limit`, each window starting with the
    previous one's last member; a member larger than `limit` is in none (it is judged alone)."""
    out: list[list[str]] = [[]]
    total = 0
    for w in run:
        n = size(w)
        if n > limit:
            out.append([])
            total = 0
            continue
        if out[-1] and total + n > limit:
            out.append([out[-1][-1]])
            total = size(out[-1][0])
        out[-1].append(w)
        total += n
    return [x for x in out if len(x) > 1]


def unquote(
    body: dict[str, Any], chat: bool, withheld: Mapping[str, str]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(`body` with every verbatim quote of a withheld text (key, MIN_QUOTE characters or more) in an assistant
    message's string content or text parts replaced by its placeholder (value), where each sat and which text).

    NOTE: linear in the assistant text, not (withheld texts x assistant text): a quote of MIN_QUOTE or more
    characters covers a whole CHUNK-aligned chunk of the text holding it, so only a withheld text one of whose
    CHUNK windows is such a chunk is searched for. Those searches are bounded (MAX_QUOTE_SCAN, else a 413).
    Before, each of 2,000 withheld texts was searched for in 6 MB of assistant text on the proxy's event loop:
    21 s in which no other tenant's request was served.
    """
    quotes = {t: p for t, p in withheld.items() if len(t) >= MIN_QUOTE}
    msgs = body.get("messages") if chat else None
    if not quotes or not isinstance(msgs, list):
        return body, []
    texts: list[tuple[int, int | None, str]] = []  # (message, part or None, text) of each assistant text
    for i, m in enumerate(msgs):
        c = m.get("content") if _role(m) == "assistant" else None
        if isinstance(c, str):
            texts.append((i, None, c))
        elif isinstance(c, list):
            texts += [(i, j, t) for j, p in enumerate(c)
                      if isinstance(t := p.get("text") if isinstance(p, dict) else p, str)]
    texts = [x for x in texts if len(x[2]) >= MIN_QUOTE]
    chunks = {t[q:q + CHUNK] for _, _, t in texts for q in range(0, len(t) - CHUNK + 1, CHUNK)}
    maybe = [t for t in quotes if any(t[o:o + CHUNK] in chunks for o in range(CHUNK))]
    if (scan := len(maybe) * sum(len(t) for _, _, t in texts)) > MAX_QUOTE_SCAN:
        raise ProxyError(413, f"the assistant messages may quote {len(maybe)} of this request's withheld tool "
                              f"results; checking them would scan {scan:,} characters, over the proxy's limit of "
                              f"{MAX_QUOTE_SCAN:,}: send fewer withheld results or shorter assistant messages",
                         "messages")
    found: list[tuple[str, str]] = []
    changed: dict[int, dict[int | None, str]] = {}  # message -> {part (None: the content string): new text}
    for i, j, text in texts:
        new = text
        for t in maybe:
            if t in new:
                found.append((f"messages[{i}].content" + ("" if j is None else f"[{j}]"), t))
                new = new.replace(t, quotes[t])
        if new is not text:
            changed.setdefault(i, {})[j] = new
    out = list(msgs)
    for i, news in changed.items():  # NOTE: each message's parts copied once, however many of them changed
        if None in news:
            out[i] = {**out[i], "content": news[None]}
            continue
        parts = list(out[i]["content"])
        for j, new in news.items():
            assert j is not None
            parts[j] = {**parts[j], "text": new} if isinstance(parts[j], dict) else new
        out[i] = {**out[i], "content": parts}
    return ({**body, "messages": out} if found else body), found
