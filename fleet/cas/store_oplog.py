"""Op logs in the store (BlobStore.oplog_*): one log per tenant and session, one JSON op per entry. Each call
validates its input (and encodes every op) before it runs one backend primitive (`_oplog_*`)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any

from fleet.cas.types import check_name, check_tenant, encode_op


class OpLogs(ABC):
    """The op-log part of BlobStore."""

    def oplog_append(self, tenant: str, session_id: str, op: dict[str, Any]) -> int:
        """Append one op (JSON) durably and return its 0-based index. Call before acknowledging."""
        check_tenant(tenant)
        check_name("session_id", session_id)
        return self._oplog_append(tenant, session_id, encode_op(op))

    def oplog_read(self, tenant: str, session_id: str) -> list[dict[str, Any]]:
        check_tenant(tenant)
        check_name("session_id", session_id)
        return [json.loads(s) for s in self._oplog_read(tenant, session_id)]

    def oplog_delete(self, tenant: str, session_id: str) -> bool:
        """Delete the session's log; whether there was one (of two deletes of a log, one answers True)."""
        check_tenant(tenant)
        check_name("session_id", session_id)
        return self._oplog_delete(tenant, session_id)

    def oplog_replace(self, tenant: str, session_id: str, ops: list[dict[str, Any]]) -> None:
        """Make `ops` the session's whole log (indices 0..n-1), in one write: a fork's copy of its parent's
        log. Every op is encoded (and refused if bad) before anything is written."""
        check_tenant(tenant)
        check_name("session_id", session_id)
        self._oplog_replace(tenant, session_id, [encode_op(op) for op in ops])

    # ---- backend primitives ----------------------------------------------------------------------
    @abstractmethod
    def _oplog_append(self, tenant: str, session_id: str, op_json: str) -> int: ...
    @abstractmethod
    def _oplog_read(self, tenant: str, session_id: str) -> list[str]: ...
    @abstractmethod
    def _oplog_delete(self, tenant: str, session_id: str) -> bool: ...
    @abstractmethod
    def _oplog_replace(self, tenant: str, session_id: str, ops_json: list[str]) -> None: ...
