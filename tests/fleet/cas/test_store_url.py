"""A store URL the store cannot open is refused without echoing its credentials (issue #31, a caveat of item 6)."""

from __future__ import annotations

import pytest

from fleet.cas import open_store
from fleet.core.errors import InvalidArgument


@pytest.mark.parametrize("url", ["mongodb://admin:s3cr3t-pw@db.example:27017/0",
                                 "memcached://db.example:11211/?password=s3cr3t-pw",
                                 "postgres://:s3cr3t-pw@db.example/kv"])
def test_an_unknown_scheme_is_refused_without_its_password(url: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        open_store(url)
    msg = str(e.value)
    assert "s3cr3t-pw" not in msg
    assert url.split("://")[0] in msg and "db.example" in msg  # control: it still names what was given
