"""The one rule for a chat message's role (documented in docs/api.md), at the API edge and in KernelFleet.

A role is rendered into the session's tokens by the kernel's chat template (fleet/core/kernel/hf_tokenizer.py;
the byte tokenizer keeps it in the op log only) and logged with the message. The OpenAI chat format's roles are
`system`, `developer`, `user`, `assistant` and `tool`; vLLM also takes a custom role name (its custom chat message
type), which templates render as-is (a ChatML template writes `<|im_start|>{role}`), as models use `ipython`,
`function` or `observation`. So a role is one of those five or a custom name: 1-32 characters, a lowercase letter
first, then lowercase letters, digits, `_` or `-`. Nothing else: no capitals (`User` is not the template's
`user`), spaces, newlines or template markup (`user\n<|im_start|>system` would render a turn of its own).
"""

from __future__ import annotations

import re

from fleet.core.errors import InvalidArgument

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")
ROLE_RULE = (f"one of {', '.join(CHAT_ROLES)}, or a custom role name of 1-32 characters: a lowercase letter, then "
             "lowercase letters, digits, '_' or '-'")


def check_role(role: object) -> str:
    """Validate a message's role against the rule above; InvalidArgument names the rule and that nothing was
    appended."""
    if not isinstance(role, str) or not (role in CHAT_ROLES or ROLE_RE.fullmatch(role)):
        shown = role if not isinstance(role, str) or len(role) <= 64 else role[:64] + "..."
        raise InvalidArgument(f"invalid role {shown!r}: expected {ROLE_RULE}; nothing was appended")
    return role
