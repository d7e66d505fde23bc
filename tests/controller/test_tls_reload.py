"""A renewed TLS certificate is served without a restart: a real controller, its --tls-cert/--tls-key rewritten in
place (as cert-manager renews a mounted Secret), is seen by each new connection's handshake once the files are
whole again; a half-written renewal (new certificate, old key) keeps the old pair served.

NOTE: before, the controller read the files once (grpc.ssl_server_credentials): it served the old certificate until
it restarted (the review's tls_rotation.sh: the old serial 65 s after the renewal).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import pytest
from support.controller import make_tokens, start_controller, store_url

from controller import tls_reload
from fleet.sdk import AsyncFleetClient

INTERVAL_S = 0.2


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _pki(d: Path) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """A CA and two server certificates for 127.0.0.1 it signed (EC keys: quick to make)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca, ca_key = d / "ca.pem", d / "ca.key"
    _openssl("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "1", "-subj", "/CN=ca")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    leaves = {}
    for name in ("old", "new"):
        cert, key, csr = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr"
        _openssl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
                 "-out", str(cert), "-days", "1", "-extfile", str(d / "ext"))
        leaves[name] = (cert, key)
    return ca, leaves


def _served(port: int, ca: Path) -> bytes:
    """The certificate a new TLS connection is shown (DER), verified against the CA."""
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), 5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        der = s.getpeercert(binary_form=True)
    assert der is not None
    return der


def _der(cert: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(cert.read_text())


async def test_a_renewed_certificate_is_served_to_new_connections(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls_reload, "CHECK_INTERVAL_S", INTERVAL_S)
    ca, leaves = _pki(tmp_path)
    live_cert, live_key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(leaves["old"][0], live_cert)
    shutil.copy(leaves["old"][1], live_key)
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok, tls_cert=str(live_cert), tls_key=str(live_key))
    try:
        assert await asyncio.to_thread(_served, ctl.port, ca) == _der(leaves["old"][0])
        shutil.copy(leaves["new"][0], live_cert)  # half the renewal: the new certificate, the old key
        await asyncio.sleep(3 * INTERVAL_S)
        half = [await asyncio.to_thread(_served, ctl.port, ca) for _ in range(3)]  # handshakes still succeed ..
        assert half == [_der(leaves["old"][0])] * 3  # .. on the old pair
        shutil.copy(leaves["new"][1], live_key)  # the rest of it
        await asyncio.sleep(1.5 * INTERVAL_S)
        for _ in range(20):  # the first handshake after a check interval loads it (one more at most)
            if await asyncio.to_thread(_served, ctl.port, ca) == _der(leaves["new"][0]):
                break
            await asyncio.sleep(INTERVAL_S)
        assert await asyncio.to_thread(_served, ctl.port, ca) == _der(leaves["new"][0])
        async with AsyncFleetClient(f"127.0.0.1:{ctl.port}", token=tok.op, tls=True,
                                    root_certificates=str(ca)) as c:  # gRPC itself over the new certificate
            assert (await c.whoami()).tenant == "ops"
    finally:
        await ctl.stop(0)


def test_the_files_are_checked_at_most_once_per_interval(tmp_path: Path) -> None:
    """Device-free: a clock the test moves. A change is picked up at the first fetch one interval after the last
    check, never sooner; the mutual-TLS client CA is watched as well."""
    ca, leaves = _pki(tmp_path)
    live = [tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt"]
    for src, dst in zip((*leaves["old"], ca), live, strict=True):
        shutil.copy(src, dst)
    now = [100.0]
    fetch = tls_reload.CertReloader(*map(str, live), check_interval_s=10.0, clock=lambda: now[0])
    shutil.copy(leaves["new"][0], live[0])
    shutil.copy(leaves["new"][1], live[1])
    now[0] = 109.9
    assert fetch() is None and fetch.num_reloads == 0  # inside the interval: not even looked at
    now[0] = 110.0
    assert fetch() is not None and fetch.num_reloads == 1
    now[0] = 125.0
    assert fetch() is None and fetch.num_reloads == 1  # nothing changed
    live[2].write_bytes(leaves["new"][0].read_bytes())  # another client CA
    now[0] = 130.0
    assert fetch() is None  # checked at 125: the next check is at 135
    now[0] = 135.0
    assert fetch() is not None and fetch.num_reloads == 2
