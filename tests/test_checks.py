"""values: ints and numbers, never bools, in every check that goes through them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from her_store.checks import is_int, is_number


@pytest.mark.parametrize("v", [0, -3, 2**70, np.int8(1), np.uint64(5), np.int64(-1)])
def test_ints(v):
    assert is_int(v) and is_number(v) and is_number(v, finite=True)


@pytest.mark.parametrize("v", [True, False, np.bool_(True), 1.0, np.float32(2), "3", None, [1], 1 + 0j])
def test_not_ints(v):
    assert not is_int(v)


@pytest.mark.parametrize("v", [True, np.bool_(False), "1.5", None, 1j, [0.5]])
def test_not_numbers(v):
    assert not is_number(v) and not is_number(v, finite=True)


@pytest.mark.parametrize("v", [math.inf, -math.inf, math.nan, np.float32("nan"), np.float64("inf")])
def test_numbers_that_are_not_finite(v):
    assert is_number(v) and not is_number(v, finite=True)


def test_a_bool_where_a_count_belongs_is_refused_with_its_name(tmp_path):
    """Through the API: capacity=True would be a ring of one transition if bools counted as ints."""
    from her_store import EpisodeStore
    from tests.conftest import fetch_spaces

    obs, act = fetch_spaces()
    with pytest.raises(ValueError, match="capacity"):
        EpisodeStore.create(str(tmp_path / "s"), obs, act, capacity=True)
    with EpisodeStore.create(str(tmp_path / "t"), obs, act, capacity=np.int64(100)) as store:
        assert store.capacity == 100
        with pytest.raises(ValueError, match="commit_interval"):
            store.commit_interval = True
        store.commit_interval = np.float32(0.5)
        assert store.commit_interval == 0.5
