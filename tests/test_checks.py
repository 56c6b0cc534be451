"""values: ints and numbers, never bools, in every check that goes through them; the argument checks' errors name
the argument, what it must be and what was given."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from her_store.checks import (
    ArgumentTypeError,
    check_bool,
    check_bounds,
    check_callable,
    check_int,
    check_number,
    is_int,
    is_number,
)


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


def test_check_int_takes_ints_numpy_ints_and_what_the_bounds_allow():
    for v in (7, np.int64(7), np.uint8(7), np.int32(7)):
        got = check_int(v, "n", low=1, high=7)
        assert got == 7 and type(got) is int
    assert check_int(None, "n", or_none=True) is None
    assert check_int(2**70, "seed", low=0) == 2**70


@pytest.mark.parametrize(
    ("v", "kw", "error", "message"),
    [
        (True, {"low": 1}, ArgumentTypeError, "batch_size must be an int >= 1, not a bool: got True"),
        (2.5, {"low": 1}, ArgumentTypeError, "batch_size must be an int >= 1, not a float: got 2.5"),
        ("8", {}, ArgumentTypeError, "batch_size must be an int, not a str: got '8'"),
        (None, {"low": 1}, ArgumentTypeError, "batch_size must be an int >= 1, not None: got None"),
        (np.bool_(True), {"low": 0, "or_none": True}, ArgumentTypeError,
         f"batch_size must be an int >= 0 or None, not a {type(np.bool_(True)).__name__}: got {np.bool_(True)!r}"),
        (0, {"low": 1}, ValueError, "batch_size must be an int >= 1: got 0"),
        (-3, {"low": 0, "or_none": True}, ValueError, "batch_size must be an int >= 0 or None: got -3"),
        (65, {"low": 1, "high": 64}, ValueError, "batch_size must be an int in [1, 64]: got 65"),
        (2**64, {"high": 2**63 - 1}, ValueError, f"batch_size must be an int <= {2**63 - 1}: got {2**64}"),
    ],
)
def test_check_int_refuses_naming_the_argument_what_it_must_be_and_what_was_given(v, kw, error, message):
    with pytest.raises(error) as e:
        check_int(v, "batch_size", **kw)
    assert str(e.value) == message
    if error is ArgumentTypeError:  # a wrong type is both: callers catching either see it
        assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


def test_check_number_bounds_finiteness_and_types():
    assert check_number(np.float32(0.25), "f", low=0, high=0.5, low_open=True) == 0.25
    assert check_number(3, "f") == 3.0 and type(check_number(3, "f")) is float
    assert check_number(math.inf, "seconds", low=0) == math.inf
    assert check_number(None, "seconds", low=0, or_none=True) is None
    for v, kw, error, message in [
        (0.0, {"low": 0, "high": 0.5, "low_open": True}, ValueError, "f must be a real number in (0, 0.5]: got 0.0"),
        (0.6, {"low": 0, "high": 0.5, "low_open": True}, ValueError, "f must be a real number in (0, 0.5]: got 0.6"),
        (1.0, {"low": 0, "high": 1, "high_open": True}, ValueError, "f must be a real number in [0, 1): got 1.0"),
        (math.nan, {"low": 0}, ValueError, "f must be a real number >= 0: got nan"),
        (math.inf, {"finite": True}, ValueError, "f must be a finite real number: got inf"),
        (False, {}, ArgumentTypeError, "f must be a real number, not a bool: got False"),
        ("1", {"finite": True}, ArgumentTypeError, "f must be a finite real number, not a str: got '1'"),
    ]:
        with pytest.raises(error) as e:
            check_number(v, "f", **kw)
        assert str(e.value) == message
    with pytest.raises(ValueError, match=r"^f must be >= 0: got -1$"):
        check_bounds(-1, "f", low=0)


def test_check_bool_and_check_callable():
    assert check_bool(np.bool_(False), "flag") is False and check_bool(None, "flag", or_none=True) is None
    with pytest.raises(ArgumentTypeError, match=r"^flag must be True or False, not an int: got 1$"):
        check_bool(1, "flag")
    assert check_callable(len, "fn") is len and check_callable(None, "fn", or_none=True) is None
    with pytest.raises(ArgumentTypeError, match=r"^fn must be a callable or None, not a str: got 'x'$"):
        check_callable("x", "fn", or_none=True)


def test_paths_options_and_names_are_checked_where_a_store_is_opened_or_made(tmp_path, monkeypatch):
    """An empty path was the current directory (a store written into it), a str of info_keys its characters, an int
    storage_options a TypeError of Python's; each is refused naming the argument, and nothing is written."""
    from her_store import EpisodeStore, open_dataset, open_store
    from tests.conftest import fetch_spaces

    obs, act = fetch_spaces()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="path_or_url is empty"):
        open_store("", obs, act)
    with pytest.raises(ValueError, match="path_or_url is empty"):
        EpisodeStore.open("")
    with pytest.raises(TypeError, match="path_or_url must be a path or URL"):
        open_store(5, obs, act)
    for call in (lambda: EpisodeStore.open(tmp_path, storage_options=5), lambda: open_dataset(tmp_path, 5)):
        with pytest.raises(TypeError, match=r"storage_options must be a mapping \(a dict\) of names or None"):
            call()
    for bad, error, words in (
        ("is_success", TypeError, "info_keys must be a list of names, not a str"),
        (5, TypeError, "info_keys must be a list of names, not an int"),
        ([5], TypeError, "info_keys must hold non-empty strings: got 5"),
        (["a", "a"], ValueError, r"info_keys names \['a'\] more than once"),
    ):
        with pytest.raises(error, match=words):
            EpisodeStore.create(tmp_path / "s", obs, act, info_keys=bad)
    assert os.listdir(tmp_path) == []


def test_ids_and_indexes_are_ints_not_bools_floats_or_strings(tmp_path):
    """episode(True) read episode 1, episode(2.5) episode 2, env_index=-7 was stored, pending(True) a numpy error."""
    from her_store import EpisodeStore
    from tests.conftest import fetch_spaces, make_episode

    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act) as store:
        store.append_episode(make_episode(obs, act, 3, 0))
        store.append_episode(make_episode(obs, act, 3, 1))
        for bad in (True, 2.5, "0", float("nan")):
            with pytest.raises(TypeError, match="episode_id must be an int"):
                store.episode(bad)
        for bad, words in ((True, "not a bool"), (2.5, "not a float"), (-7, "got -7"), (2**31, "got 2147483648")):
            words = rf"env_index must be an int in \[-1, 2147483647\].*{words}"
            with pytest.raises((TypeError, ValueError), match=words):
                store.append_episode(make_episode(obs, act, 3, 2), env_index=bad)
        assert store.num_episodes == 2 and store.episode(np.int64(1)).id == 1
        # an id as a batch hands it out (an element of a torch tensor) is an int
        torch = pytest.importorskip("torch")
        assert store.episode(torch.tensor([0, 1])[1]).id == 1
        for bad in (torch.tensor(True), torch.tensor(1.0), torch.tensor([1])):
            with pytest.raises(TypeError, match="episode_id must be an int"):
                store.episode(bad)
        writer = store.writer(2)
        for bad in (True, 1.0):
            with pytest.raises(TypeError, match="env must be an int"):
                writer.pending(bad)
