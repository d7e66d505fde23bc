"""Client-side TLS command-line options of FleetClient, shared by the CLI verbs that talk to the controller
and by `kvfleet proxy` (here, in the SDK layer, so the proxy need not import the CLI).

    kvfleet worker ls --tls-ca ca.pem                                   # TLS, verify with this CA
    kvfleet worker ls --tls-ca ca.pem --tls-cert me.pem --tls-key me.key  # mutual TLS

Environment (flags win): KVFLEET_TLS_CA, KVFLEET_TLS_CLIENT_CERT, KVFLEET_TLS_CLIENT_KEY.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any


def add_client_tls(p: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """--tls, --tls-ca, --tls-cert, --tls-key (client side)."""
    e = (os.environ if env is None else env).get
    p.add_argument("--tls", action="store_true",
                   help="talk TLS to the controller (implied by --tls-ca / --tls-cert; system CAs without --tls-ca)")
    p.add_argument("--tls-ca", default=e("KVFLEET_TLS_CA"), metavar="PEM",
                   help="CA certificate that signed the controller's certificate")
    p.add_argument("--tls-cert", default=e("KVFLEET_TLS_CLIENT_CERT"), metavar="PEM",
                   help="this client's certificate, for a controller that requires mutual TLS (--tls-client-ca)")
    p.add_argument("--tls-key", default=e("KVFLEET_TLS_CLIENT_KEY"), metavar="PEM",
                   help="the private key of --tls-cert")


def client_tls(args: argparse.Namespace) -> dict[str, Any]:
    """FleetClient keyword arguments from the flags of add_client_tls."""
    return {"tls": bool(args.tls), "root_certificates": args.tls_ca, "client_cert": args.tls_cert,
            "client_key": args.tls_key}
