"""Bearer-token auth for the gRPC controller: tokens stored hashed, each carrying a tenant and a role.

Tokens file (JSON; only SHA-256 digests of the tokens are kept, never a token itself):

    {"tokens": [{"sha256": "<hex>", "tenant": "acme", "role": "tenant", "name": "acme-ci"}]}

A caller sends `authorization: Bearer <token>` metadata. No or unknown token is UNAUTHENTICATED; a
tenant calling an operator RPC is PERMISSION_DENIED, and so is a reader calling anything but the
listings (ListWorkers, GetFleet, WhoAmI). Each tenant's routes use its own cache_salt,
HMAC-SHA256(server secret, tenant), so a WARM verdict reveals nothing across tenants.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fleet.cas.types import check_tenant
from fleet.core.errors import InvalidArgument, PermissionDenied, Unauthenticated

log = logging.getLogger("kvfleet.controller")
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


def _parse(path: Path, text: str) -> dict[str, Identity]:
    """A tokens file's text as its book (an empty text: no tokens)."""
    try:
        entries = json.loads(text or '{"tokens": []}')["tokens"]
        return {e["sha256"]: Identity(check_tenant(e["tenant"]), Role(e["role"]), e.get("name", "")) for e in entries}
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"tokens file {path} is malformed ({e!r}); expected "
                              '{"tokens": [{"sha256": ..., "tenant": ..., "role": "tenant"|"reader"|"operator", "name": ...}]}') from None


def _load(path: Path) -> dict[str, Identity]:
    try:
        return _parse(path, path.read_text())
    except FileNotFoundError:
        raise InvalidArgument(f"tokens file {path} does not exist; create one with "
                              f"`kvfleet controller --mint-token TENANT --role operator --tokens-file {path}`") from None


def mint_token(path: str | Path, tenant: str, role: str, name: str = "") -> str:
    """Create a token, append its SHA-256 to the tokens file (created 0600 if missing); return the token.

    The file is read as the controller reads it (a malformed one is refused, named, and left as it was) and
    replaced whole (a temporary file of its own, then os.replace), under an exclusive lock on `<file>.lock`.
    NOTE: mints run at once each read the file, appended and wrote back one shared `<file>.tmp`: of 40 mints in
    8 processes, 3-7 raised, tokens were printed that the file no longer held, and once it no longer loaded.
    """
    path, role_ = Path(path), Role(role) if role in Role._value2member_map_ else None
    if role_ is None:
        raise InvalidArgument(f"role {role!r} is invalid: use 'tenant', 'reader' or 'operator'")
    check_tenant(tenant)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        text = path.read_text() if path.exists() else ""
        entries: list[dict[str, str]] = []
        if text.strip():
            _parse(path, text)  # a malformed file is refused, named, before anything is written
            entries = json.loads(text)["tokens"]
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        entries.append({"sha256": hash_token(token), "tenant": tenant, "role": role_.value, "name": name or tenant})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"tokens": entries}, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return token


def _key(st: os.stat_result) -> tuple[int, int, int]:
    """What tells one version of the tokens file from another: (mtime, size, inode)."""
    return st.st_mtime_ns, st.st_size, st.st_ino


class TokenBook:
    """Token digests -> identities, reloaded when the file changes (so minted tokens work at once).

    A change is a new (mtime, size, inode) of the file; each is read once. A reload that fails keeps the last
    good book and says why, once per change: a missing file, a malformed one, and an empty one (a rewrite in
    progress: `>` or an editor truncates before it writes).
    NOTE: an empty file was a valid book with no tokens, so a reload mid-rewrite locked every caller out, for good
    where the final write fell in the same mtime tick; and a malformed file was parsed again on every call (10.96 ms
    a call at 5,000 tokens, on the event loop), with nothing logged.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._key = self._stat()
        self._book = _load(self.path)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            return _key(os.stat(self.path))
        except FileNotFoundError:
            return None

    def lookup(self, token: str) -> Identity | None:
        self._maybe_reload()
        return self._book.get(hash_token(token))

    def _maybe_reload(self) -> None:
        key = self._stat()
        if key is None or key == self._key:
            return  # unchanged, or gone: keep the last good book rather than locking everyone out
        with self._lock:
            if key == self._key:
                return
            try:
                with open(self.path) as f:
                    before, text, after = _key(os.fstat(f.fileno())), f.read(), _key(os.fstat(f.fileno()))
                if before != after:
                    return  # written while read: read again at the next call. NOTE: keyed by the stat before the
                    # read, a write landing during it (then a same-size one in the same tick) was never read
                self._key = after
                if not text.strip():
                    raise InvalidArgument(f"tokens file {self.path} is empty (a rewrite in progress?)")
                self._book = _parse(self.path, text)
            except (InvalidArgument, OSError) as e:
                log.warning("tokens file not reloaded, the last good one is in use: %s", e)


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

    @property
    def salt_secret(self) -> bytes:
        return self._secret

    def cache_salt(self, tenant: str, client_salt: str | None = None) -> str:
        """The tenant's vLLM cache_salt: HMAC-SHA256(secret, tenant), hex. Stable across restarts. With the client's own
        `client_salt` (a multi-user app's salt per end user): HMAC-SHA256(the tenant's salt, client_salt), hex, so
        the client's salts stay apart from each other and from the tenant's, and only the tenant's callers reach
        them (no tenant knows another's salt to derive from)."""
        salt = hmac.new(self._secret, tenant.encode(), hashlib.sha256).hexdigest()
        if client_salt is None:
            return salt
        return hmac.new(salt.encode(), client_salt.encode(), hashlib.sha256).hexdigest()
