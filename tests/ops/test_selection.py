"""Episode selections: ids, ranges, negatives from the end, clipping to the live episodes, and errors."""

import numpy as np
import pytest

from her_store.ops.selection import parse_selection


@pytest.mark.parametrize(
    "text, first, end, want",
    [
        (None, 3, 7, [3, 4, 5, 6]),
        ("", 0, 2, [0, 1]),
        ("0:3,7,-1:", 0, 10, [0, 1, 2, 7, 9]),
        ("5:", 3, 9, [5, 6, 7, 8]),
        (":5", 3, 9, [3, 4]),
        (":2", 3, 9, []),  # ids, not positions: below the live range
        ("-2:", 3, 9, [7, 8]),
        (":-7", 3, 9, []),
        ("4,4,3", 3, 9, [3, 4]),
        (" 1 : 3 , 0 ", 0, 5, [0, 1, 2]),
        ("0:100", 10, 12, [10, 11]),  # clipped to the live episodes
    ],
)
def test_selection(text, first, end, want):
    got = parse_selection(text, first, end)
    assert got.dtype == np.int64
    assert got.tolist() == want


@pytest.mark.parametrize("text, message", [("x", "not an id N or a range"), ("1:2:3", "not an id N"), ("", None),
                                           ("12", "episode 12 is not live"), ("-9", "episode -9 is not live"),
                                           ("2", "episode 2 is not live"), (",", "not an id N")])
def test_selection_errors(text, message):
    if message is None:
        assert parse_selection(text, 3, 8).tolist() == [3, 4, 5, 6, 7]
        return
    with pytest.raises(ValueError, match=message):
        parse_selection(text, 3, 8)
