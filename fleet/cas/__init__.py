"""Content-addressed blob store (DESIGN §6): one interface, SQLite and Redis backends.

    from fleet.cas import open_store
    store = open_store("sqlite:///path/kvfleet.db")      # embedded default
    store = open_store("redis://127.0.0.1:6379/0")       # production
    ref = store.put(b"...", tenant="acme")
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fleet.cas.base import (
    DEFAULT_LEASE_S,
    DEFAULT_MAX_BLOB_BYTES,
    PER_BLOB_OVERHEAD,
    BlobMeta,
    BlobStore,
    StoreConfig,
    blob_charge,
)
from fleet.cas.url import redact
from fleet.core.errors import InvalidArgument

__all__ = [
    "BlobMeta", "BlobStore", "StoreConfig", "open_store", "make_store",
    "DEFAULT_MAX_BLOB_BYTES", "DEFAULT_LEASE_S", "PER_BLOB_OVERHEAD", "blob_charge",
]


def make_store(cfg: StoreConfig) -> BlobStore:
    """Open the backend the URL names. redis-py is imported only for redis:// URLs.

    Raises:
        InvalidArgument: unknown URL scheme.
        Unavailable: the server / database cannot be reached.
    """
    if cfg.url.startswith(("redis://", "rediss://", "unix://")):
        from fleet.cas.redis import RedisBlobStore  # noqa: PLC0415 - keep redis out of the core

        return RedisBlobStore(cfg)
    if cfg.url.startswith("sqlite://"):
        from fleet.cas.sqlite import SqliteBlobStore  # noqa: PLC0415

        return SqliteBlobStore(cfg)
    raise InvalidArgument(f"unknown store URL {redact(cfg.url)!r}: use sqlite:///path/to/kvfleet.db or redis://host:port/db")


def open_store(url: str, *, max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES, lease_s: float = DEFAULT_LEASE_S,
               clock: Callable[[], float] = time.time) -> BlobStore:
    """Open a store by URL (see `make_store`)."""
    if not isinstance(url, str):
        raise InvalidArgument(f"store URL must be a str, got {type(url).__name__}")
    return make_store(StoreConfig(url=url, max_blob_bytes=max_blob_bytes, lease_s=lease_s, clock=clock))
