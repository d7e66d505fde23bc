"""TLS and mutual TLS from the SDK, the CLI and `kvfleet proxy` to the controller; the proxy's read-only token.

Certificates are made in the test with the openssl binary: a CA, a server certificate for 127.0.0.1,
a client certificate the CA signed, and a rogue client certificate signed by another CA.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.controller import make_tokens, start_controller, store_url

import fleet.sdk.base as sdk_base
from controller.auth import mint_token
from controller.proxy import Proxy, ProxyConfig
from fleet.app.cli import worker as worker_cli
from fleet.app.testkit.sim_vllm.config import SimEngineConfig
from fleet.app.testkit.sim_vllm.main import SimConfig, SimVllm
from fleet.core.errors import InvalidArgument, Unavailable
from fleet.sdk import NO_RETRY, AsyncFleetClient, FleetClient, RetryPolicy


@dataclass(frozen=True, slots=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _ssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
         "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE", "-addext",
         "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    cert, key, csr, extfile = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr", d / f"{name}.ext"
    _ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
    extfile.write_text(ext)
    _ssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
         "-out", str(cert), "-days", "1", "-extfile", str(extfile))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = _ca(d, "ca"), _ca(d, "other-ca")
    server = _leaf(d, "server", ca, "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    client = _leaf(d, "client", ca, "extendedKeyUsage=clientAuth\n")
    rogue = _leaf(d, "rogue", other, "extendedKeyUsage=clientAuth\n")
    return Pki(ca[0], *server, *client, *rogue)


async def _mtls_controller(tmp_path: Path, pki: Pki, **kw):
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, tls_cert=str(pki.server_cert),
                                 tls_key=str(pki.server_key), tls_client_ca=str(pki.ca), **kw)
    return tok, ctl


async def test_sdk_mutual_tls(tmp_path: Path, pki: Pki) -> None:
    tok, ctl = await _mtls_controller(tmp_path, pki)
    try:
        target = f"127.0.0.1:{ctl.port}"

        def check() -> None:
            with FleetClient(target, tok.a, root_certificates=pki.ca, client_cert=pki.client_cert,
                             client_key=pki.client_key, retry=NO_RETRY) as c:
                assert c.whoami().tenant == "acme"
            for label, kw in {"no client certificate": {},
                              "a certificate another CA signed": {"client_cert": pki.rogue_cert,
                                                                  "client_key": pki.rogue_key}}.items():
                with FleetClient(target, tok.a, root_certificates=pki.ca, retry=NO_RETRY, timeout=3, **kw) as c:
                    with pytest.raises(Unavailable) as ei:
                        c.whoami()
                    print(label, "->", ei.value)
        await asyncio.to_thread(check)
        async with AsyncFleetClient(target, tok.a, root_certificates=pki.ca.read_bytes(),
                                    client_cert=pki.client_cert.read_bytes(), client_key=pki.client_key.read_bytes(),
                                    retry=NO_RETRY) as ac:
            assert (await ac.whoami()).tenant == "acme"
        with pytest.raises(InvalidArgument, match="both a client certificate and its private key"):
            FleetClient(target, tok.a, root_certificates=pki.ca, client_cert=pki.client_cert)
        # a file that is not PEM is named at once (grpc would fail every handshake: "unavailable")
        not_pem = tmp_path / "ca.der"
        not_pem.write_bytes(b"\x30\x82 not a PEM file")
        for kw in ({"root_certificates": not_pem}, {"root_certificates": not_pem.read_bytes()},
                   {"root_certificates": pki.ca, "client_cert": pki.client_cert, "client_key": not_pem}):
            with pytest.raises(InvalidArgument, match="is not PEM"):
                FleetClient(target, tok.a, **kw)
    finally:
        await ctl.stop(0)


async def test_a_tls_handshake_that_cannot_succeed_is_not_retried_and_says_why(tmp_path: Path, pki: Pki) -> None:
    # Found by review: --tls against a plaintext controller was retried 8 times over 8.7 s and ended with "check
    # that `kvfleet controller` is running". Before the fix this failed at its first check: the message named the
    # attempts and no handshake.
    (tmp_path / "plain").mkdir()
    tok = make_tokens(tmp_path / "plain")
    plain = await start_controller(store_url("sqlite", tmp_path / "plain"), tok)
    _, tls = await _mtls_controller(tmp_path, pki)
    causes = {f"127.0.0.1:{plain.port}": "a plaintext controller? drop --tls",
              f"127.0.0.1:{tls.port}": "its certificate did not verify"}  # tls=True: the system's CAs, not ours
    proxy = await Proxy(ProxyConfig(controller=f"127.0.0.1:{plain.port}", listen="127.0.0.1:0", tls=True)).start()
    try:
        def check() -> None:
            for target, cause in causes.items():
                with FleetClient(target, tok.a, tls=True, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.05),
                                 timeout=3) as c, pytest.raises(Unavailable) as ei:
                    c.whoami()
                msg = str(ei.value)
                print(msg)
                assert f"WhoAmI: the controller at {target} did not complete a TLS handshake ({cause}" in msg
                assert "attempt(s)" not in msg and "kvfleet controller" not in msg  # sent once, and no such advice
            with FleetClient(f"127.0.0.1:{plain.port}", tok.a, retry=NO_RETRY) as c:  # control: plaintext works
                assert c.whoami().tenant == "acme"
        await asyncio.to_thread(check)
        print("proxy:", proxy.directory.last_error)
        assert "did not complete a TLS handshake (a plaintext controller? drop --tls" in str(proxy.directory.last_error)
    finally:
        await proxy.stop()
        await plain.stop(0)
        await tls.stop(0)


@pytest.mark.slow
async def test_cli_tls_flags(tmp_path: Path, pki: Pki, capsys: pytest.CaptureFixture[str], ray_cluster: None,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: a controller refusing a client with no certificate closes the socket, which a client cannot tell from a
    # controller that is down, so the CLI's clients retry it for their whole budget (about 10 s): sent once here
    monkeypatch.setattr(sdk_base, "RetryPolicy", lambda: NO_RETRY)
    tok, ctl = await _mtls_controller(tmp_path, pki, start_router=True)
    try:
        base = ["ls", "--json", "--controller", f"127.0.0.1:{ctl.port}", "--token", tok.op, "--tls-ca", str(pki.ca)]
        mine = ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.client_key)]
        assert await asyncio.to_thread(worker_cli.main, base + mine) == 0
        assert json.loads(capsys.readouterr().out)["workers"] == []
        assert await asyncio.to_thread(worker_cli.main, base) == 2  # control: no client certificate
        assert "Unavailable" in capsys.readouterr().err
    finally:
        await ctl.stop(0)


async def test_proxy_lists_workers_over_mtls_with_a_reader_token(tmp_path: Path, pki: Pki) -> None:
    tok, ctl = await _mtls_controller(tmp_path, pki, start_router=True)
    reader = mint_token(tok.file, "proxy", "reader")
    sim = await SimVllm(SimConfig(engine=SimEngineConfig(model="m", num_blocks=64))).start()
    target = f"127.0.0.1:{ctl.port}"
    tls = {"tls_ca": str(pki.ca), "tls_client_cert": str(pki.client_cert), "tls_client_key": str(pki.client_key)}
    proxies: list[Proxy] = []
    try:
        async with AsyncFleetClient(target, tok.op, root_certificates=pki.ca, client_cert=pki.client_cert,
                                    client_key=pki.client_key, retry=NO_RETRY) as op:
            await op.register_worker("w0", url=sim.url, kv_events=sim.kv_events, replay=sim.replay or "", model="m")
            with pytest.raises(Exception) as ei:  # the reader may list, never drive lifecycle verbs
                async with AsyncFleetClient(target, reader, root_certificates=pki.ca, client_cert=pki.client_cert,
                                            client_key=pki.client_key, retry=NO_RETRY) as rc:
                    await rc.lifecycle("w0", "sleep", level=1)
            assert type(ei.value).__name__ == "PermissionDenied"
        for label, extra in (("mtls + reader", tls), ("plaintext (control)", {})):
            proxy = await Proxy(ProxyConfig(controller=target, listen="127.0.0.1:0", token=reader, **extra)).start()
            proxies.append(proxy)
            await proxy.directory.refresh()
            d = proxy.directory
            print(label, sorted(d.workers), d.last_error)
        assert sorted(proxies[0].directory.workers) == ["w0"] and proxies[0].directory.last_error is None
        assert not proxies[1].directory.workers and proxies[1].directory.last_error
    finally:
        for p in proxies:
            await p.stop()
        await sim.stop()
        await ctl.stop(0)


def test_proxy_tls_flags_reach_its_config() -> None:
    from controller.proxy.main import config_from, parse_args

    cfg = config_from(parse_args(["--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key", "c.key"], {}))
    assert (cfg.tls_ca, cfg.tls_client_cert, cfg.tls_client_key) == ("ca.pem", "c.pem", "c.key")
    env = {"KVFLEET_TLS_CA": "e.pem"}
    assert config_from(parse_args([], env)).tls_ca == "e.pem"
    with pytest.raises(InvalidArgument, match="both --tls-cert and --tls-key"):
        config_from(parse_args(["--tls-cert", "c.pem"], {}))


async def test_the_proxy_presents_a_renewed_client_certificate_without_a_restart(tmp_path: Path, pki: Pki) -> None:
    """The proxy's --tls-cert/--tls-key rewritten in place (as cert-manager renews a mounted Secret): new calls to the
    controller go over a new channel with them. Here the first pair is one the controller refuses (another CA signed
    it: as an expired certificate would be), so the proxy cannot list the fleet until the renewal is read. A renewal
    caught half-written (a new certificate beside the old key, a cut CA) keeps the files that work. NOTE: before, the files
    were read once, and the proxy stayed unable to reach the controller until it restarted."""
    tok, ctl = await _mtls_controller(tmp_path, pki, start_router=True)
    reader = mint_token(tok.file, "proxy", "reader")
    cert, key, ca = tmp_path / "proxy.pem", tmp_path / "proxy.key", tmp_path / "ca.pem"
    ca.write_bytes(pki.ca.read_bytes())
    cert.write_bytes(pki.rogue_cert.read_bytes())
    key.write_bytes(pki.rogue_key.read_bytes())
    cfg = ProxyConfig(controller=f"127.0.0.1:{ctl.port}", listen="127.0.0.1:0", token=reader, tls_ca=str(ca),
                      tls_client_cert=str(cert), tls_client_key=str(key), tls_check_s=0.1)
    proxy = await Proxy(cfg).start()

    async def lists() -> bool:
        await proxy.directory.refresh()
        return proxy.directory.last_error is None

    try:
        assert not await lists()  # control: the controller refuses the first certificate
        cert.write_bytes(pki.client_cert.read_bytes())
        key.write_bytes(pki.client_key.read_bytes())
        for _ in range(50):
            await asyncio.sleep(0.1)
            if await lists():
                break
        assert await lists()  # NOTE: before, refused until the proxy restarted
        cert.write_bytes(pki.rogue_cert.read_bytes())  # half-written: another certificate, the key it does not fit
        await asyncio.sleep(0.5)
        assert await lists()  # the working pair is kept
        cert.write_bytes(pki.client_cert.read_bytes())
        pem = ca.read_bytes()
        ca.write_bytes(pem[: len(pem) // 2])  # a CA caught half-written
        await asyncio.sleep(0.5)
        assert await lists()  # the working files are kept
    finally:
        await proxy.stop()
        await ctl.stop(0)
