"""What one session actor hosts: a kernel session driven only by op dicts.

Every mutation is an op (`create`, `append`, `generate`, `evict`, `fork`); the live path and the
regeneration path call the same `apply`, so replaying a session's op log rebuilds it
bit-identically (the kernel is batch-invariant: prefilling A+B at once == A then B, and adopting
a shared prefix == prefilling it). No Ray here: the actor shell adds the store and the I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fleet.errors import FailedPrecondition, InvalidArgument
from fleet.kernel import Kernel, PrefixKV, Session

OPS = ("create", "append", "generate", "evict", "fork")


class SessionHost:
    """A kernel session plus the ids of the ops already applied to it (for idempotent retries)."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.session: Session | None = None
        self.op_ids: set[str] = set()
        self.num_ops = 0
        self.num_adopted_tokens = 0

    def apply(self, op: dict[str, Any], prefix: PrefixKV | None = None) -> Any:
        """Apply one op. Bad input raises (InvalidArgument / FailedPrecondition), state unchanged.

        Args:
            op: {"op": name, ...fields}; `op_id` (optional) makes a retry idempotent.
            prefix: for "create" only: shared blocks to adopt instead of prefilling them.
        Returns:
            the op's result: logits (create/append), token ids (generate), EvictReport, or None.
        """
        name = op.get("op")
        if name not in OPS:
            raise InvalidArgument(f"unknown op {name!r}; expected one of {OPS}")
        if (name == "create") != (self.session is None):
            raise FailedPrecondition("create must be the first op of a session, and only the first")
        result = getattr(self, f"_op_{name}")(op, prefix)
        self.num_ops += 1
        if op.get("op_id"):
            self.op_ids.add(str(op["op_id"]))
        return result

    def replay(self, ops: Iterable[dict[str, Any]]) -> None:
        """Apply a whole op log in order (regeneration)."""
        for op in ops:
            self.apply(op)

    def _op_create(self, op: dict[str, Any], prefix: PrefixKV | None) -> np.ndarray | None:
        tokens = list(op["tokens"])
        if prefix is not None and (len(prefix.tokens) >= len(tokens) or list(prefix.tokens) != tokens[:len(prefix.tokens)]):
            raise InvalidArgument("the adopted prefix must be a strict prefix of the session's first tokens")
        session = self.kernel.session(prefix=prefix)
        n = len(session)
        logits = session.append(tokens[n:]) if len(tokens) > n else None
        self.session, self.num_adopted_tokens = session, n
        return logits

    def _op_append(self, op: dict[str, Any], _: Any) -> np.ndarray:
        return self._s.append(list(op["tokens"]))

    def _op_generate(self, op: dict[str, Any], _: Any) -> list[int]:
        return self._s.generate(int(op["n"]))

    def _op_evict(self, op: dict[str, Any], _: Any) -> Any:
        return self._s.evict(start=op["start"], length=op["length"], mode=op.get("mode", "exact"))

    def _op_fork(self, op: dict[str, Any], _: Any) -> None:
        return None  # marker: the ops before it were copied from the parent's log

    @property
    def _s(self) -> Session:
        assert self.session is not None
        return self.session
