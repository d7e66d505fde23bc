"""Pins and references on a blob (BlobStore.pin / unpin / add_ref / drop_ref / held_refs): what keeps GC from
collecting it. Each call validates its input, then runs one backend primitive (`_incr`, `_hold_one`, `_held`:
one transaction or script); named references are kept by fleet/cas/sqlite_holders.py and redis_holders.py."""

from __future__ import annotations

from abc import ABC, abstractmethod

from fleet.cas.types import BlobMeta, check_key, check_ref, check_tenant, not_found


class BlobRefs(ABC):
    """The pins and references part of BlobStore."""

    def pin(self, ref: str, tenant: str) -> BlobMeta:
        """Pin the blob (GC never collects it until as many unpins); returns its metadata right after the pin.

        Raises:
            NotFound: no such blob (collected, or never stored).
        """
        return self._bump(ref, tenant, "pins", +1)

    def unpin(self, ref: str, tenant: str) -> BlobMeta:
        """Drop one pin; returns the blob's metadata right after the unpin, read in the same transaction/script.
        NOTE: the caller read it with a stat() after the unpin, and GC could collect the blob in between (unpinned,
        no reference, lease run out): an unpin that happened answered NotFound.

        Raises:
            NotFound: no such blob. FailedPrecondition: it has no pin (nothing changed).
        """
        return self._bump(ref, tenant, "pins", -1)

    def add_ref(self, ref: str, tenant: str, holder: str | None = None) -> None:
        """Take a reference on the blob (GC never collects a referenced blob). With `holder` (who holds it: a
        session, `holder_of(tenant, session_id)`), the reference is the holder's, one per (blob, holder): taking it
        again changes nothing, so a call retried after a lost reply or a store that failed half-way counts exactly
        once. Without, each call counts one more (held by no one in particular).

        Raises:
            NotFound: no such blob (collected, or never stored).
        """
        if holder is None:
            self._bump(ref, tenant, "refs", +1)
        else:
            self._hold(ref, tenant, holder, +1)

    def drop_ref(self, ref: str, tenant: str, holder: str | None = None) -> None:
        """Give back a reference add_ref took (with the same `holder`). With `holder`, giving back one the holder
        does not hold (given back already) changes nothing; without, FailedPrecondition when the blob has none."""
        if holder is None:
            self._bump(ref, tenant, "refs", -1)
        else:
            self._hold(ref, tenant, holder, -1)

    def held_refs(self, holder: str) -> list[tuple[str, str]]:
        """(ref, tenant) of each blob `holder` holds a reference on (add_ref with `holder`), in no order: what is
        left to give back when the holder's own list of them (a session's op log) is gone."""
        return self._held(check_key(holder))

    def _hold(self, ref: str, tenant: str, holder: str, delta: int) -> None:
        check_tenant(tenant)
        check_ref(ref)
        if self._hold_one(tenant, ref, check_key(holder), delta) is None:
            raise not_found(ref, tenant)

    def _bump(self, ref: str, tenant: str, counter: str, delta: int) -> BlobMeta:
        check_tenant(tenant)
        check_ref(ref)
        meta = self._incr(tenant, ref, counter, delta)
        if meta is None:
            raise not_found(ref, tenant)
        return meta

    # ---- backend primitives ----------------------------------------------------------------------
    @abstractmethod
    def _incr(self, tenant: str, ref: str, counter: str, delta: int) -> BlobMeta | None:
        """Apply delta unless it would go below 0 (then raise `at_zero`); return the blob's metadata after it, read
        in the same transaction/script; None if missing."""
    @abstractmethod
    def _hold_one(self, tenant: str, ref: str, holder: str, delta: int) -> int | None:
        """+1: add `holder` to the blob's holders, -1: remove it; `refs` moves only when the holders changed. One
        transaction/script, which also keeps the holder's list of its blobs. Returns `refs` after it, None if the blob
        is missing (then, for -1, the holder's list forgets it)."""
    @abstractmethod
    def _held(self, holder: str) -> list[tuple[str, str]]: ...
