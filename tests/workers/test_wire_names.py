"""The exceptions a kernel host raises keep the names they travel under (Ray pickles them by module and name), so a
controller and detached hosts of neighbouring releases still understand each other's errors after a code move."""

from __future__ import annotations

import pickle

import pytest

from workers import session_kernel
from workers.session_ops import SessionGone, SessionTorn


@pytest.mark.parametrize("cls", [SessionGone, SessionTorn])
def test_a_session_error_travels_under_the_session_kernel_module(cls: type[Exception]) -> None:
    raw = pickle.dumps(cls("gone"))
    assert b"workers.session_kernel" in raw and b"workers.session_ops" not in raw
    back = pickle.loads(raw)
    assert type(back) is getattr(session_kernel, cls.__name__) and str(back) == "gone"
