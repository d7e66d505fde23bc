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
    quotes     an assistant message's content, tool call arguments or reasoning that contains a withheld tool
               result's text verbatim (at least MIN_QUOTE characters; controller/proxy/quotes.py): the quote is
               replaced by that result's placeholder, so the model is not handed the withheld bytes back through
               its own earlier answer. Assistant content is otherwise
               not judged: the client writes it as freely as a user message (which is not judged either), and
               judging the model's own prose would cost CPU on every turn and withhold answers that discuss
               attacks (docs/quarantine_path.md)

Pure functions over the request body; controller/proxy/quarantine.py calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from controller.proxy.quotes import CHUNK as CHUNK
from controller.proxy.quotes import MAX_QUOTE_SCAN as MAX_QUOTE_SCAN
from controller.proxy.quotes import MIN_QUOTE as MIN_QUOTE
from controller.proxy.quotes import unquote as unquote
from controller.proxy.tool_parts import ENVELOPE, envelope_parts

JOIN = "\n"
NAME_PLACEHOLDER = "[tool name withheld: quarantined by kvfleet]"
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
