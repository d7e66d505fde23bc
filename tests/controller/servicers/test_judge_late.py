"""Issue #28: a heavy detector layer (the encoder) is not waited for on the request path. The request gets the
fast layers' verdict; the full one is computed in the tenant's judge lane and stored, so the next request is
withheld, the tenant's record says "late", and the tenant's blob of those bytes is marked (sessions refuse to
append it). A real controller on loopback; the encoder must be installed (kvfleet[encoder])."""

from __future__ import annotations

import hashlib
from pathlib import Path

import grpc
from support.controller import lanes_idle, make_tokens, md, start_controller, store_url
from support.extras import require_encoder

from fleet.api.kvfleet.v1 import blobs_pb2
from fleet.api.kvfleet.v1 import quarantine_pb2 as pb
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.quarantine_pb2_grpc import QuarantineServiceStub
from fleet.core.quarantine.detector_config import DetectorConfig

require_encoder()

TEXT = b"Order 4412 shipped on 3 March via DHL, expected delivery Friday."
STORED = b"Build 8812 passed: 412 tests, 0 failures, coverage 81.4%."


async def test_a_heavy_layers_verdict_comes_late_and_the_next_request_is_withheld(tmp_path: Path) -> None:
    """acme's config: the rules, and the encoder at threshold 0 (it quarantines anything: a stand-in for an
    attack only the encoder catches). The first call answers with the rules' verdict (clean, no encoder
    score: it did not wait); once the lane has run the encoder, the same bytes are quarantined. bravo
    (rules alone) is the control: clean, never an encoder score."""
    t = make_tokens(tmp_path)
    heavy = DetectorConfig(layers=("rules", "encoder"), encoder_threshold=0.0)
    ctl = await start_controller(
        store_url("sqlite", tmp_path), t, detector_layers=("rules",), detector_tenants=(("acme", heavy),)
    )
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            q, blobs = QuarantineServiceStub(ch), BlobServiceStub(ch)
            req = pb.JudgeToolResultsRequest(results=[TEXT], action="placeholder")
            first = (await q.JudgeToolResults(req, metadata=md(t.a))).judgements[0]
            assert not first.quarantined and not any(r.startswith("encoder:") for r in first.reasons)
            await lanes_idle(ctl, "acme")
            recs = (await q.ListQuarantines(pb.ListQuarantinesRequest(), metadata=md(t.a))).records
            assert [(r.ref, r.action) for r in recs] == [(hashlib.sha256(TEXT).hexdigest(), "late")]
            late = (await q.JudgeToolResults(req, metadata=md(t.a))).judgements[0]
            assert late.quarantined and late.source == "detector"
            assert any(r.startswith("encoder:") for r in late.reasons)

            # a stored blob is judged in full in the background after its put (the Judge is built by now)
            async def put():  # type: ignore[no-untyped-def]
                yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=len(STORED)))
                yield blobs_pb2.PutBlobRequest(chunk=STORED)

            ref = (await blobs.PutBlob(put(), metadata=md(t.a))).ref
            await lanes_idle(ctl, "acme")
            meta = (await blobs.StatBlob(blobs_pb2.StatBlobRequest(ref=ref), metadata=md(t.a))).meta
            assert meta.verdict == "QUARANTINED" and any(r.startswith("encoder:") for r in meta.reasons)
            # control: bravo's config has no heavy layer; the same bytes are clean for it, no background job
            other = (await q.JudgeToolResults(req, metadata=md(t.b))).judgements[0]
            assert not other.quarantined and ctl.ctx.judge_lanes.stats("bravo")["jobs"] == 1
    finally:
        await ctl.stop(0)
