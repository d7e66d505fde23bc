"""A local Hugging Face tokenizer that gives the stand-in's ids, for the `--tokenizer hf:PATH` tests."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from pathlib import Path

from controller.proxy.tokenize import PROBES
from fleet.app.testkit.sim_vllm import tokenizer as simtok

# NOTE: the template's line breaks are a special token of the stand-in's newline id: the stand-in's text tokenizer
# drops every whitespace, a line break inside a message's text (text parts are joined with one) included
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}<|nl|>{{ m.content }}<|im_end|><|nl|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant<|nl|>{% endif %}")
SPECIAL = {"<|im_start|>": simtok.IM_START, "<|im_end|>": simtok.IM_END, "<|nl|>": simtok.NEWLINE}


def build_hf_tokenizer(path: Path, texts: Sequence[str], skew_word: str | None = None) -> Path:
    """A WordLevel tokenizer with the stand-in's ids for the words of PROBES and `texts`, and ChatML's template;
    skew_word gets a wrong id."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    probes = [p["prompt"] if "prompt" in p else json.dumps(p["messages"]) for p in PROBES]
    words = set(re.findall(r"\w+|[^\w\s]", " ".join([*probes, *texts, "system user assistant"])))
    vocab = {w: 100 + zlib.crc32(w.encode()) % simtok.VOCAB for w in words}
    if skew_word is not None:
        vocab[skew_word] += 1
    vocab.update({"[UNK]": 0, **SPECIAL})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "removed"),
                                                pre_tokenizers.Split(Regex(r"\w+|[^\w\s]"), "isolated")])
    tk.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path
