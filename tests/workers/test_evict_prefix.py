"""Policy eviction by name (`KernelFleet.evict_prefix`) takes a start inside the prompt, nothing else.

NOTE: a host put its tenant's salt page (one block) in front of the prompt and shifted `start` by it without a
check: `start=-16` (minus one block) named the salt page itself, and the call dropped every block the tenant had
cached on every node, for other prompts too, and answered with their count; a `start` that was not an int failed
in the host with a raw TypeError (a RayTaskError, not a kvfleet error)."""

from __future__ import annotations

import pytest
from support.workers import SPEC

from fleet.core.errors import InvalidArgument
from workers.fleet import KernelFleet

PROMPT_A = "You are agent zero. Answer briefly."   # 35 bytes: 2 whole blocks of 16
PROMPT_B = "You are agent one. Answer at length."  # 36 bytes: 2 whole blocks, another path from the first byte on


def test_a_start_outside_the_prompt_is_refused_and_drops_nothing(kfleet: KernelFleet, tenant: str) -> None:
    bs = SPEC.block_size
    kfleet.create_session(tenant, "a", PROMPT_A)
    kfleet.create_session(tenant, "b", PROMPT_B)
    for start in (-bs, -2 * bs, 3, 2 * bs, 10**9, "0", 1.0, True, None):
        with pytest.raises(InvalidArgument, match="start"):
            kfleet.evict_prefix(tenant, PROMPT_A[:2 * bs], start)   # type: ignore[arg-type]
    # nothing was dropped: both prompts' blocks are still cached (a new session adopts them)
    assert kfleet.create_session(tenant, "b2", PROMPT_B)["adopted_tokens"] == 2 * bs
    assert kfleet.create_session(tenant, "a2", PROMPT_A)["adopted_tokens"] == 2 * bs
    # control: a start inside the prompt drops that prompt's blocks from there on, and only those
    assert kfleet.evict_prefix(tenant, PROMPT_A[:2 * bs], bs) == 1
    assert kfleet.create_session(tenant, "a3", PROMPT_A)["adopted_tokens"] == bs
    assert kfleet.create_session(tenant, "b3", PROMPT_B)["adopted_tokens"] == 2 * bs
