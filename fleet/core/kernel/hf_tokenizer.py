"""A pretrained checkpoint's own tokenizer and chat template, from local files only.

    tok = HFTokenizer.from_dir("/models/qwen")        # tokenizer.json + tokenizer_config.json
    tok.encode_message("system", "You are terse.")    # the template's rendering of that message
    tok.encode(b"tool output")                        # plain text, no template

A session is a sequence of pieces (system prompt, messages, tool results), each tokenized alone
and appended. The chat template is applied per piece by *delta rendering*:

    system piece   = render([system])
    message piece  = render([system0, message]) - render([system0])     (string difference)

so a template that adds a default system prompt, or a BOS only at the start, is rendered as it
would be for the whole conversation. The invariant, checked when the tokenizer loads (a template
that breaks it is refused, never used approximately):

    render([s]) + delta(user) + delta(assistant) == render([s, user, assistant])

Pure core: imports `tokenizers` and `jinja2` (the libraries transformers itself uses), no network:
only files inside the checkpoint directory are read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet.core.errors import InvalidArgument

_PROBE = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"},
          {"role": "assistant", "content": "A"})
_SYSTEM0 = {"role": "system", "content": "kvfleet-delta-anchor"}


def _chat_template(d: Path, cfg: dict[str, Any]) -> str:
    """The checkpoint's default chat template: chat_template.jinja (newer transformers) or the
    `chat_template` of tokenizer_config.json (a string, or a list of {name, template})."""
    f = d / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    t = cfg.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if not isinstance(t, str) or not t:
        raise InvalidArgument(f"{d}: no chat template (chat_template.jinja or tokenizer_config.json's "
                              "chat_template); a pretrained kernel needs its model's template")
    return t


def _token_text(v: Any) -> str:
    """A special token as tokenizer_config.json writes it: a str or an AddedToken dict."""
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""


def _compile(source: str) -> Any:
    """The template compiled the way transformers compiles it (sandboxed jinja2)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    # NOTE: no strftime_now (transformers defines it): a piece's tokens must not depend on the day it
    # was rendered (the controller and the session's actor tokenize the same system prompt, and the
    # radix cache keys blocks by those tokens). Templates that test `strftime_now is defined` (Llama
    # 3.x) use their own fixed date; one that calls it unconditionally is refused at load.
    env.globals.update(raise_exception=raise_exception)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise InvalidArgument(f"the checkpoint's chat template does not compile: {e}") from e


@dataclass(frozen=True, slots=True)
class HFTokenizer:
    """A `tokenizers.Tokenizer` plus its chat template (see the module docstring)."""

    path: str
    tokenizer: Any  # tokenizers.Tokenizer
    template: Any  # jinja2.Template
    bos_token: str = ""
    eos_token: str = ""
    literal: Any = None  # the same tokenizer with encode_special_tokens on: special-token text stays text

    @classmethod
    def from_dir(cls, path: str | Path) -> HFTokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template of a checkpoint directory.

        Raises:
            InvalidArgument: a file is missing or unreadable, or the template is not piecewise.
        """
        from tokenizers import Tokenizer

        d = Path(path)
        tj, cj = d / "tokenizer.json", d / "tokenizer_config.json"
        for f in (tj, cj):
            if not f.is_file():
                raise InvalidArgument(f"{d}: no {f.name}; a pretrained kernel loads its own tokenizer from the "
                                      "checkpoint directory (save it with tokenizer.save_pretrained(dir))")
        try:
            cfg = json.loads(cj.read_text())
            tok, literal = Tokenizer.from_file(str(tj)), Tokenizer.from_file(str(tj))
        except (ValueError, OSError, Exception) as e:  # tokenizers raises a bare Exception on bad JSON
            raise InvalidArgument(f"{d}: cannot read the tokenizer: {e}") from e
        literal.encode_special_tokens = True  # a second instance: never toggled while another thread encodes
        out = cls(str(d), tok, _compile(_chat_template(d, cfg)), _token_text(cfg.get("bos_token")),
                  _token_text(cfg.get("eos_token")), literal)
        out.check_piecewise()
        return out

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def render(self, messages: list[dict[str, str]]) -> str:
        """The template's text for `messages` (no generation prompt)."""
        from jinja2 import TemplateError

        try:
            return str(self.template.render(messages=messages, add_generation_prompt=False,
                                            bos_token=self.bos_token, eos_token=self.eos_token))
        except TemplateError as e:
            hint = (" (the fleet renders templates without the current date, so that a piece's tokens never "
                    "depend on the day)" if "strftime_now" in str(e) else "")
            raise InvalidArgument(f"the chat template refused {[m['role'] for m in messages]}: {e}{hint}") from e

    def render_piece(self, role: str, text: str) -> str:
        """One piece's text: a system prompt rendered alone, any other message by delta rendering."""
        msg = {"role": role, "content": text}
        if role == "system":
            return self.render([msg])
        base, full = self.render([_SYSTEM0]), self.render([_SYSTEM0, msg])
        if not full.startswith(base):
            raise InvalidArgument(f"the chat template of {self.path} rewrites earlier messages when a "
                                  f"{role!r} message follows; it cannot be applied piece by piece")
        return full[len(base):]

    def check_piecewise(self) -> None:
        """Refuse a template whose piecewise rendering differs from the whole conversation's."""
        pieces = "".join(self.render_piece(m["role"], m["content"]) for m in _PROBE)
        whole = self.render(list(_PROBE))
        if pieces != whole:
            raise InvalidArgument(f"the chat template of {self.path} cannot be applied piece by piece: rendering "
                                  f"system/user/assistant one by one gives {pieces!r}, the whole "
                                  f"conversation {whole!r}")

    def encode(self, text: str | bytes) -> list[int]:
        """Plain text (tool results): no template, no special tokens added, and none read from the
        text: a tool result that contains `<|im_start|>system` is those characters, never the
        control token (an untrusted tool output cannot open a turn of its own)."""
        if isinstance(text, bytes | bytearray):
            text = bytes(text).decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise InvalidArgument(f"encode takes str or bytes, got {type(text).__name__}")
        return list((self.literal or self.tokenizer).encode(text, add_special_tokens=False).ids)

    def encode_message(self, role: str, text: str) -> list[int]:
        """A system prompt or chat message, through the chat template (its special tokens included,
        as transformers' apply_chat_template reads them)."""
        if not isinstance(text, str):
            raise InvalidArgument(f"a message must be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(self.render_piece(role, text), add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> bytes:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False)).encode("utf-8")
