"""fleet/core/whole.py: the one whole-number argparse type of the CLI and the controller's flags."""

from __future__ import annotations

import argparse

import pytest

from fleet.core.whole import whole


def test_whole_takes_its_range_and_says_what_it_wanted() -> None:
    assert whole()("0") == 0 and whole(1, 1000)("1000") == 1000 and whole(1)("12") == 12
    for parse, text, said in ((whole(zero_means="until Ctrl-C"), "-1", "-1: give 0 (until Ctrl-C) or more"),
                              (whole(1), "0", "0: give 1 or more"), (whole(1, 1000), "1001", "1001: expected 1 to 1000"),
                              (whole(), "2.5", "'2.5' is not a whole number"), (whole(), "", "'' is not a whole number")):
        with pytest.raises(argparse.ArgumentTypeError, match=said.replace("(", r"\(").replace(")", r"\)")):
            parse(text)
