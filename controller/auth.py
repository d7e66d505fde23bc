"""Bearer-token auth for the gRPC controller: tokens stored hashed, each carrying a tenant and a role.

Tokens file (JSON; only SHA-256 digests of the tokens are kept, never a token itself):

    {"tokens": [{"sha256": "<hex>", "tenant": "acme", "role": "tenant", "name": "acme-ci"}]}

A caller sends `authorization: Bearer <token>` metadata. No or unknown token is UNAUTHENTICATED; a
tenant calling an operator RPC is PERMISSION_DENIED, and so is a reader calling anything but the
listings (ListWorkers, GetFleet, WhoAmI). Each tenant's routes use its own cache_salt,
HMAC-SHA256(server secret, tenant), so a WARM verdict reveals nothing across tenants.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet.cas.types import check_tenant
from fleet.core.errors import InvalidArgument, PermissionDenied, Unauthenticated

TOKEN_PREFIX = "kvf_"


class Role(enum.StrEnum):
    """tenant: its own blobs, sessions, routes. reader: list workers and the fleet, nothing else (the
    proxy's token). operator: everything, across tenants."""

    TENANT = "tenant"
    READER = "reader"
    OPERATOR = "operator"


# which token roles an RPC marked with a role admits; an RPC may also name a set of roles (ANYONE)
ADMITS: dict[Role, frozenset[Role]] = {
    Role.TENANT: frozenset({Role.TENANT, Role.OPERATOR}),
    Role.READER: frozenset({Role.READER, Role.OPERATOR}),
    Role.OPERATOR: frozenset({Role.OPERATOR}),
}
ANYONE = frozenset(Role)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a token says the caller is."""

    tenant: str
    role: Role
    name: str

    def __post_init__(self) -> None:
        check_tenant(self.tenant)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _load(path: Path) -> dict[str, Identity]:
    try:
        doc = json.loads(path.read_text() or '{"tokens": []}')
        entries = doc["tokens"]
        return {e["sha256"]: Identity(check_tenant(e["tenant"]), Role(e["role"]), e.get("name", "")) for e in entries}
    except FileNotFoundError:
        raise InvalidArgument(f"tokens file {path} does not exist; create one with "
                              f"`kvfleet controller --mint-token TENANT --role operator --tokens-file {path}`") from None
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"tokens file {path} is malformed ({e!r}); expected "
                              '{"tokens": [{"sha256": ..., "tenant": ..., "role": "tenant"|"reader"|"operator", "name": ...}]}') from None


def mint_token(path: str | Path, tenant: str, role: str, name: str = "") -> str:
    """Create a token, append its SHA-256 to the tokens file (created 0600 if missing); return the token."""
    path, role_ = Path(path), Role(role) if role in Role._value2member_map_ else None
    if role_ is None:
        raise InvalidArgument(f"role {role!r} is invalid: use 'tenant', 'reader' or 'operator'")
    check_tenant(tenant)
    doc = {"tokens": []} if not path.exists() or not path.read_text().strip() else json.loads(path.read_text())
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    doc["tokens"].append({"sha256": hash_token(token), "tenant": tenant, "role": role_.value, "name": name or tenant})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)
    return token


class TokenBook:
    """Token digests -> identities, reloaded when the file changes (so minted tokens work at once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._mtime = self.path.stat().st_mtime_ns if self.path.exists() else -1
        self._book = _load(self.path)

    def lookup(self, token: str) -> Identity | None:
        self._maybe_reload()
        return self._book.get(hash_token(token))

    def _maybe_reload(self) -> None:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return  # keep the last good book rather than locking everyone out
        if mtime != self._mtime:
            with self._lock:
                try:
                    self._book, self._mtime = _load(self.path), mtime
                except InvalidArgument:
                    pass  # a half-written or broken edit: keep the last good book


class Authenticator:
    """Authenticates call metadata and authorizes roles; derives each tenant's cache_salt.

    With `book=None` auth is off: every caller is the operator of tenant `open_tenant` (one-machine
    use only; `kvfleet controller` says so loudly).
    """

    def __init__(self, book: TokenBook | None, salt_secret: bytes, open_tenant: str = "local") -> None:
        self.book, self._secret = book, salt_secret
        self._open = Identity(open_tenant, Role.OPERATOR, "auth-disabled")

    def authenticate(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> Identity:
        if self.book is None:
            return self._open
        raw = next((v for k, v in (metadata or ()) if k == "authorization"), None)  # the first one counts
        if raw is None:
            # NOTE: it named FleetClient(token=...) alone, to CLI users too (found by review); the proxy answers
            # an HTTP client without an Authorization header itself (controller/proxy/app.py Handlers._asked)
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token>' (the SDK: "
                                  "FleetClient(target, token=...); the CLI: --token or KVFLEET_TOKEN)")
        value = raw.decode() if isinstance(raw, bytes) else raw
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("malformed authorization metadata: expected 'Bearer <token>'")
        ident = self.book.lookup(token.strip())
        if ident is None:
            raise Unauthenticated("invalid bearer token: it is not in the controller's tokens file "
                                  "(mint one with `kvfleet controller --mint-token`)")
        return ident

    @staticmethod
    def authorize(ident: Identity, needed: Role | frozenset[Role], method: str) -> None:
        admitted = ADMITS[needed] if isinstance(needed, Role) else needed
        if ident.role not in admitted:
            roles = " or ".join(sorted(r.value for r in admitted))
            raise PermissionDenied(f"{method} needs the {roles} role; token {ident.name!r} of tenant "
                                   f"{ident.tenant!r} has role {ident.role.value!r}")

    def cache_salt(self, tenant: str) -> str:
        """The tenant's vLLM cache_salt: HMAC-SHA256(secret, tenant), hex. Stable across restarts."""
        return hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()
