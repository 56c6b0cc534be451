"""Format: the commit record and the packing of fields into arrays."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from gymnasium import spaces

from her_store.errors import CorruptStoreError, FormatVersionError, NotAStoreError
from her_store.format.commit_record import Commit
from her_store.format.layout import (
    FLAT_SHARD_KEYS_SINCE,
    FORMAT_VERSION,
    SHARDED_SINCE,
    Layout,
    check_attrs,
    parse_attrs,
)
from her_store.format.schema import Schema

GOAL = spaces.Box(-1, 1, (3,), np.float32)
OBS = spaces.Dict(
    {"observation": spaces.Box(-1, 1, (10,)), "achieved_goal": GOAL, "desired_goal": GOAL,
     "pixels": spaces.Box(0, 255, (3, 84, 84), np.uint8)}
)
SCHEMA = Schema(OBS, spaces.Discrete(3), ["is_success"])


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


def _record(**changes) -> bytes:
    """A commit record with a valid crc32 over whatever its body holds."""
    body = json.loads(Commit(1, 0, 2, 8, 6, 16).to_bytes())
    del body["crc32"]
    body.update(changes)
    body = {k: v for k, v in body.items() if v is not ...}
    body["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "changes, msg",
    [
        ({"end_episode": 2.0}, r"has \{'end_episode': 2.0\}, expected non-negative integers"),
        ({"end_episode": "2"}, "expected non-negative integers"),
        ({"end_episode": True}, "expected non-negative integers"),
        ({"end_episode": None}, "expected non-negative integers"),
        ({"write_row": -1}, "expected non-negative integers"),
        ({"array_rows": 2**63}, "expected non-negative integers"),
        ({"format_version": "1"}, "expected non-negative integers"),
        ({"end_episode": ...}, "has keys"),
        ({"extra": 1}, "has keys"),
        ({"end_episode": 10**9}, "inconsistent"),  # more episodes than transitions
        ({"num_transitions": 15}, "inconsistent"),  # 15 transitions and 2 episodes need 17 of 16 rows
        ({"write_row": 17}, "inconsistent"),
        ({"first_episode": 2}, "inconsistent"),  # no episode, 6 transitions
    ],
)
def test_commit_record_fields_are_checked_even_with_a_valid_crc(changes, msg):
    assert Commit.from_bytes(_record(), "s") == Commit(1, 0, 2, 8, 6, 16)
    with pytest.raises(CorruptStoreError, match=msg):
        Commit.from_bytes(_record(**changes), "s")


def test_commit_record_says_the_format_version_of_its_store():
    c = Commit(generation=4, first_episode=2, end_episode=9, write_row=300, num_transitions=250, array_rows=512)
    assert json.loads(c.to_bytes())["format_version"] == FORMAT_VERSION
    assert json.loads(c.to_bytes(1))["format_version"] == 1 and Commit.from_bytes(c.to_bytes(1), "s") == c


def test_commit_record_that_is_not_an_object():
    for raw in (b"[1, 2]", b"null", b"[" * 100_000, b"\xff\xfe"):
        with pytest.raises(CorruptStoreError, match="commit.json"):
            Commit.from_bytes(raw, "s")


def test_commit_record_must_fit_the_store_and_its_arrays():
    c = Commit(1, 0, 2, 8, 6, 16)
    c.check_fits(None, None, 16, 2, "s")
    c.check_fits(12, 12, 32, 12, "s")
    with pytest.raises(CorruptStoreError, match="array_rows 16 exceeds the 15 rows of the data arrays"):
        c.check_fits(None, None, 15, 2, "s")
    with pytest.raises(CorruptStoreError, match="end_episode 2 exceeds the 1 rows of the index arrays"):
        c.check_fits(None, None, 16, 1, "s")
    with pytest.raises(CorruptStoreError, match="index_slots 12 exceed the 8 rows"):
        c.check_fits(12, 12, 16, 8, "s")
    with pytest.raises(CorruptStoreError, match="num_transitions 6 exceeds capacity 5"):
        c.check_fits(5, 5, 16, 8, "s")
    with pytest.raises(CorruptStoreError, match="array_rows 16 cannot hold an episode of capacity 16"):
        c.check_fits(16, 16, 16, 16, "s")


def test_layout_packs_uncompressed_fields_by_dtype_and_isolates_compressed_ones():
    layout = Layout.build(SCHEMA, {"pixels"}, chunk_rows=4096)
    paths = [a.path for a in layout.arrays]
    assert paths == ["packs/float32", "packs/int64", "packs/bool", "steps/pixels"]
    f32 = layout.arrays[0]
    assert f32.row_shape == (18,) and sum(b - a for _, a, b in f32.columns) == 18
    pixels = layout.arrays[-1]
    # a shard of ~8 MiB of 21,168-byte rows, a power of two, each row its own inner chunk
    assert pixels.compressed and pixels.sharded and pixels.chunk_rows == 256
    assert layout.version == FORMAT_VERSION >= FLAT_SHARD_KEYS_SINCE == 3 and layout.to_json()[-1]["sharded"] is True
    assert not any(a.sharded for a in layout.arrays[:-1])
    assert Layout.from_json(json.loads(json.dumps(layout.to_json())), SCHEMA, "s").to_json() == layout.to_json()
    # a shard is one file named by its index, the other arrays' chunks a file under a directory per axis
    assert [a.separator for a in layout.arrays] == ["/", "/", "/", "."]
    assert pixels.chunk_key(5) == "steps/pixels/c.5.0.0.0" and f32.chunk_key(5) == "packs/float32/c/5/0"


def test_a_version_2_layout_keeps_its_shard_keys():
    v2 = Layout.build(SCHEMA, {"pixels"}, chunk_rows=4096, version=SHARDED_SINCE)
    pixels = v2.arrays[-1]
    assert pixels.sharded and pixels.chunk_rows == 256 and pixels.chunk_key(5) == "steps/pixels/c/5/0/0/0"
    # the separator is the version's: the layouts' JSON is the same, and each parses to its version's keys
    assert v2.to_json() == Layout.build(SCHEMA, {"pixels"}, chunk_rows=4096).to_json()
    assert Layout.from_json(v2.to_json(), SCHEMA, "s", version=2).arrays[-1].separator == "/"
    assert Layout.from_json(v2.to_json(), SCHEMA, "s", version=3).arrays[-1].separator == "."


def test_a_version_1_layout_keeps_its_unsharded_chunks():
    v1 = Layout.build(SCHEMA, {"pixels"}, chunk_rows=4096, version=1)
    pixels = v1.arrays[-1]
    assert pixels.compressed and not pixels.sharded and pixels.chunk_rows == 8  # ~256 KiB chunks, as version 1 made
    assert v1.version == 1 and "sharded" not in v1.to_json()[-1]
    assert Layout.from_json(v1.to_json(), SCHEMA, "s", version=1).to_json() == v1.to_json()
    # each version's layout is refused under the other: the version says how compressed rows are laid out
    with pytest.raises(CorruptStoreError, match=r"layout\[3\]\.chunk_rows is 8, expected 256"):
        Layout.from_json(v1.to_json(), SCHEMA, "s", version=2)
    with pytest.raises(CorruptStoreError, match=r"layout\[3\]\.chunk_rows is 256, expected 8"):
        Layout.from_json(Layout.build(SCHEMA, {"pixels"}, 4096).to_json(), SCHEMA, "s", version=1)
    small = Layout.build(SCHEMA, {"pixels"}, chunk_rows=4)  # a shard of fewer rows than 8 MiB holds
    with pytest.raises(CorruptStoreError, match=r"layout\[3\]\.sharded is True, expected None"):
        Layout.from_json(small.to_json(), SCHEMA, "s", version=1)


@pytest.mark.parametrize("chunk_rows", [1, 7, 4096, 1 << 40])
def test_layout_is_read_back_for_any_chunk_rows_and_compression(chunk_rows):
    for compressed in (set(), {"pixels"}, {"pixels", "observation", "action"}):
        layout = Layout.build(SCHEMA, compressed, chunk_rows)
        assert Layout.from_json(layout.to_json(), SCHEMA, "s").to_json() == layout.to_json()


@pytest.mark.parametrize(
    "i, key, value, msg",
    [
        (0, "path", "/etc/x", r"layout\[0\]\.path is '/etc/x', expected packs/<dtype> or steps/<field>"),
        (0, "path", "../float32", r"layout\[0\]\.path is '../float32', expected"),
        (0, "path", None, r"layout\[0\]\.path is None, expected"),
        (3, "path", "steps/../../x", r"layout\[3\]\.path is 'steps/../../x', expected"),
        (0, "path", "packs/int64", r"layout\[0\]\.path is 'packs/int64', expected 'packs/float32'"),
        (0, "dtype", "|O", r"layout\[0\]\.dtype is '\|O', expected '<f4'"),
        (0, "row_shape", [1 << 40], r"layout\[0\]\.row_shape"),
        (0, "columns", [["observation", 0, 10]], r"layout\[0\]\.columns"),
        (1, "compressed", True, r"layout\[1\]\.compressed is True, expected False"),
        (0, "chunk_rows", 0, "chunk_rows .* are not all positive integers"),
        (0, "chunk_rows", "16", "chunk_rows .* are not all positive integers"),
        (0, "chunk_rows", 4095, r"layout\[0\]\.chunk_rows is 4095, expected 4096"),
        (0, "extra", 1, r"layout\[0\]\.extra is 1, expected None"),
    ],
)
def test_layout_that_is_not_what_the_schema_gives_is_refused(i, key, value, msg):
    d = Layout.build(SCHEMA, {"pixels"}, chunk_rows=4096).to_json()
    d[i][key] = value
    with pytest.raises(CorruptStoreError, match=msg):
        Layout.from_json(d, SCHEMA, "s")
    for bad in (None, [], {"path": "packs/float32"}, [1], d[:2], [*d, d[0]]):
        with pytest.raises(CorruptStoreError, match="layout"):
            Layout.from_json(bad, SCHEMA, "s")


def test_check_attrs():
    assert check_attrs({"her_store": {"format_version": FORMAT_VERSION}}, "s")["format_version"] == FORMAT_VERSION
    with pytest.raises(NotAStoreError):
        check_attrs({}, "s")
    with pytest.raises(FormatVersionError, match="upgrade"):
        check_attrs({"her_store": {"format_version": FORMAT_VERSION + 1}}, "s")
    for version in ("1", True, 0, -1, 1.0, None):
        with pytest.raises(CorruptStoreError, match="format_version"):
            check_attrs({"her_store": {"format_version": version}}, "s")


def _attrs(**changes) -> dict:
    meta = {
        "format_version": FORMAT_VERSION,
        "schema": SCHEMA.to_json(),
        "layout": Layout.build(SCHEMA, {"pixels"}, 4096).to_json(),
        "capacity": 100,
        "index_slots": 128,
        "metadata": {"env_id": "Demo-v0"},
        "created_at": 1.7e9,
    }
    meta.update(changes)
    return json.loads(json.dumps({k: v for k, v in meta.items() if v is not ...}))


@pytest.mark.parametrize(
    "changes, msg",
    [
        ({"capacity": "100"}, r"zarr.json: her_store.capacity is '100', expected null or an integer >= 1"),
        ({"capacity": 0}, "capacity is 0"),
        ({"capacity": 1.5}, "capacity is 1.5"),
        ({"capacity": True}, "capacity is True"),
        ({"index_slots": 0}, "index_slots is 0 with capacity 100"),
        ({"index_slots": 99}, "index_slots is 99 with capacity 100"),
        ({"index_slots": None}, "index_slots is None with capacity 100"),
        ({"capacity": None}, "index_slots is 128 with capacity None"),
        ({"metadata": [1]}, r"metadata is \[1\], expected an object"),
        ({"created_at": "today"}, "created_at is 'today'"),
        ({"created_at": float("nan")}, "created_at is nan"),
        ({"layout": ...}, r"attributes her_store.\['layout'\] are missing"),
        ({"schema": {"observation_space": None}}, "her_store.schema is invalid"),
        ({"schema": {**SCHEMA.to_json(), "fields": []}}, r"her_store.schema is invalid: schema fields \[\] are not"),
        ({"format_version": 1}, r"layout\[3\]\.chunk_rows is 256, expected 8"),  # a version 2 layout is not version 1's
        (
            {"format_version": FORMAT_VERSION + 1},
            rf"format_version is {FORMAT_VERSION + 1}, expected 1\.\.{FORMAT_VERSION}",
        ),
        ({"format_version": 0}, rf"format_version is 0, expected 1\.\.{FORMAT_VERSION}"),
    ],
)
def test_every_root_attribute_is_checked(changes, msg):
    attrs = parse_attrs(_attrs(), "s/zarr.json")
    assert (attrs.capacity, attrs.index_slots) == (100, 128) and attrs.schema.to_json() == SCHEMA.to_json()
    with pytest.raises(CorruptStoreError, match=msg):
        parse_attrs(_attrs(**changes), "s/zarr.json")
