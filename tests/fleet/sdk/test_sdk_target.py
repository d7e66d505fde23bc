"""A client's controller address is checked before anything is sent (fleet/sdk/target.py).

NOTE: before, gRPC took `HOST:99999` as port 34463 (modulo 2**16) and sent the bearer token to whatever listened
there; an empty address printed gRPC's C++ errors and raised KvfleetError UNKNOWN; a malformed one (`[::1`,
`not an address`) was retried for the whole retry deadline and then called an unreachable controller.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from support.controller import make_tokens, start_controller, store_url

from fleet.core.errors import InvalidArgument
from fleet.sdk import AsyncFleetClient, FleetClient, RetryPolicy

SHORT = RetryPolicy(deadline_s=1.0)


def test_a_port_past_65535_never_reaches_the_port_it_wraps_to() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        with pytest.raises(InvalidArgument, match=f"port '{port + 65536}' is not a number in 1..65535"):
            with FleetClient(f"127.0.0.1:{port + 65536}", "kvf_secret", retry=SHORT, timeout=1.0) as c:
                c.whoami()
        with pytest.raises(TimeoutError):  # nothing connected to the port it wraps to
            listener.accept()[0].close()


@pytest.mark.parametrize(("address", "says"), [
    ("", "is not an address"), ("not an address", "is not an address"), ("127.0.0.1:50051\n", "is not an address"),
    ("[::1", "IPv6 address is written"), ("::1:50051", "in brackets"), ("127.0.0.1:abc", "port 'abc'"),
    ("127.0.0.1:0", "port '0'"), ("127.0.0.1:", "port ''"), (":50051", "names no host"), (50051, "must be a str"),
    # NOTE: a URL was called an IPv6 address outside brackets, or a port '//HOST' (review finding)
    ("http://127.0.0.1:50051", r"is a URL \(http://\)"), ("https://ctl.example.com:443", r"is a URL \(https://\)"),
    ("grpc://127.0.0.1:50051", r"is a URL \(grpc://\)"), ("http://127.0.0.1", r"is a URL \(http://\)")])
async def test_a_malformed_address_is_invalid_argument_naming_it(address: object, says: str) -> None:
    for make in (FleetClient, AsyncFleetClient):
        with pytest.raises(InvalidArgument, match=f"the controller's address.*{says}"):
            make(address, retry=SHORT)  # type: ignore[arg-type]


async def test_every_form_of_a_good_address_still_reaches_the_controller(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    try:
        port = ctl.address.rsplit(":", 1)[1]
        for address in (ctl.address, f"localhost:{port}", f"dns:///127.0.0.1:{port}", f"ipv4:127.0.0.1:{port}"):
            async with AsyncFleetClient(address, tok.a, retry=SHORT) as c:
                assert (await c.whoami()).tenant == "acme", address
            who = await asyncio.to_thread(_whoami, address, tok.a)
            assert who.tenant == "acme", address  # type: ignore[attr-defined]
    finally:
        await ctl.stop(0)


def _whoami(address: str, token: str) -> object:
    with FleetClient(address, token, retry=SHORT) as c:
        return c.whoami()


@pytest.mark.parametrize("setting", ["timeout", "blob_timeout", "session_timeout"])
@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), "10", True, None])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused(setting: str, bad: object) -> None:
    # before: -1, 0, nan and inf failed every call with "deadline exceeded ... the controller is slow or
    # unreachable" (the controller was fine); "10" raised TypeError from inside the retry loop
    for make in (FleetClient, AsyncFleetClient):
        with pytest.raises(InvalidArgument, match=f"^{setting} must be a"):
            make("127.0.0.1:50051", **{setting: bad})  # type: ignore[arg-type]
    with FleetClient("127.0.0.1:50051", **{setting: 2}) as c:  # control: a whole number of seconds is one
        assert getattr(c, setting) == 2.0
