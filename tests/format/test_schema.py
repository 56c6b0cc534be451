"""Schema: fields from gymnasium spaces and the JSON form of spaces."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium import spaces

from her_store.errors import SchemaMismatchError
from her_store.format.schema import MAX_NAME_BYTES, Schema, space_from_json, space_to_json

SPACES = [
    spaces.Box(-1.0, 1.0, (3,), np.float32),
    spaces.Box(-np.inf, np.inf, (2, 2), np.float64),
    spaces.Box(np.array([0.0, -1.0]), np.array([1.0, np.inf]), (2,), np.float32),
    spaces.Box(0, 255, (3, 8, 8), np.uint8),
    spaces.Discrete(5, start=-2),
    spaces.MultiBinary(4),
    spaces.MultiBinary([2, 3]),
    spaces.MultiDiscrete([3, 4]),
    spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Box(-1, 1, (1,))}),
    spaces.Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (2,), np.int64),  # not through float64
    spaces.Box(np.array([0, -5]), np.array([2**62 + 1, 7]), (2,), np.int64),
    spaces.Box(0, 1, (), np.bool_),  # a flag as an info key: bounds False/True
    spaces.Box(np.array([False, True]), np.array([True, True]), (2,), np.bool_),
]


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_space_json_round_trip_is_strict_json(space):
    text = json.dumps(space_to_json(space), allow_nan=False)  # no NaN/Infinity literals
    assert space_from_json(json.loads(text)) == space


def test_uniform_image_bounds_are_stored_as_one_number():
    d = space_to_json(spaces.Box(0, 255, (3, 84, 84), np.uint8))
    assert d["low"] == 0 and d["high"] == 255


def test_fields_in_schema_order_with_rows_per_episode():
    goal = spaces.Box(-1, 1, (3,), np.float32)
    obs = spaces.Dict({"observation": spaces.Box(-1, 1, (5,)), "achieved_goal": goal, "desired_goal": goal})
    schema = Schema(obs, spaces.Discrete(4), info_keys={"is_success": spaces.Box(0, 1, (), np.float32)})
    by = schema.by_name
    assert [f.name for f in schema.fields][-5:] == ["action", "reward", "terminated", "truncated", "is_success"]
    assert not by["observation"].per_step and by["action"].per_step
    assert by["action"].dtype == np.int64 and by["action"].shape == ()
    assert by["terminated"].dtype == np.bool_ and by["reward"].dtype == np.float32
    assert Schema.from_json(json.loads(json.dumps(schema.to_json()))).to_json() == schema.to_json()


def test_check_same_names_the_difference():
    goal = spaces.Box(-1, 1, (3,), np.float32)
    obs = spaces.Dict({"observation": spaces.Box(-1, 1, (5,)), "achieved_goal": goal, "desired_goal": goal})
    a = Schema(obs, spaces.Discrete(4))
    b = Schema(obs, spaces.Discrete(5))
    with pytest.raises(SchemaMismatchError, match="action_space differs.*'n': 4.*'n': 5"):
        b.check_same(a, "here")


def test_unknown_space_type_in_metadata():
    with pytest.raises(SchemaMismatchError, match="unknown space type 'Graph'"):
        space_from_json({"type": "Graph"})


def test_integer_bounds_outside_their_dtype_are_refused():
    d = space_to_json(spaces.Box(0, 255, (2,), np.uint8))
    d["high"] = 256
    with pytest.raises(SchemaMismatchError, match=r"do not fit uint8 \(0..255\)"):
        space_from_json(d)


def test_a_field_name_longer_than_a_file_name_holds_is_refused():
    """An image field is a directory named after it: a 300-character observation key failed the store's creation
    with a bare 'File name too long' (from an import's header, naming neither the key nor the header)."""
    long = "k" * (MAX_NAME_BYTES + 1)
    obs = spaces.Dict({k: spaces.Box(-1, 1, (3,), np.float32) for k in ("observation", "achieved_goal", "desired_goal")}
                      | {long: spaces.Box(0, 255, (2, 4, 4), np.uint8)})
    with pytest.raises(SchemaMismatchError, match=f"at most {MAX_NAME_BYTES} bytes of UTF-8"):
        Schema(obs, spaces.Box(-1, 1, (2,), np.float32))
    image = obs.spaces.pop(long)
    obs = spaces.Dict({**obs.spaces, "é" * (MAX_NAME_BYTES // 2): image})  # 2 bytes a character: at the bound
    assert Schema(obs, spaces.Box(-1, 1, (2,), np.float32)).by_name["é" * (MAX_NAME_BYTES // 2)]


def test_an_integer_a_float_dtype_would_round_is_refused_even_where_numpy_calls_the_cast_safe():
    """numpy casts int64 to float64 as "safe", and 2**53 + 1 became 2**53 without a word."""
    from her_store.errors import EpisodeValidationError
    from her_store.format.schema import Field, conform

    f64 = Field("x", np.dtype("<f8"), (), True, "info")
    np.testing.assert_array_equal(conform(np.array([2**53, -(2**63)], np.int64), f64, None, "x"), [2.0**53, -(2.0**63)])
    for bad in (np.array([3, 2**53 + 1], np.int64), np.array([2**64 - 1], np.uint64)):
        with pytest.raises(EpisodeValidationError, match="which float64 cannot hold exactly"):
            conform(bad, f64, None, "x")
