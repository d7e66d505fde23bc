"""The controller's TLS files, reloaded when they change: a renewed certificate is served without a restart.

gRPC asks `CertReloader` (the fetcher of grpc.dynamic_ssl_server_credentials) before each new connection's
handshake. It stats the files at most once per `check_interval_s`; when one changed (mtime, inode or size: a
kubelet-mounted Secret is swapped in by a symlink, cert-manager rewrites it in place) it reads them all and hands
gRPC the new pair (and client CA). A set that does not load (a file missing or not PEM, a key that does not match
its certificate: caught half-written) keeps the current one and is tried again at the next check. Connections
already open keep the certificate they were made with.

NOTE: before, the files were read once at start (grpc.ssl_server_credentials): a certificate renewed in the
mounted Secret was not served until the pod restarted, and expired under its clients.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from fleet.core.errors import InvalidArgument

log = logging.getLogger("kvfleet.tls")
CHECK_INTERVAL_S = 10.0  # the most often the files are stat'ed (a renewal is served within this, after the kubelet's sync)

Stamp = tuple[tuple[int, int, int], ...]  # (mtime_ns, inode, size) per file


class CertReloader:
    """Loads `cert`, `key` (and `client_ca`) now, and again when they change (see the module docstring)."""

    def __init__(self, cert: str, key: str, client_ca: str | None, check_interval_s: float = CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = (cert, key, *((client_ca,) if client_ca else ()))
        self.flags = ("--tls-cert", "--tls-key", "--tls-client-ca")
        self.check_interval_s, self.clock = check_interval_s, clock
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self.config = self._load()  # NOTE: at start a bad file is an error (InvalidArgument), later a warning
        self._next_check = clock() + check_interval_s
        self.num_reloads = 0

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed since the last load, else None (keep it)."""
        with self._lock:
            now = self.clock()
            if now < self._next_check:
                return None
            self._next_check = now + self.check_interval_s
            stamp = self._stat()
            if stamp == self._stamp:
                return None
            try:
                config = self._load()
            except (InvalidArgument, ssl.SSLError, OSError) as e:
                log.warning("TLS files changed but do not load (%s); still serving the previous certificate, "
                            "trying again in %gs", e, self.check_interval_s)
                return None
            if self._stat() != stamp:
                return None  # changed while read: load them at the next check
            self._stamp, self.config = stamp, config
            self.num_reloads += 1
            log.info("TLS: reloaded %s", ", ".join(self.paths))
            return config

    def _stat(self) -> Stamp:
        return file_stamp(self.paths)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        cert, key = self.paths[0], self.paths[1]
        data = [_read(path, flag) for path, flag in zip(self.paths, self.flags, strict=False)]
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)  # the key fits the cert
        except ssl.SSLError as e:
            raise InvalidArgument(f"--tls-key {key} does not match --tls-cert {cert} ({e.reason})") from None
        return grpc.ssl_server_certificate_configuration([(data[1], data[0])],
                                                         root_certificates=data[2] if len(data) > 2 else None)


def file_stamp(paths: tuple[str, ...]) -> Stamp:
    """(mtime, inode, size) of each file, (-1, -1, -1) for one that cannot be read: a change in any is a renewal."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)  # follows the Secret volume's symlinks
            out.append((st.st_mtime_ns, st.st_ino, st.st_size))
        except OSError:
            out.append((-1, -1, -1))
    return tuple(out)


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{flag} {path}: cannot read it ({e.strerror}); give a PEM file") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"{flag} {path} is not PEM (no '-----BEGIN' line)")
    return data
