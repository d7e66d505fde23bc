"""Store URLs never show a credential (issue #31 item 6): every form redis-py's URL parser reads a
password or user name from is redacted in the controller's log line and in GetFleet, and a reader
token gets no store URL at all (only the operator does, redacted).

NOTE: `redis://host/0?password=...` (a form redis-py accepts) used to be printed and returned
verbatim, even to a reader token.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import grpc
import pytest
from redis.connection import parse_url
from support.controller import make_tokens, md, start_controller, store_url

from controller.auth import mint_token
from controller.servicers.fleet import redact
from fleet.api.kvfleet.v1 import fleet_pb2
from fleet.api.kvfleet.v1.fleet_pb2_grpc import FleetServiceStub

SECRET = "hunter2-s3cr3t"
URLS = [
    f"redis://db:6379/0?password={SECRET}",
    f"redis://db/0?username=admin-{SECRET}&password={SECRET}",
    f"redis://db/0?pass%77ord={SECRET}",  # the parser decodes the parameter's name
    f"redis://db/0?password={quote(SECRET + '@/?&')}",
    f"redis://user-{SECRET}:{SECRET}@db:6379/0",
    f"redis://:{SECRET}@@db:6379/0",
    f"rediss://default:{SECRET}@db:6380/0?ssl_cert_reqs=none",
    f"unix://:{SECRET}@/var/run/redis.sock?db=0",
    f"unix:///var/run/redis.sock?db=0&password={SECRET}",
    f"redis://db/0?client_name=x&socket_timeout=5&password={SECRET}",
]


@pytest.mark.parametrize("url", URLS)
def test_every_credential_form_the_parser_reads_is_redacted(url: str) -> None:
    parsed = parse_url(url)
    creds = [v for k, v in parsed.items() if k in ("password", "username")]
    assert any(SECRET in str(v) for v in creds), f"control: redis-py reads a credential from {url}"
    shown = redact(url)
    print(url, "->", shown)
    assert SECRET not in shown and quote(SECRET) not in shown and "s3cr3t" not in shown
    assert shown.split(":", 1)[0] == url.split(":", 1)[0]  # still says which store it is


def test_what_is_not_a_credential_stays() -> None:
    assert redact("redis://db:6379/0") == "redis://db:6379/0"
    assert redact("sqlite:///var/a@b.db") == "sqlite:///var/a@b.db"
    assert "db=3" in redact("redis://db/0?db=3&password=x") and "x" not in redact("redis://db/0?password=x").split("?")[1]


async def test_a_reader_gets_no_store_url_and_the_operator_a_redacted_one(tmp_path: Path) -> None:
    tok = make_tokens(tmp_path)
    reader = mint_token(tok.file, "proxy", "reader")
    ctl = await start_controller(store_url("sqlite", tmp_path), tok)
    ctl.ctx.store_url = f"redis://db:6379/0?password={SECRET}"  # what GetFleet would answer on Redis
    try:
        async with grpc.aio.insecure_channel(ctl.address) as ch:
            stub = FleetServiceStub(ch)
            as_reader = await stub.GetFleet(fleet_pb2.GetFleetRequest(), metadata=md(reader))
            as_operator = await stub.GetFleet(fleet_pb2.GetFleetRequest(), metadata=md(tok.op))
    finally:
        await ctl.stop(0)
    print(repr(as_reader.store), repr(as_operator.store))
    assert SECRET not in as_operator.store and as_operator.store.startswith("redis://db:6379/0")
    assert as_reader.store in ("", "redis")  # the kind of store at most, never its address
