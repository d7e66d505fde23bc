"""Store value types and input validation (shared by every backend, pure: no I/O)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fleet.core.errors import FailedPrecondition, InvalidArgument, NotFound
from fleet.core.verdict import QUARANTINED

DEFAULT_MAX_BLOB_BYTES = 64 << 20
DEFAULT_LEASE_S = 600.0

# What one stored blob counts against its tenant's quota on top of its bytes: the keys and metadata
# a blob costs a backend whatever its size. Measured as Redis used_memory over 4,000-60,000 distinct
# 4-byte blobs: 456-467 bytes a blob beside its payload put straight into the store, 495 through the
# controller (PutBlob and PinBlob); rounded up. SQLite's row costs less; it is charged the same, so a
# quota means the same thing on either backend.
PER_BLOB_OVERHEAD = 512


def blob_charge(size: int) -> int:
    """What a stored blob of `size` bytes counts against its tenant's quota (`stored_bytes`)."""
    return size + PER_BLOB_OVERHEAD


_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # always fullmatch: `$` would allow a trailing newline
_ID_RE = re.compile(r"[A-Za-z0-9_.:/@-]{1,128}")
_REF_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class BlobMeta:
    """Metadata of one stored blob (per tenant)."""

    ref: str
    size: int
    created: float
    pins: int
    refs: int
    verdict: str
    reasons: tuple[str, ...]
    lease_expires: float

    def __post_init__(self) -> None:
        assert self.size >= 0 and self.pins >= 0 and self.refs >= 0, self

    @property
    def quarantined(self) -> bool:
        return self.verdict == QUARANTINED


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """How a store is opened: URL plus limits. `clock` is injectable for lease tests."""

    url: str
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    lease_s: float = DEFAULT_LEASE_S
    clock: Callable[[], float] = field(default=time.time, compare=False)

    def __post_init__(self) -> None:
        if self.max_blob_bytes <= 0:
            raise InvalidArgument(f"max_blob_bytes must be positive, got {self.max_blob_bytes}")
        if self.lease_s < 0:
            raise InvalidArgument(f"lease_s must be >= 0, got {self.lease_s}")


def _sha_hex(view: memoryview) -> str:
    return hashlib.sha256(view).hexdigest()


def check_tenant(tenant: object) -> str:
    """Validate a tenant name: 1-64 chars of [A-Za-z0-9_.-], the first a letter or digit (the only rule)."""
    if not isinstance(tenant, str) or not _NAME_RE.fullmatch(tenant):
        shown = repr(tenant) if len(repr(tenant)) <= 80 else repr(tenant)[:80] + "…"
        raise InvalidArgument(f"invalid tenant {shown}: expected 1-64 characters of [A-Za-z0-9_.-], "
                              "starting with a letter or digit")
    return tenant


def check_name(what: str, name: object) -> str:
    """Validate a namespace / session id: 1-128 chars of [A-Za-z0-9_.:/@-]."""
    if not isinstance(name, str) or not _ID_RE.fullmatch(name):
        raise InvalidArgument(f"invalid {what} {name!r}: expected 1-128 characters of [A-Za-z0-9_.:/@-]")
    return name


def check_key(key: object) -> str:
    """Validate a kv key: any non-empty str of at most 1024 printable characters."""
    if not isinstance(key, str) or not 0 < len(key) <= 1024 or not key.isprintable():
        raise InvalidArgument(f"invalid key {key!r}: expected 1-1024 printable characters")
    return key


def check_ref(ref: object) -> str:
    """Validate a ref: 64 lowercase hex characters (a SHA-256 digest)."""
    if not isinstance(ref, str) or not _REF_RE.fullmatch(ref):
        raise InvalidArgument(f"malformed ref {ref!r}: expected 64 lowercase hex characters (sha256)")
    return ref


def check_bytes(what: str, data: object) -> memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidArgument(f"{what} must be bytes, got {type(data).__name__}")
    try:
        return memoryview(data).cast("B")
    except TypeError as e:  # a non-contiguous view
        raise InvalidArgument(f"{what} must be a contiguous bytes-like object: {e}") from e


def not_found(ref: str, tenant: str) -> NotFound:
    # NOTE: the message names only what the caller supplied, so another tenant's ref and a ref that
    # was never stored are indistinguishable (same type, same text).
    return NotFound(f"blob {ref} not found for tenant {tenant!r}")


def at_zero(ref: str, tenant: str, counter: str) -> FailedPrecondition:
    """An unpin or drop_ref of a blob whose `counter` (pins, refs) is 0: refused, nothing changed."""
    return FailedPrecondition(f"blob {ref}: {counter} is already 0 for tenant {tenant!r}")


def encode_op(op: object) -> str:
    if not isinstance(op, dict):
        raise InvalidArgument(f"op must be a dict, got {type(op).__name__}")
    try:
        return json.dumps(op, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"op is not JSON-serialisable: {e}") from e
