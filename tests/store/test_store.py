"""EpisodeStore: round trips, resume, ring eviction, metadata, the single-writer lock and every bad input."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import zarr
from gymnasium import spaces

import her_store
from her_store import EpisodeStore, HerSampler, open_store
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    EpisodeValidationError,
    FormatVersionError,
    NotAStoreError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StoreExistsError,
    StoreLockedError,
)
from her_store.format.layout import FORMAT_VERSION
from her_store.ops.verify import verify
from her_store.store.cached_rows import CachedArray
from her_store.store.following import CommitFollower
from her_store.store.frame_rows import FrameArray
from tests.conftest import DATA, GOAL_KEYS, assert_episode_equal, fetch_spaces, make_episode
from tests.data import make_old_store as old


def _goal_obs(extra: dict | None = None, goal: spaces.Space | None = None) -> spaces.Dict:
    goal = goal or spaces.Box(-1, 1, (3,), np.float32)
    d = {"observation": spaces.Box(-np.inf, np.inf, (5,), np.float32), "achieved_goal": goal, "desired_goal": goal}
    d.update(extra or {})
    return spaces.Dict(d)


SPACE_CASES = {
    "box-float32": (_goal_obs(), spaces.Box(-1, 1, (4,), np.float32)),
    "box-float64-2d": (
        _goal_obs({"joints": spaces.Box(-1, 1, (2, 3), np.float64)}), spaces.Box(-1, 1, (2, 2), np.float64)
    ),
    "discrete": (_goal_obs({"mode": spaces.Discrete(5, start=-2)}), spaces.Discrete(7)),
    "multibinary": (_goal_obs({"bits": spaces.MultiBinary(6)}, goal=spaces.MultiBinary(4)), spaces.MultiBinary(3)),
    "multidiscrete": (_goal_obs({"grid": spaces.MultiDiscrete([3, 4, 5])}), spaces.MultiDiscrete([2, 9])),
    "uint8-image": (
        _goal_obs({"pixels": spaces.Box(0, 255, (3, 16, 16), np.uint8)}), spaces.Box(-1, 1, (2,), np.float32)
    ),
}


@pytest.mark.parametrize("case", sorted(SPACE_CASES))
def test_round_trip_every_space_type(store_path, case):
    obs, act = SPACE_CASES[case]
    eps = [make_episode(obs, act, T, seed=i, info_keys=("is_success",)) for i, T in enumerate([1, 7, 30, 2])]
    with EpisodeStore.create(store_path, obs, act, info_keys=["is_success"], chunk_rows=16) as store:
        ids = [store.append_episode(e) for e in eps]
    assert ids == [0, 1, 2, 3]
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == 4 and len(store) == 1 + 7 + 30 + 2
        assert store.observation_space == obs and store.action_space == act
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)
        table = store.episodes
        np.testing.assert_array_equal(table["length"], [1, 7, 30, 2])
        np.testing.assert_array_equal(table["episode_id"], ids)
        np.testing.assert_allclose(table["return"], [e["reward"].sum(dtype=np.float64) for e in eps], rtol=1e-6)
        np.testing.assert_array_equal(table["success"], [int(e["is_success"][-1] > 0.5) for e in eps])
        assert (np.diff(table["start_row"]) == table["length"][:-1] + 1).all()


def test_image_fields_are_compressed_and_low_dim_fields_are_raw(store_path):
    obs, act = SPACE_CASES["uint8-image"]
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(make_episode(obs, act, 20, seed=0))
        paths = {a.path: a for a in store.layout.arrays}
    pixels = zarr.open_array(store_path, path="steps/pixels", mode="r")
    # LZ4 by default, sharded: one frame per inner chunk, a shard of about 8 MiB of frames (capped at chunk_rows)
    assert [c.codec_name for c in pixels.compressors] == ["numcodecs.lz4"]
    assert pixels.chunks == (1, 3, 16, 16) and pixels.shards == (paths["steps/pixels"].chunk_rows, 3, 16, 16)
    assert paths["steps/pixels"].sharded and paths["steps/pixels"].chunk_rows == 8192  # 8 MiB of 768-byte frames
    pack = zarr.open_array(store_path, path="packs/float32", mode="r")
    assert pack.compressors == () and not paths["packs/float32"].compressed


def test_user_compressors_numcodecs_and_zarr(store_path, fetch):
    obs, act = fetch
    comp = {"observation": numcodecs.Blosc(cname="lz4", clevel=5), "action": zarr.codecs.ZstdCodec(level=1)}
    with EpisodeStore.create(store_path, obs, act, compressors=comp) as store:
        e = make_episode(obs, act, 40, seed=3)
        store.append_episode(e)
    with EpisodeStore.open(store_path) as store:
        assert_episode_equal(store.episode(0), e)
    assert type(zarr.open_array(store_path, path="steps/observation").compressors[0]).__name__ == "BloscCodec"
    with pytest.raises(SchemaMismatchError, match="unknown fields"):
        EpisodeStore.create(store_path + "2", obs, act, compressors={"nope": None})


def test_unbounded_store_grows_past_its_first_arrays(store_path, fetch):
    obs, act = fetch
    eps = [make_episode(obs, act, 50, seed=i) for i in range(60)]
    with EpisodeStore.create(store_path, obs, act, chunk_rows=64, commit_interval=0) as store:
        first_rows = store.commit_record.array_rows if hasattr(store, "commit_record") else None
        for e in eps:
            store.append_episode(e)
        assert store.num_transitions == 3000
    with EpisodeStore.open(store_path) as store:
        for i in (0, 31, 59):
            assert_episode_equal(store.episode(i), eps[i])
    assert zarr.open_array(store_path, path="packs/float32").shape[0] >= 60 * 51 > first_rows


def test_reopen_for_append_continues_ids_and_keeps_data(store_path, fetch):
    obs, act = fetch
    eps = [make_episode(obs, act, 10 + i, seed=i) for i in range(6)]
    with EpisodeStore.create(store_path, obs, act, metadata={"env_id": "FetchReach-v4", "author": "lab"}) as store:
        for e in eps[:3]:
            store.append_episode(e)
    with EpisodeStore.open(store_path, mode="a") as store:
        assert [store.append_episode(e) for e in eps[3:]] == [3, 4, 5]
        store.update_metadata(algorithm="SAC+HER")
    with EpisodeStore.open(store_path) as store:
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)
        assert store.metadata == {"env_id": "FetchReach-v4", "author": "lab", "algorithm": "SAC+HER"}


def test_open_store_creates_then_resumes_and_checks_spaces(store_path, fetch):
    obs, act = fetch
    with open_store(store_path, obs, act, capacity=500, info_keys=["is_success"]) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0, info_keys=("is_success",)))
    with open_store(store_path, obs, act, info_keys=["is_success"]) as store:
        assert store.capacity == 500 and store.num_episodes == 1
        assert store.append_episode(make_episode(obs, act, 5, seed=1, info_keys=("is_success",))) == 1
    other_obs, _ = fetch_spaces(obs_dim=11)
    with pytest.raises(SchemaMismatchError, match="observation_space differs"):
        open_store(store_path, other_obs, act)
    with pytest.raises(SchemaMismatchError, match="action_space differs"):
        open_store(store_path, obs, spaces.Box(-1, 1, (5,), np.float32))
    # the failed opens released the lock: a writer can still open it
    with open_store(store_path) as store:
        assert store.num_episodes == 2
    with pytest.raises(NotAStoreError, match="pass observation_space"):
        open_store(store_path + "-missing")


def test_ring_evicts_oldest_whole_episodes_and_never_straddles(store_path, fetch):
    obs, act = fetch
    cap = 300
    lengths = np.random.default_rng(0).integers(1, 60, 200)
    eps = [make_episode(obs, act, int(T), seed=i) for i, T in enumerate(lengths)]
    with EpisodeStore.create(store_path, obs, act, capacity=cap, chunk_rows=32) as store:
        ring_rows = store.commit_record.array_rows
        for e in eps:
            store.append_episode(e)
            table = store.episodes
            live = table["length"]
            assert live.sum() <= cap
            if store.first_episode > 0:  # full: only whole episodes' worth of room is missing
                assert live.sum() > cap - 2 * lengths.max()
            starts = table["start_row"]
            assert ((starts >= 0) & (starts + live + 1 <= ring_rows)).all(), "an episode straddles the wrap"
            spans = sorted(zip(starts, starts + live + 1))
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "live episodes overlap"
        first = store.first_episode
        assert first > 0 and store.end_episode == 200
        assert store.num_transitions == lengths[first:].sum()
        assert store.num_transitions + lengths[first - 1] > cap
    with EpisodeStore.open(store_path) as store:
        assert store.first_episode == first
        for i in range(first, 200):
            assert_episode_equal(store.episode(i), eps[i])
        with pytest.raises(EpisodeNotFoundError, match="evicted"):
            store.episode(first - 1)
        with pytest.raises(EpisodeNotFoundError, match="not committed"):
            store.episode(200)


def test_ring_keeps_working_across_reopen_and_wrap(store_path, fetch):
    obs, act = fetch
    eps = [make_episode(obs, act, 25, seed=i) for i in range(120)]
    for lo, hi in [(0, 40), (40, 80), (80, 120)]:
        with open_store(store_path, obs, act, capacity=250, chunk_rows=16) as store:
            for e in eps[lo:hi]:
                store.append_episode(e)
    with EpisodeStore.open(store_path) as store:
        assert store.num_transitions == 250 and store.first_episode == 110
        for i in range(110, 120):
            assert_episode_equal(store.episode(i), eps[i])


def test_episode_longer_than_capacity_is_refused(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act, capacity=10) as store:
        store.append_episode(make_episode(obs, act, 10, seed=0))
        with pytest.raises(EpisodeValidationError, match="longer than the store's capacity 10"):
            store.append_episode(make_episode(obs, act, 11, seed=1))
        assert store.num_episodes == 1


def _bad_episodes(obs, act):
    good = make_episode(obs, act, 5, seed=0)
    cases = {}
    e = dict(good)
    del e["desired_goal"]
    cases["missing key"] = (e, r"missing \['desired_goal'\]")
    e = dict(good)
    e["bonus"] = np.zeros(5)
    cases["extra key"] = (e, r"unexpected \['bonus'\]")
    e = dict(good)
    e["observation"] = good["observation"][:, :4]
    cases["wrong shape"] = (e, r"'observation' has shape \(6, 4\), expected \(6, 10\)")
    e = dict(good)
    e["achieved_goal"] = good["achieved_goal"][:5]
    cases["T mismatch obs"] = (e, r"'achieved_goal' has shape \(5, 3\), expected \(6, 3\)")
    e = dict(good)
    e["reward"] = good["reward"][:4]
    cases["T mismatch step"] = (e, r"'reward' has shape \(4,\), expected \(5,\)")
    e = dict(good)
    e["terminated"] = np.zeros(5, np.float32)
    cases["wrong dtype"] = (e, "'terminated' has dtype float32, expected bool")
    e = dict(good)
    e["action"] = np.zeros((0, 4), np.float32)
    cases["empty"] = (e, "at least one step")
    cases["not a mapping"] = ([1, 2], "mapping")
    return good, cases


@pytest.mark.parametrize("capacity", [0, -5, True, 2.5, 1 << 52, 1 << 62])
def test_a_capacity_the_format_cannot_hold_is_refused_before_anything_is_written(store_path, fetch, capacity):
    with pytest.raises(ValueError, match=r"capacity must be an int in \[1, 4503599627370495\] or None"):
        EpisodeStore.create(store_path, *fetch, capacity=capacity)
    assert not os.path.exists(store_path)


def test_the_largest_capacity_makes_a_store_that_opens(store_path, fetch):
    EpisodeStore.create(store_path, *fetch, capacity=(1 << 52) - 1).close()
    with EpisodeStore.open(store_path) as store:
        assert store.capacity == (1 << 52) - 1


def test_every_bad_episode_gets_a_clear_error_and_the_store_stays_intact(store_path, fetch):
    obs, act = fetch
    good, cases = _bad_episodes(obs, act)
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(good)
        for bad, msg in cases.values():
            with pytest.raises(EpisodeValidationError, match=msg):
                store.append_episode(bad)
        assert store.num_episodes == 1
        assert store.append_episode(good) == 1
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == 2
        assert_episode_equal(store.episode(1), good)


def test_safe_casts_are_accepted(store_path, fetch):
    obs, act = fetch
    e = make_episode(obs, act, 4, seed=0)
    e64 = {k: (v.astype(np.float64) if v.dtype == np.float32 else v) for k, v in e.items()}
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(e64)
        assert_episode_equal(store.episode(0), e)


def test_read_only_store_refuses_writes(store_path, fetch):
    obs, act = fetch
    EpisodeStore.create(store_path, obs, act).close()
    with EpisodeStore.open(store_path, mode="r") as store:
        with pytest.raises(ReadOnlyStoreError, match="read-only"):
            store.append_episode(make_episode(obs, act, 3, seed=0))
        with pytest.raises(ReadOnlyStoreError):
            store.writer(1)
        with pytest.raises(ReadOnlyStoreError):
            store.update_metadata(x=1)


def test_not_a_store(tmp_path, fetch):
    with pytest.raises(NotAStoreError, match="no Zarr group"):
        EpisodeStore.open(tmp_path)  # a directory that holds no store
    zarr.open_group(str(tmp_path / "plain"), mode="w")
    with pytest.raises(NotAStoreError, match="not a her_store store"):
        EpisodeStore.open(tmp_path / "plain")
    with pytest.raises(ValueError, match="mode must be"):
        EpisodeStore.open(tmp_path / "plain", mode="w")


def test_a_path_that_does_not_exist_is_said_not_to_exist(tmp_path, capsys):
    from her_store.cli.main import main
    from tests.http_server import serving

    missing = tmp_path / "nothing"
    with pytest.raises(NotAStoreError, match=f"^{missing} does not exist$"):
        EpisodeStore.open(missing)
    with pytest.raises(NotAStoreError, match=f"^{missing} does not exist; pass observation_space"):
        her_store.open_store(missing)
    assert main(["inspect", str(missing)]) == 2
    assert capsys.readouterr().err == f"her-store inspect: {missing} does not exist\n"
    (tmp_path / "afile").write_text("")
    with pytest.raises(NotAStoreError, match="afile/store does not exist"):
        EpisodeStore.open(tmp_path / "afile" / "store")
    # a URL whose root object is missing: no store at that URL
    with pytest.raises(NotAStoreError, match=r"^there is no store at memory://nothing-here \(.*zarr.json does not"):
        EpisodeStore.open("memory://nothing-here")
    with serving(str(tmp_path)) as base, pytest.raises(NotAStoreError, match=f"there is no store at {base}/nothing"):
        EpisodeStore.open(f"{base}/nothing")
    assert not missing.exists()


def test_create_refuses_an_existing_store(store_path, fetch):
    obs, act = fetch
    EpisodeStore.create(store_path, obs, act).close()
    with pytest.raises(StoreExistsError, match="open_store"):
        EpisodeStore.create(store_path, obs, act)


def test_newer_format_version_is_refused(store_path, fetch):
    obs, act = fetch
    EpisodeStore.create(store_path, obs, act).close()
    g = zarr.open_group(store_path, mode="r+")
    attrs = g.attrs.asdict()["her_store"]
    attrs["format_version"] = FORMAT_VERSION + 1
    g.attrs["her_store"] = attrs
    with pytest.raises(FormatVersionError, match=f"format version {FORMAT_VERSION + 1}"):
        EpisodeStore.open(store_path)


@pytest.mark.parametrize(
    "damage, msg",
    [
        (lambda raw: b"{not json", "unreadable"),
        (lambda raw: raw.replace(b'"end_episode": 3', b'"end_episode": 4'), "crc32"),
        (None, "no commit record"),
    ],
)
def test_corrupt_commit_record(store_path, fetch, damage, msg):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act) as store:
        for i in range(3):
            store.append_episode(make_episode(obs, act, 4, seed=i))
    path = os.path.join(store_path, "commit.json")
    raw = Path(path).read_bytes()
    if damage is None:
        os.remove(path)
    else:
        Path(path).write_bytes(damage(raw))
    with pytest.raises(CorruptStoreError, match=msg):
        EpisodeStore.open(store_path)
    with pytest.raises(CorruptStoreError):
        EpisodeStore.open(store_path, mode="a")
    if damage is not None:  # the data is untouched: restoring the record restores the store
        Path(path).write_bytes(raw)
        with EpisodeStore.open(store_path) as store:
            assert store.num_episodes == 3


def test_corrupt_rows_are_caught_by_their_checksum(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(make_episode(obs, act, 4, seed=0))
    chunk = os.path.join(store_path, "packs", "float32", "c", "0", "0")
    with open(chunk, "r+b") as f:
        f.seek(8)
        f.write(b"\xff\xff\xff\xff")
    with EpisodeStore.open(store_path) as store:
        with pytest.raises(CorruptStoreError, match="crc32"):
            store.episode(0)
        assert store.episode(0, verify=False)["reward"].shape == (4,)


def test_second_writer_gets_a_clear_error_naming_the_holder(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act):
        with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()} on host"):
            EpisodeStore.open(store_path, mode="a")
        code = (
            "import her_store, her_store.errors, sys\n"
            "try:\n    her_store.EpisodeStore.open(sys.argv[1], mode='a')\n"
            "except her_store.errors.StoreLockedError as e:\n    print(e); sys.exit(3)\n"
        )
        out = subprocess.run([sys.executable, "-c", code, store_path], capture_output=True, text=True, check=False)
        assert out.returncode == 3 and f"pid {os.getpid()}" in out.stdout
        with EpisodeStore.open(store_path, mode="r") as reader:  # readers need no lock
            assert reader.num_episodes == 0
    with EpisodeStore.open(store_path, mode="a"):
        pass


def test_lock_of_a_killed_writer_is_taken_over(store_path, fetch):
    obs, act = fetch
    EpisodeStore.create(store_path, obs, act).close()
    code = (
        "import her_store, sys\ns = her_store.EpisodeStore.open(sys.argv[1], mode='a')\nprint('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, store_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(StoreLockedError, match=f"pid {proc.pid}"):
        EpisodeStore.open(store_path, mode="a")
    proc.kill()
    proc.wait()
    with EpisodeStore.open(store_path, mode="a") as store:
        assert store.append_episode(make_episode(obs, act, 3, seed=0)) == 0


def test_a_plain_zarr_user_reads_any_field_and_the_index(store_path):
    """FORMAT.md's recipe, with the zarr package alone."""
    obs, act = SPACE_CASES["uint8-image"]
    eps = [make_episode(obs, act, T, seed=i) for i, T in enumerate([3, 8, 5])]
    with EpisodeStore.create(store_path, obs, act, capacity=13, chunk_rows=8) as store:
        for e in eps:
            store.append_episode(e)  # the third evicts the first
    root = zarr.open_group(store_path, mode="r")
    meta = root.attrs["her_store"]
    commit = json.loads(Path(store_path, "commit.json").read_text())
    slots = meta["index_slots"]
    where = {name: (arr["path"], a, b) for arr in meta["layout"] for name, a, b in arr["columns"]}
    fields = {f["name"]: f for f in meta["schema"]["fields"]}
    seen = []
    for eid in range(commit["first_episode"], commit["end_episode"]):
        pos = eid % slots if slots else eid
        assert root["episodes/episode_id"][pos] == eid
        start, T = int(root["episodes/start_row"][pos]), int(root["episodes/length"][pos])
        for name, f in fields.items():
            path, a, b = where[name]
            n = T if f["per_step"] else T + 1
            rows = root[path][start : start + n]
            if path.startswith("packs/"):
                rows = rows[:, a:b]
            np.testing.assert_array_equal(rows.reshape(n, *f["shape"]), eps[eid][name], err_msg=name)
        seen.append(eid)
    assert seen == [1, 2]


