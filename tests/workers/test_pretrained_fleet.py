"""A pretrained checkpoint on the Ray fleet: sessions carry the checkpoint's own tokens (its
tokenizer and chat template, as transformers would give them), and a second session with the same
system prompt adopts the first one's cached blocks (the radix key is the templated prompt)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from workers.fleet import KernelFleet

sys.path.append(str(Path(__file__).resolve().parents[1] / "fleet" / "kernel"))
from test_hf_tokenizer import CONVERSATION, build_checkpoint, reference_ids  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_pretrained_sessions_use_the_checkpoints_tokens(ray_cluster: None, tmp_path: Path, checkpoint: Path) -> None:
    spec = {"kind": "pretrained", "path": str(checkpoint), "block_size": 4}
    fleet = KernelFleet(f"sqlite:///{tmp_path / 'kvfleet.db'}", spec, call_timeout_s=120.0)
    try:
        system = CONVERSATION[0]["content"]
        fleet.create_session("acme", "a", system)
        for m in CONVERSATION[1:]:
            fleet.append("acme", "a", m["content"], role=m["role"])
        ours, ref = fleet.tokens("acme", "a"), reference_ids(checkpoint, CONVERSATION)
        print(f"{len(ours)} tokens over Ray; equal to transformers' apply_chat_template: {ours == ref}")
        assert ours == ref
        rec = fleet.create_session("acme", "b", system)     # same templated prompt: adopts a's blocks
        n = len(reference_ids(checkpoint, CONVERSATION[:1]))
        assert rec["adopted_tokens"] == (n - 1) // 4 * 4 > 0
        assert fleet.tokens("acme", "b") == ref[:n]
    finally:
        fleet.shutdown()
