"""Auth: hashed tokens, the UNAUTHENTICATED / PERMISSION_DENIED matrix, per-tenant cache_salt, TLS."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
from pathlib import Path

import grpc
import pytest
from support.controller import code_of, make_tokens, md, start_controller, store_url

from controller.auth import Authenticator, TokenBook, mint_token
from controller.main import main as controller_main
from fleet.api.kvfleet.v1 import blobs_pb2, fleet_pb2, route_pb2, workers_pb2
from fleet.api.kvfleet.v1.blobs_pb2_grpc import BlobServiceStub
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub
from fleet.api.kvfleet.v1.route_pb2_grpc import RouteServiceStub
from fleet.api.kvfleet.v1.workers_pb2_grpc import WorkerServiceStub
from fleet.cas.types import check_tenant
from fleet.core.errors import InvalidArgument, Unavailable
from fleet.sdk import NO_RETRY, FleetClient

C = grpc.StatusCode


def _calls(ch: grpc.aio.Channel):
    """(name, role it needs, fn(metadata) -> awaitable) for one RPC of every service."""
    blobs, workers, route, fleet = BlobServiceStub(ch), WorkerServiceStub(ch), RouteServiceStub(ch), FleetServiceStub(ch)

    def put(m):
        async def reqs():
            yield blobs_pb2.PutBlobRequest(header=blobs_pb2.PutBlobHeader(size=2))
            yield blobs_pb2.PutBlobRequest(chunk=b"hi")
        return blobs.PutBlob(reqs(), metadata=m)

    async def get(m):
        return [r async for r in blobs.GetBlob(blobs_pb2.GetBlobRequest(ref="0" * 64), metadata=m)]

    spec = workers_pb2.WorkerSpec(name="w0", url="http://127.0.0.1:1", kv_events="tcp://127.0.0.1:2", model="m")
    return [
        ("WhoAmI", "any", lambda m: fleet.WhoAmI(fleet_pb2.WhoAmIRequest(), metadata=m)),
        ("PutBlob", "tenant", put),
        ("GetBlob", "tenant", get),
        ("StatBlob", "tenant", lambda m: blobs.StatBlob(blobs_pb2.StatBlobRequest(ref="0" * 64), metadata=m)),
        ("Route", "tenant", lambda m: route.Route(route_pb2.RouteRequest(token_ids=[1, 2], model="m"), metadata=m)),
        ("RegisterWorker", "operator", lambda m: workers.RegisterWorker(workers_pb2.RegisterWorkerRequest(spec=spec), metadata=m)),
        ("UnregisterWorker", "operator", lambda m: workers.UnregisterWorker(workers_pb2.UnregisterWorkerRequest(name="w0"), metadata=m)),
        ("ListWorkers", "reader", lambda m: workers.ListWorkers(workers_pb2.ListWorkersRequest(), metadata=m)),
        ("Lifecycle", "operator", lambda m: workers.Lifecycle(workers_pb2.LifecycleRequest(name="w0", verb="sleep", level=1), metadata=m)),
        ("GetFleet", "reader", lambda m: fleet.GetFleet(fleet_pb2.GetFleetRequest(), metadata=m)),
    ]


async def test_auth_matrix(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    reader = mint_token(tok.file, "proxy", "reader")  # the proxy's scoped, read-only token
    admits = {"any": {"tenant", "reader", "operator"}, "tenant": {"tenant", "operator"},
              "reader": {"reader", "operator"}, "operator": {"operator"}}
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            rows = []
            for name, needs, call in _calls(ch):
                got = {who: await code_of(call(m)) for who, m in (
                    ("none", ()), ("wrong", md("kvf_not-a-token")), ("basic", (("authorization", "Basic abc"),)),
                    ("tenant", md(tok.a)), ("reader", md(reader)), ("operator", md(tok.op)))}
                rows.append((name, got))
                print(f"{name:17s}", {k: v.name for k, v in got.items()})
                assert got["none"] == got["wrong"] == got["basic"] == C.UNAUTHENTICATED
                for who in ("tenant", "reader", "operator"):
                    denied = got[who] in (C.UNAUTHENTICATED, C.PERMISSION_DENIED)
                    assert denied == (who not in admits[needs]), (name, who, got[who])
            # control: the matrix saw both refusals and at least one accepted call per role
            assert sum(g["tenant"] == C.PERMISSION_DENIED for _, g in rows) == 5
            assert sum(g["reader"] == C.PERMISSION_DENIED for _, g in rows) == 7
            assert all(any(g[who] == C.OK for _, g in rows) for who in ("tenant", "reader", "operator"))
            # the error messages say what to do
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await FleetServiceStub(ch).GetFleet(fleet_pb2.GetFleetRequest(), metadata=md(tok.b))
            assert "needs the operator or reader role" in ei.value.details() and "bravo" in ei.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await WorkerServiceStub(ch).Lifecycle(workers_pb2.LifecycleRequest(name="w0", verb="sleep", level=1),
                                                      metadata=md(reader))
            assert "needs the operator role" in ei.value.details() and "'reader'" in ei.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await FleetServiceStub(ch).WhoAmI(fleet_pb2.WhoAmIRequest())
            missing = ei.value.details()
            assert "authorization: Bearer" in missing  # and how each client sends it (it named the SDK's alone)
            assert "FleetClient(target, token=...)" in missing and "--token or KVFLEET_TOKEN" in missing
    finally:
        await ctl.stop(0)


async def test_health_and_reflection_need_no_token(tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ctl = await start_controller(store_url("sqlite", tmp_path), make_tokens(tmp_path))
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await ctl.stop(0)


def test_tokens_file_holds_only_hashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.json"
    assert controller_main(["--mint-token", "acme", "--role", "operator", "--tokens-file", str(f)], env={}) == 0
    token = capsys.readouterr().out.strip()
    text = f.read_text()
    entry = json.loads(text)["tokens"][0]
    assert token.startswith("kvf_") and token not in text
    assert entry == {"sha256": hashlib.sha256(token.encode()).hexdigest(), "tenant": "acme", "role": "operator", "name": "acme"}
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    book = TokenBook(f)
    assert book.lookup(token).tenant == "acme" and book.lookup(token + "x") is None
    # bad input: nothing appended, a clear error
    assert controller_main(["--mint-token", "bad tenant!", "--tokens-file", str(f)], env={}) == 2
    assert "invalid tenant 'bad tenant!'" in capsys.readouterr().err
    for bad in ("acme\n", ".hidden", "a" * 65):  # one validator, fullmatch: no trailing newline
        with pytest.raises(InvalidArgument, match="invalid tenant"):
            mint_token(f, bad, "tenant")
        with pytest.raises(InvalidArgument, match="invalid tenant"):
            check_tenant(bad)
    with pytest.raises(InvalidArgument, match="role"):
        mint_token(f, "acme", "root")
    assert f.read_text() == text


async def test_token_minted_while_running_works_at_once(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        late = mint_token(tok.file, "charlie", "tenant")

        def check() -> None:  # a sync client runs in a thread: the server shares this event loop
            with FleetClient(ctl.address, token=late, retry=NO_RETRY) as c:
                assert c.whoami().tenant == "charlie"
        await asyncio.to_thread(check)
    finally:
        await ctl.stop(0)


async def test_cache_salt_is_per_tenant_and_survives_restart(tmp_path: Path) -> None:
    url = store_url("sqlite", tmp_path)
    ctl = await start_controller(url, None)
    salts = {t: ctl.ctx.auth.cache_salt(t) for t in ("acme", "bravo")}
    await ctl.stop(0)
    ctl = await start_controller(url, None)
    again = {t: ctl.ctx.auth.cache_salt(t) for t in ("acme", "bravo")}
    await ctl.stop(0)
    other = await start_controller(store_url("sqlite", tmp_path / "other"), None)  # control: another store
    foreign = other.ctx.auth.cache_salt("acme")
    await other.stop(0)
    print("salts", salts, "other store:", foreign)
    assert salts == again and salts["acme"] != salts["bravo"] and foreign != salts["acme"]
    assert Authenticator(None, b"k").cache_salt("acme") == Authenticator(None, b"k").cache_salt("acme")


def _self_signed(d: Path) -> tuple[Path, Path]:
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


async def test_tls(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, tls_cert=str(cert), tls_key=str(key))
    try:
        target = f"localhost:{ctl.port}"

        def check() -> None:
            with FleetClient(target, token=tok.a, root_certificates=cert, retry=NO_RETRY) as c:
                assert c.whoami().tenant == "acme"
            with FleetClient(target, token=tok.a, retry=NO_RETRY, timeout=3) as c:  # control: plaintext to a TLS port
                with pytest.raises(Unavailable):
                    c.whoami()
        await asyncio.to_thread(check)
    finally:
        await ctl.stop(0)


def test_a_reload_keeps_the_last_good_book_through_an_empty_or_broken_file_and_reads_each_change_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NOTE: an empty tokens file (a rewrite caught between its truncate and its write) was a valid book with no
    tokens: every caller locked out, and for good where the write fell in the same mtime tick (the change was
    the mtime alone). A malformed file was parsed again on every call, logging nothing."""
    import os

    f = tmp_path / "tokens.json"
    acme = mint_token(f, "acme", "tenant")
    book = TokenBook(f)
    good = f.read_text()
    st = f.stat()
    f.write_text("")  # truncated, not yet written
    assert book.lookup(acme) is not None  # before: None (locked out)
    f.write_text(good)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # the final write in the same mtime tick as the truncate
    assert book.lookup(acme) is not None
    bravo = mint_token(f, "bravo", "tenant")
    f.write_text(f.read_text()[:-5])  # a broken edit that also drops bravo's line end
    import controller.auth as auth

    reads = 0
    real = auth._parse if hasattr(auth, "_parse") else auth._load

    def counted(*a: object) -> object:
        nonlocal reads
        reads += 1
        return real(*a)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp, caplog.at_level("WARNING"):
        mp.setattr(auth, "_parse" if hasattr(auth, "_parse") else "_load", counted)
        assert [book.lookup(acme) is not None for _ in range(50)] == [True] * 50
    assert reads == 1  # before: 50 (every call parsed the file again)
    assert book.lookup(bravo) is None and "tokens file not reloaded" in caplog.text and "malformed" in caplog.text
