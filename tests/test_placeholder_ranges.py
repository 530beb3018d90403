"""The server's range check of ``protocol.placeholder_ranges``: ``check_range`` (and through it
``check_length``)."""

from __future__ import annotations

import pytest

from protocol.errors import InvalidRequest, PlaceholderMismatch
from protocol.placeholder_ranges import check_range

P = 261  # <|image_pad|> of the tiny Qwen models
T = 7  # some text token


IDS = [T, T, P, P, P, T, P]


def test_check_range_accepts_exact_range():
    check_range(IDS, {"offset": 2, "length": 3}, P, 3, "r")
    check_range(IDS, {"offset": 6, "length": 1}, P, 1, "r")


@pytest.mark.parametrize(
    "placeholder",
    [
        {"offset": 7, "length": 1},  # starts past the end
        {"offset": 100, "length": 1},
        {"offset": 6, "length": 2},  # runs past the end
        {"offset": -1, "length": 1},  # negative offset (would wrap in Python slicing)
        {"offset": -5, "length": 3},
    ],
)
def test_check_range_out_of_bounds(placeholder):
    expected = placeholder["length"]
    with pytest.raises(PlaceholderMismatch) as info:
        check_range(IDS, placeholder, P, expected, "r-oob")
    assert info.value.ref == "r-oob"
    assert str(P) in str(info.value)


@pytest.mark.parametrize(("length", "expected"), [(2, 3), (4, 3), (0, 3)])
def test_check_range_wrong_length(length, expected):
    with pytest.raises(PlaceholderMismatch) as info:
        check_range(IDS, {"offset": 2, "length": length}, P, expected, "r-len")
    assert f"length {length}" in str(info.value)
    assert f"needs {expected}" in str(info.value)
    assert info.value.ref == "r-len"


@pytest.mark.parametrize(
    "placeholder",
    [
        {"offset": 1, "length": 3},  # starts on a text token
        {"offset": 3, "length": 3},  # ends on a text token
        {"offset": 0, "length": 2},  # text only
        {"offset": 4, "length": 3},  # spans the gap between two runs
    ],
)
def test_check_range_non_placeholder_tokens(placeholder):
    with pytest.raises(PlaceholderMismatch) as info:
        check_range(IDS, placeholder, P, placeholder["length"], "r-tok")
    assert f"placeholder id {P}" in str(info.value)


@pytest.mark.parametrize("placeholder", [{}, {"offset": 2}, {"length": 3}, {"offset": None, "length": 3}])
def test_check_range_malformed_entry(placeholder):
    with pytest.raises(InvalidRequest):
        check_range(IDS, placeholder, P, 3, "r")