ZARR_ALONE = """
import sys
import numpy as np
import zarr

for case in sys.argv[1:]:
    want = np.load(case + ".npz")
    pixels = zarr.open_array(case + "/steps/pixels", mode="r")
    for row, frame in zip(want["rows"].tolist(), want["frames"]):
        assert (pixels[row] == frame).all(), (case, row)
    lo, hi = int(want["rows"].min()), int(want["rows"].max()) + 1  # a range across shards, in one read
    got = pixels[lo:hi]
    assert (got[want["rows"] - lo] == want["frames"]).all(), case
assert not [m for m in sys.modules if m.startswith("her_store")]
print("ok", len(sys.argv) - 1)
"""


def test_zarr_alone_reads_every_frame_of_sharded_images(tmp_path):
    """The default codec and zstd, after appends that rewrote tail shards and after a ring wrapped: a process that
    imports only zarr and numpy reads each row as written."""
    obs = _goal_obs({"pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    act = spaces.Box(-1, 1, (2,), np.float32)
    cases = []
    for codec in ("lz4", "zstd"):
        for capacity in (None, 40):
            path = str(tmp_path / f"{codec}-{capacity}")
            eps = {}
            with EpisodeStore.create(
                path, obs, act, capacity=capacity, chunk_rows=16, commit_interval=0, compressors={"pixels": codec}
            ) as store:
                assert store.layout.arrays[-1].sharded and store.layout.arrays[-1].chunk_rows == 16
                for i, T in enumerate([5, 9, 3, 12, 7, 6, 10, 4, 8, 9, 6]):  # each commit rewrites the tail shard
                    eps[store.append_episode(make_episode(obs, act, T, seed=i))] = i
                table = store.episodes
                if capacity:  # wrapped: a newer episode's rows lie before an older one's
                    assert store.first_episode > 0 and (np.diff(table["start_row"]) < 0).any()
            n = table["length"] + 1
            rows = np.concatenate([np.arange(s, s + k) for s, k in zip(table["start_row"], n)])
            frames = np.concatenate(
                [
                    make_episode(obs, act, int(T), seed=eps[int(e)])["pixels"]
                    for e, T in zip(table["episode_id"], table["length"])
                ]
            )
            np.savez(path + ".npz", rows=rows, frames=frames)
            cases.append(path)
    out = subprocess.run(
        [sys.executable, "-c", ZARR_ALONE, *cases], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert out.returncode == 0 and out.stdout.split() == ["ok", "4"], out.stderr[-2000:]


def test_episode_repr_shows_the_mapping_it_is_as_shapes_not_values(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(make_episode(obs, act, 4, seed=0))
        ep = store.episode(0)
        text = repr(ep)
        # the repr reads as the mapping: every field shown is an item, as its dtype and shape
        fields = ", ".join(f"{k!r}: {ep[k].dtype}{ep[k].shape}" for k in ep)
        assert text == f"Episode(id=0, length=4, {{{fields}}})"
        assert "'observation': float32(5, 10)" in text and "observation=" not in text
        assert ep["observation"].shape == (5, 10) and not hasattr(ep, "observation")
        assert "1 episodes, 4 transitions" in repr(store)


def test_durability_fsync_round_trip(store_path, fetch):
    obs, act = SPACE_CASES["uint8-image"]
    eps = [make_episode(obs, act, 6, seed=i) for i in range(5)]
    with EpisodeStore.create(store_path, obs, act, durability="fsync", commit_interval=0, chunk_rows=8) as store:
        for e in eps:
            store.append_episode(e)
    with EpisodeStore.open(store_path) as store:
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)
    with pytest.raises(ValueError, match="durability"):
        EpisodeStore.open(store_path, durability="sometimes")


def test_group_commit_reader_sees_only_committed_episodes(store_path, fetch):
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act, commit_interval=3600) as writer:
        writer.append_episode(make_episode(obs, act, 5, seed=0))
        with EpisodeStore.open(store_path) as reader:
            assert reader.num_episodes == 0  # staged, not committed
            writer.flush()
            assert reader.num_episodes == 0 and reader.refresh() == 1 and reader.num_episodes == 1
            writer.append_episode(make_episode(obs, act, 5, seed=1))
            assert writer.num_episodes == 2  # reading through the writer commits what it staged
            assert reader.refresh() == 1


def test_closed_store_refuses_use(store_path, fetch):
    obs, act = fetch
    store = EpisodeStore.create(store_path, obs, act)
    store.close()
    store.close()
    with pytest.raises(her_store.StoreError, match="closed"):
        store.append_episode(make_episode(obs, act, 3, seed=0))


@pytest.mark.parametrize(
    "obs, act, msg",
    [
        (spaces.Box(-1, 1, (3,)), spaces.Box(-1, 1, (2,)), "must be a gymnasium Dict"),
        (spaces.Dict({"observation": spaces.Box(-1, 1, (3,))}), spaces.Box(-1, 1, (2,)), "missing"),
        (_goal_obs({"reward": spaces.Box(-1, 1, (1,))}), spaces.Box(-1, 1, (2,)), "used twice"),
        (_goal_obs(), spaces.Tuple([spaces.Discrete(2)]), "unsupported space Tuple"),
        (
            spaces.Dict({k: spaces.Box(-1, 1, (3 if k != "desired_goal" else 2,)) for k in GOAL_KEYS}),
            spaces.Discrete(2),
            "same shape",
        ),
    ],
)
def test_bad_spaces_are_refused(store_path, obs, act, msg):
    with pytest.raises(SchemaMismatchError, match=msg):
        EpisodeStore.create(store_path, obs, act)


def test_memory_filesystem_round_trip(fetch):
    obs, act = fetch
    url = f"memory://her-store-test-{os.getpid()}"
    eps = [make_episode(obs, act, 9, seed=i) for i in range(3)]
    with EpisodeStore.create(url, obs, act, commit_interval=0) as store:
        for e in eps:
            store.append_episode(e)
        with pytest.raises(StoreLockedError):
            EpisodeStore.open(url, mode="a")
    with open_store(url, obs, act) as store:
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)


def test_a_create_killed_before_its_commit_record_is_started_again(store_path, fetch):
    """What kill -9 inside create leaves (attributes and arrays, no commit record): open says what happened,
    open_store creates the store anew, and a Zarr node that is not an unfinished create is never removed."""
    obs, act = fetch
    EpisodeStore.create(store_path, obs, act).close()
    os.unlink(os.path.join(store_path, "commit.json"))
    with pytest.raises(NotAStoreError, match="unfinished create"):
        EpisodeStore.open(store_path)
    with open_store(store_path, obs, act, capacity=500) as store:
        assert store.capacity == 500 and store.append_episode(make_episode(obs, act, 3, seed=0)) == 0
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == 1
    # rows exist but the record is gone: damage, not an unfinished create; nothing is removed
    os.unlink(os.path.join(store_path, "commit.json"))
    with pytest.raises(CorruptStoreError, match="rows but no commit record"):
        open_store(store_path, obs, act)
    assert os.path.exists(os.path.join(store_path, "packs", "float32", "c"))
    # someone else's zarr group
    other = store_path + "-other"
    zarr.open_group(other, mode="w", attributes={"mine": 1})
    with pytest.raises(NotAStoreError, match="not a her_store store"):
        open_store(other, obs, act)
    assert zarr.open_group(other, mode="r").attrs["mine"] == 1

def test_an_unfinished_create_is_told_from_damage_by_its_arrays_chunk_keys_alone(store_path, fetch):
    """Only a chunk key of a store's array (``<group>/<array>/c/<i>/...``, ``steps/<field>/c.<i>.0...``) makes a store
    without a commit record damage: files of other names beside it do not, whatever digits they hold."""
    obs, act = fetch
    obs = type(obs)({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    EpisodeStore.create(store_path, obs, act).close()
    os.unlink(os.path.join(store_path, "commit.json"))
    os.makedirs(os.path.join(store_path, "notes", "c"))
    strays = (
        "c.05", "c.5.0.0.0", "notes/c.\u00b2", "notes/c/7", "steps/pixels/c.\u00b2.0.0.0", "steps/pixels/c.05.0.0.0"
    )
    for name in strays:
        Path(store_path, name).write_bytes(b"x")
    with pytest.raises(NotAStoreError, match="unfinished create"):
        EpisodeStore.open(store_path)
    Path(store_path, "steps", "pixels", "c.0.0.0.0").write_bytes(b"x")  # a shard: rows were written
    with pytest.raises(CorruptStoreError, match="rows but no commit record"):
        open_store(store_path, obs, act)
    os.unlink(os.path.join(store_path, "steps", "pixels", "c.0.0.0.0"))
    with open_store(store_path, obs, act) as store:
        assert store.append_episode(make_episode(obs, act, 3, seed=0)) == 0


@pytest.mark.parametrize("node", ["episodes/length", "steps", "episodes"])
def test_a_create_over_someone_elses_zarr_node_changes_nothing(store_path, fetch, node):
    """No root zarr.json, but another Zarr array or group where the store's metadata goes: the create is refused
    and every byte there stays (FORMAT.md: a Zarr node without her_store attributes is never touched)."""
    from tests.faults import tree_digest

    obs, act = fetch
    obs = type(obs)({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    theirs = zarr.open_array(os.path.join(store_path, node), mode="w", shape=(4,), dtype="f8", attributes={"owner": 1})
    theirs[:] = 7.5
    before = tree_digest(store_path)
    with pytest.raises(StoreExistsError, match=f"already holds {node}/zarr.json"):
        EpisodeStore.create(store_path, obs, act)
    after = tree_digest(store_path)
    assert after.pop("writer.lock") and after == before  # the create's lock file (released) is all it added
    again = zarr.open_array(os.path.join(store_path, node), mode="r")
    assert again.attrs["owner"] == 1 and again[:].tolist() == [7.5] * 4


def test_a_compressed_field_named_zarr_json_is_refused_before_anything_is_written(store_path, fetch):
    obs, act = fetch
    obs = type(obs)({**obs.spaces, "zarr.json": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    with pytest.raises(SchemaMismatchError, match="cannot be named 'zarr.json'"):
        EpisodeStore.create(store_path, obs, act)
    assert not os.path.exists(store_path)
    # packed: no array of its own
    with EpisodeStore.create(store_path, obs, act, compressors={"zarr.json": None}) as store:
        ep = make_episode(obs, act, 3, seed=0)
        assert store.append_episode(ep) == 0
        assert_episode_equal(store.episode(0), ep)


def test_a_create_killed_writing_its_root_metadata_leaves_no_temp_file_behind(store_path, fetch):
    obs, act = fetch
    os.makedirs(store_path)
    Path(store_path, "zarr.json.4242.tmp").write_bytes(b'{"zarr_fo')  # cut short, never renamed into place
    Path(store_path, "notes.tmp").write_bytes(b"someone's")  # not a her_store temp file: kept
    with open_store(store_path, obs, act) as store:
        assert store.num_episodes == 0
    assert sorted(n for n in os.listdir(store_path) if n.endswith(".tmp")) == ["notes.tmp"]


def test_a_create_writes_zarr_v3_whatever_zarrs_default_format(store_path, fetch):
    obs, act = fetch
    with zarr.config.set({"default_zarr_format": 2}):
        EpisodeStore.create(store_path, obs, act).close()
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == 0
    assert json.loads(Path(store_path, "episodes", "length", "zarr.json").read_text())["zarr_format"] == 3


@pytest.mark.parametrize("damage", ["group", "parent_is_a_file"])
def test_an_array_whose_metadata_is_a_group_or_under_a_file_is_a_corrupt_store(store_path, fetch, damage):
    obs, act = fetch
    obs = type(obs)({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    EpisodeStore.create(store_path, obs, act).close()
    shutil.rmtree(os.path.join(store_path, "steps", "pixels"))
    if damage == "group":
        zarr.open_group(os.path.join(store_path, "steps", "pixels"), mode="w")
        match = r"steps/pixels/zarr.json is not an array's metadata"
    else:
        Path(store_path, "steps", "pixels").write_bytes(b"not a directory")
        match = r"steps/pixels is not a directory \(a symbolic link or a file in its place\)"
    with pytest.raises(CorruptStoreError, match=match):
        EpisodeStore.open(store_path)


@pytest.mark.parametrize("claim", ["version_2_attrs", "slash_keys"])
def test_a_shard_key_encoding_its_format_version_does_not_give_is_a_corrupt_store(store_path, fetch, claim):
    """A reader finds shards by the keys the store's version gives: a store whose attributes say version 2 while its
    shards are version 3's (or the reverse) would read committed frames as never written, so it is refused."""
    obs, act = fetch
    obs = type(obs)({**obs.spaces, "pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0))
    assert "c.0.0.0.0" in os.listdir(os.path.join(store_path, "steps", "pixels"))
    if claim == "version_2_attrs":
        for key in ("zarr.json", "commit.json"):
            doc = json.loads(Path(store_path, key).read_text())
            if key == "zarr.json":
                doc["attributes"]["her_store"]["format_version"] = 2
            else:
                body = {k: v for k, v in doc.items() if k != "crc32"} | {"format_version": 2}
                doc = body | {"crc32": zlib.crc32(json.dumps(body, sort_keys=True).encode())}
            Path(store_path, key).write_text(json.dumps(doc))
        match = r"steps/pixels/zarr.json: chunk key encoding .*separator='\.'.*expected the default with '/'"
    else:
        meta = Path(store_path, "steps", "pixels", "zarr.json")
        doc = json.loads(meta.read_text())
        doc["chunk_key_encoding"]["configuration"]["separator"] = "/"
        meta.write_text(json.dumps(doc))
        match = r"steps/pixels/zarr.json: chunk key encoding .*separator='/'.*expected the default with '\.'"
    for mode in ("r", "a"):
        with pytest.raises(CorruptStoreError, match=match):
            EpisodeStore.open(store_path, mode)


@pytest.mark.parametrize("durability", ["flush", "fsync"])
def test_a_create_writes_each_zarr_json_once_the_roots_first(store_path, durability):
    """Every group's and array's metadata is put in place once, by an atomic replace, the root's first (so a create
    cut short after it is an unfinished create); under fsync durability each is fsync'ed before its rename."""
    from tests.faults import WriteFaults

    obs = _goal_obs({"pixels": spaces.Box(0, 255, (3, 8, 8), np.uint8)})
    with WriteFaults(store_path, renames=True) as counter:
        EpisodeStore.create(store_path, obs, spaces.Box(-1, 1, (4,), np.float32), durability=durability).close()
    on_disk = sorted(os.path.join(d, "zarr.json") for d, _, files in os.walk(store_path) if "zarr.json" in files)
    assert len(on_disk) > 10  # the root, its groups, and every array (a sharded one among them)
    renamed = [p for p, kind in zip(counter.paths, counter.kinds) if kind == "object" and p.endswith("/zarr.json")]
    assert sorted(renamed) == on_disk, "a zarr.json written more than once, or not by an atomic replace"
    assert renamed[0] == os.path.join(store_path, "zarr.json")
    temps = [p for p, kind in zip(counter.paths, counter.kinds) if kind == "object" and p.endswith(".tmp")]
    synced = {p.rsplit(".", 2)[0] for p in temps if "/zarr.json." in p}  # <key>.<pid>.tmp fsync'ed
    assert synced == (set(on_disk) if durability == "fsync" else set())
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == 0 and {a.path for a in store.layout.arrays if a.sharded} == {"steps/pixels"}



@pytest.mark.parametrize(
    "option, msg",
    [
        ({"capacity": 999}, r"created with capacity=None, got capacity=999"),
        ({"chunk_rows": 128}, r"chunk_rows=128 makes"),
        ({"compressors": {"observation": numcodecs.Zstd()}}, r"compress \['observation'\]"),
        ({"metadata": {"env_id": "Other-v0"}}, r"metadata \['env_id'\] differ"),
    ],
)
def test_open_store_refuses_changed_creation_options(store_path, fetch, option, msg):
    obs, act = fetch
    open_store(store_path, obs, act, chunk_rows=64, metadata={"env_id": "X-v0"}).close()
    with pytest.raises(SchemaMismatchError, match=msg):
        open_store(store_path, obs, act, **option)
    with open_store(store_path, obs, act, chunk_rows=64, metadata={"env_id": "X-v0"}, compressors={}) as store:
        assert store.capacity is None  # the same options resume it


def test_open_store_refuses_another_codec_for_a_compressed_field(store_path):
    obs, act = SPACE_CASES["uint8-image"]
    open_store(store_path, obs, act).close()  # images get LZ4 by default
    with pytest.raises(SchemaMismatchError, match="is stored with"):
        open_store(store_path, obs, act, compressors={"pixels": numcodecs.Zstd(level=3)})


def test_a_forked_child_cannot_write_through_its_parents_handle(store_path, fetch):
    """fork() after opening a writer (multiprocessing's default on Linux): the child is refused, the parent goes
    on, and a child that outlives a killed writer does not keep the store locked."""
    obs, act = fetch
    store = EpisodeStore.create(store_path, obs, act, commit_interval=0)
    store.append_episode(make_episode(obs, act, 5, seed=0))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what happened through the pipe, never run the parent's test code
        try:
            store.append_episode(make_episode(obs, act, 4, seed=1))
            os.write(write, b"appended")
        except BaseException as e:  # noqa: BLE001 - whatever the child meets is reported to the parent
            os.write(write, b"refused" if "forked child" in str(e) else repr(e).encode())
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1000) == b"refused"
    os.waitpid(pid, 0)
    assert store.append_episode(make_episode(obs, act, 6, seed=2)) == 1
    store.close()
    with EpisodeStore.open(store_path) as r:
        assert r.num_episodes == 2
        assert_episode_equal(r.episode(1), make_episode(obs, act, 6, seed=2))
    # the writer dies; a forked child of it lingers and must not keep the lock
    code = (
        "import os, sys\nfrom her_store import EpisodeStore\n"
        "s = EpisodeStore.open(sys.argv[1], mode='a')\nr, w = os.pipe()\n"
        "if os.fork() == 0:\n    os.write(w, b'x'); sys.stdin.read(); os._exit(0)\n"
        "os.read(r, 1)\n"  # the child runs (its after-fork handlers have run): only then is the writer killed
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, store_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.kill()
    proc.wait()
    EpisodeStore.open(store_path, mode="a").close()  # while the child lingers, until its stdin closes
    proc.stdin.close()


def test_a_restart_of_an_unfinished_create_cut_short_anywhere_still_restarts(store_path, fetch, monkeypatch):
    """open_store clears an unfinished create before creating anew; a clear cut short at any removal must leave
    a path that the next open_store restarts (the root zarr.json goes last)."""
    import shutil

    obs, act = fetch
    real_rmtree, real_unlink = shutil.rmtree, os.unlink
    for cut in range(1, 4):
        EpisodeStore.create(store_path, obs, act).close()
        os.unlink(os.path.join(store_path, "commit.json"))
        calls = {"n": 0}

        def removal(real, calls=calls, cut=cut):
            def remove(path, *a, **k):
                calls["n"] += 1
                if calls["n"] == cut:
                    raise OSError(5, "Input/output error")
                return real(path, *a, **k)

            return remove

        monkeypatch.setattr(shutil, "rmtree", removal(real_rmtree))
        monkeypatch.setattr(os, "unlink", removal(real_unlink))
        with pytest.raises(OSError):
            open_store(store_path, obs, act)
        monkeypatch.undo()
        with open_store(store_path, obs, act) as store:
            assert store.append_episode(make_episode(obs, act, 3, seed=cut)) == 0
        real_rmtree(store_path)


# -- stores of earlier format versions --------------------------------------------------------------------------------
OLD_STORES = Path(DATA)  # v<N>_store, made by the version N code: tests/data/make_old_store.py


def _old_reward(achieved, desired, infos):
    return -(np.linalg.norm(np.asarray(achieved) - np.asarray(desired), axis=-1) > 0.05).astype(np.float32)


def _layout_files(path: Path) -> dict[str, bytes]:
    """What fixes a store's layout: the root attributes and each data array's metadata."""
    docs = {"zarr.json": json.loads((path / "zarr.json").read_text())["attributes"]["her_store"]["layout"]}
    for a in ("packs/float32", "packs/bool", "steps/pixels"):
        doc = json.loads((path / a / "zarr.json").read_text())
        docs[a] = {k: v for k, v in doc.items() if k != "attributes"}
    return docs


def _pixel_files(path: Path) -> list[str]:
    """The files of the pixels array but its metadata, relative to it."""
    root = path / "steps" / "pixels"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "zarr.json")


def _check_old_store(path: Path, version: int, lengths: dict[int, int]) -> None:
    """The store holds exactly the episodes ``lengths`` names, with make_old_store's content, read whole, sampled and
    verified, through its version's path: chunks of several rows (1), shards under ``c/<i>/0/0/0`` (2)."""
    ids = sorted(lengths)
    with EpisodeStore.open(path) as store:
        assert store.layout.version == version
        assert [a.sharded for a in store.layout.arrays] == [False, False, version >= 2]
        assert all(a.separator == "/" for a in store.layout.arrays)
        assert list(store.episodes["episode_id"]) == ids
        for i in ids:
            assert_episode_equal(store.episode(i), old.episode(i, lengths[i]))
        with HerSampler(store, 128, reward_fn=_old_reward, seed=0) as sampler:
            pixels = sampler.reader.arrays["steps/pixels"]
            assert type(pixels) is (FrameArray if version >= 2 else CachedArray)
            b = sampler.sample()
            e, t = b.episode_ids.numpy(), b.steps.numpy()
            assert set(e) == set(ids)
            for k, (ei, ti) in enumerate(zip(e.tolist(), t.tolist())):
                ep = old.episode(ei, lengths[ei])
                np.testing.assert_array_equal(b.observations["pixels"].numpy()[k], ep["pixels"][ti])
                np.testing.assert_array_equal(b.next_observations["pixels"].numpy()[k], ep["pixels"][ti + 1])
                np.testing.assert_array_equal(b.observations["observation"].numpy()[k], ep["observation"][ti])
                np.testing.assert_array_equal(b.actions.numpy()[k], ep["action"][ti])
    report = verify(str(path))
    assert report.clean and report.episodes == len(ids), report.summary()
    files = _pixel_files(path)
    assert files and all(f.startswith("c/") and f.endswith("/0/0/0") for f in files), files


@pytest.mark.parametrize("version", [1, 2])
def test_a_store_of_an_earlier_version_is_read_in_its_own_layout(tmp_path, version):
    path = tmp_path / f"v{version}_store"
    shutil.copytree(OLD_STORES / f"v{version}_store", path)
    assert json.loads((path / "commit.json").read_text())["format_version"] == version
    with EpisodeStore.open(path) as store:
        assert (store.first_episode, store.end_episode) == (4, 9) and store.capacity == old.CAPACITY
        assert (np.diff(store.episodes["start_row"]) < 0).any(), "the ring has wrapped"
        spec = store.layout.arrays[-1]
        assert (spec.path, spec.chunk_rows, spec.compressed, spec.sharded) == ("steps/pixels", 16, True, version >= 2)
    _check_old_store(path, version, {i: old.LENGTHS[i] for i in range(4, 9)})


@pytest.mark.parametrize("version", [1, 2])
def test_appending_to_a_store_of_an_earlier_version_keeps_its_version(tmp_path, version):
    path = tmp_path / f"v{version}_store"
    shutil.copytree(OLD_STORES / f"v{version}_store", path)
    before, files = _layout_files(path), _pixel_files(path)
    lengths = dict(enumerate(old.LENGTHS))
    with EpisodeStore.open(path, "a") as store:
        for i, T in ((9, 5), (10, 9), (11, 12)):  # the ring evicts the oldest episodes
            assert store.append_episode(old.episode(i, T)) == i
            lengths[i] = T
        first = store.first_episode
    assert first > 4 and json.loads((path / "commit.json").read_text())["format_version"] == version
    assert _layout_files(path) == before  # layout and array metadata untouched: still its version's layout
    assert json.loads((path / "zarr.json").read_text())["attributes"]["her_store"]["format_version"] == version
    assert set(_pixel_files(path)) >= set(files)  # rewritten in place, under the same keys
    _check_old_store(path, version, {i: T for i, T in lengths.items() if i >= first})  # a later open: old and appended


def test_opening_for_append_removes_the_temp_files_of_a_killed_writer(store_path, fetch):
    """A writer killed during an atomic write leaves ``<key>.<pid>.tmp``; the next writer removes those, and only
    those (a reader removes nothing)."""
    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0))
    root = Path(store_path)
    left = [root / "commit.json.4242.tmp", root / "episodes" / "length" / "c" / "0.17.tmp"]
    kept = [root / "notes.tmp", root / "x.abc.tmp"]
    for f in (*left, *kept):
        f.write_bytes(b"partial")
    EpisodeStore.open(store_path).close()
    assert all(f.exists() for f in (*left, *kept))
    with EpisodeStore.open(store_path, mode="a") as store:
        assert store.num_episodes == 1
    assert not any(f.exists() for f in left) and all(f.exists() for f in kept)


def test_create_refuses_a_card_of_the_wrong_kind_and_writes_nothing(tmp_path, fetch):
    path = tmp_path / "run"
    with pytest.raises(ValueError, match="'ref_max_score' is 'high'; expected number"):
        EpisodeStore.create(path, *fetch, metadata={"ref_max_score": "high"})
    assert not path.exists()
    with EpisodeStore.create(path, *fetch, metadata={"ref_max_score": 1.5, "custom": {"any": ["json"]}}) as store:
        assert store.metadata == {"ref_max_score": 1.5, "custom": {"any": ["json"]}}


def _fill_store(path: str, obs, act, n: int, T: int, first: int = 0) -> None:
    """A new store at ``path`` holding episodes ``first .. first + n - 1`` of ``T`` steps."""
    with EpisodeStore.create(path, obs, act) as w:
        for i in range(first, first + n):
            w.append_episode(make_episode(obs, act, T, i))


@pytest.mark.parametrize("step", ["read_commit", "_read"])
def test_a_store_created_again_while_a_refresh_reads_it_is_refused(tmp_path, monkeypatch, step):
    """The store deleted and created again just after refresh read its commit record, or the index rows it names
    (another process's timing): refresh refuses it before the handle takes anything of the new store."""
    obs, act = fetch_spaces()
    path = str(tmp_path / "s")
    _fill_store(path, obs, act, 4, 5)
    with EpisodeStore.open(path) as reader:
        with EpisodeStore.open(path, mode="a") as w:
            w.append_episode(make_episode(obs, act, 5, 4))  # a new commit: refresh reads index rows
        read = getattr(CommitFollower, step)  # the reader's commit record, or the index rows it names

        def racing(*args):
            got = read(*args)
            monkeypatch.setattr(CommitFollower, step, read)
            shutil.rmtree(path)
            _fill_store(path, obs, act, 6, 3, first=100)
            return got

        monkeypatch.setattr(CommitFollower, step, racing)
        with pytest.raises(CorruptStoreError, match="created again since this handle opened it"):
            reader.refresh()
        assert reader.num_episodes == 4  # the handle kept what it saw


def test_a_reader_refuses_a_store_created_again_under_it(tmp_path):
    """A local store deleted and created again under an open reader (a shard wiped and restarted) is another store:
    refresh says so rather than pair the new index with rows the reader mapped from the old one. A card edit, which
    replaces zarr.json too, is not a new store."""
    obs, act = fetch_spaces()
    path = str(tmp_path / "s")
    _fill_store(path, obs, act, 4, 5)
    with EpisodeStore.open(path) as reader:
        with EpisodeStore.open(path, mode="a") as w:
            w.update_metadata(description="edited")
            w.append_episode(make_episode(obs, act, 5, 4))
        assert reader.refresh() == 1 and reader.metadata.get("description") is None  # the card as opened
        shutil.rmtree(path)
        _fill_store(path, obs, act, 6, 3, first=100)
        with pytest.raises(CorruptStoreError, match="created again since this handle opened it"):
            reader.refresh()
        with pytest.raises(CorruptStoreError, match="removed"):
            shutil.rmtree(path)
            reader.refresh()
