"""Format: the commit record and the packing of fields into arrays."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gymnasium import spaces

from her_store.errors import CorruptStoreError, FormatVersionError, NotAStoreError
from her_store.format import FORMAT_VERSION, Commit, Layout, check_attrs
from her_store.schema import Schema


def test_commit_record_round_trip_and_checks():
    c = Commit(generation=4, first_episode=2, end_episode=9, write_row=300, num_transitions=250, array_rows=512)
    assert Commit.from_bytes(c.to_bytes(), "s") == c
    body = json.loads(c.to_bytes())
    body["end_episode"] = 10
    with pytest.raises(CorruptStoreError, match="crc32"):
        Commit.from_bytes(json.dumps(body).encode(), "s")
    bad = Commit(generation=1, first_episode=5, end_episode=3)
    with pytest.raises(CorruptStoreError, match="inconsistent"):
        Commit.from_bytes(bad.to_bytes(), "s")
    with pytest.raises(CorruptStoreError, match="unreadable"):
        Commit.from_bytes(b"", "s")


def test_layout_packs_uncompressed_fields_by_dtype_and_isolates_compressed_ones():
    goal = spaces.Box(-1, 1, (3,), np.float32)
    obs = spaces.Dict(
        {"observation": spaces.Box(-1, 1, (10,)), "achieved_goal": goal, "desired_goal": goal,
         "pixels": spaces.Box(0, 255, (3, 84, 84), np.uint8)}
    )
    schema = Schema(obs, spaces.Discrete(3), ["is_success"])
    layout = Layout.build(schema, {"pixels"}, chunk_rows=4096)
    paths = [a.path for a in layout.arrays]
    assert paths == ["packs/float32", "packs/int64", "packs/bool", "steps/pixels"]
    f32 = layout.arrays[0]
    assert f32.row_shape == (18,) and sum(b - a for _, a, b in f32.columns) == 18
    pixels = layout.arrays[-1]
    assert pixels.compressed and pixels.chunk_rows == 8  # ~256 KiB of 21,168-byte rows, a power of two
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))).to_json() == layout.to_json()


def test_check_attrs():
    assert check_attrs({"her_store": {"format_version": FORMAT_VERSION}}, "s")["format_version"] == FORMAT_VERSION
    with pytest.raises(NotAStoreError):
        check_attrs({}, "s")
    with pytest.raises(FormatVersionError, match="upgrade"):
        check_attrs({"her_store": {"format_version": FORMAT_VERSION + 1}}, "s")
    with pytest.raises(CorruptStoreError, match="format_version"):
        check_attrs({"her_store": {"format_version": "1"}}, "s")
