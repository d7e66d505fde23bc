"""A byte-level tokenizer for synthetic models: one token per byte, folded into the vocabulary.

A pretrained checkpoint uses its own tokenizer and chat template instead (fleet/core/kernel/hf_tokenizer.py);
both answer `encode` (plain text) and `encode_message` (a system prompt or chat message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleet.core.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """Token id = byte value (+ `offset`), for vocabularies of at least 256 + offset ids."""

    vocab_size: int
    offset: int = 0

    def __post_init__(self) -> None:
        if self.vocab_size < 256 + self.offset:
            raise InvalidArgument(
                f"ByteTokenizer needs vocab_size >= {256 + self.offset}, got {self.vocab_size}"
            )

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, str):
            text = text.encode("utf-8")
        if not isinstance(text, bytes | bytearray):
            raise InvalidArgument(f"encode takes str or bytes, got {type(text).__name__}")
        return [b + self.offset for b in text]

    def encode_message(self, role: str, text: str) -> list[int]:
        """A message's bytes: the synthetic model has no chat template (the role is in the op log)."""
        return self.encode(text)

    def decode(self, ids: list[int]) -> bytes:
        """Bytes for the ids; ids outside the byte range are dropped."""
        return bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)


def encode_message(tokenizer: Any, role: str, text: str) -> list[int]:
    """`tokenizer.encode_message(role, text)`, or plain `encode(text)` for a tokenizer without a template."""
    enc = getattr(tokenizer, "encode_message", None)
    return list(enc(role, text)) if enc is not None else list(tokenizer.encode(text))
