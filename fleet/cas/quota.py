"""A tenant's quota on stored blob bytes: the argument's check and the refusal of a put past it (BlobStore.put,
put_stream; the controller's PutBlob refuses a header over it the same way)."""

from __future__ import annotations

from fleet.cas.types import PER_BLOB_OVERHEAD, blob_charge
from fleet.core.errors import InvalidArgument, ResourceExhausted


class OverQuota(ResourceExhausted):
    """A put refused because it would take its tenant's stored blob bytes past the quota."""


def over_quota(tenant: str, used: int, size: int, quota: int, in_flight: int = 0) -> OverQuota:
    """The refusal of a put of a `size`-byte blob that would take `tenant`'s stored blob bytes (`used`,
    each blob counted as `blob_charge` of its size) and the bytes of its puts in progress (`in_flight`, where the
    backend counts them) past `quota`."""
    flying = f" and {in_flight} more in puts in progress" if in_flight else ""
    return OverQuota(
        f"tenant {tenant!r} has {used} blob bytes stored{flying} (each blob counts its size plus {PER_BLOB_OVERHEAD}); "
        f"this blob of {size} bytes (counting {blob_charge(size)}) would take it past "
        f"its quota of {quota} bytes (--max-blob-bytes-per-tenant); nothing was stored. Unpin blobs you no "
        "longer need (stored blobs count until the store GC collects them: unpinned, unreferenced, lease "
        "expired) or ask the operator to raise the quota"
    )


def check_quota(quota: object) -> None:
    """A put's `quota` argument: an int >= 0 (0: none)."""
    if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
        raise InvalidArgument(f"quota must be an int >= 0 (0: none), got {quota!r}")
