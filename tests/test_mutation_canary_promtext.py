"""canary.promtext, what its own tests left unheld (issue 27's mutation run over the
canary's core): `-Inf` read as minus infinity, and a bad line quoted to 120 characters."""

from __future__ import annotations

import math

import pytest

from sglang_farm.canary import promtext


def test_minus_inf_is_read_as_minus_infinity() -> None:
    s = promtext.parse("g -Inf\nh +Inf\n")
    assert s.total("g") == -math.inf
    assert s.total("h") == math.inf


def test_a_bad_line_is_quoted_to_its_first_120_characters() -> None:
    line = "!" + "x" * 200
    with pytest.raises(ValueError) as err:
        promtext.parse(f"a 1\n{line}\n", source="w")
    assert str(err.value) == f"w:2: not a Prometheus sample line: {line[:120]!r}"
