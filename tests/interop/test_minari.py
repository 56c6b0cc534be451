"""Minari export and import with the real minari package: round trips, Minari's own loader and DataCollector,
refusals."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import warnings
import zlib

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.cli.main import main
from her_store.errors import CorruptStoreError, EpisodeValidationError
from tests.conftest import assert_episode_equal, fetch_spaces, make_episode

minari = pytest.importorskip("minari", reason='pip install "her_store[minari]"')
pytest.importorskip("h5py", reason='pip install "her_store[minari]"')

from her_store.interop.minari import export_minari, import_minari  # noqa: E402

CARD = {
    "dataset_id": "point/random-v0",
    "env_id": "her_store/PointGoal-v0",
    "algorithm_name": "random policy",
    "author": "Ada",
    "author_email": ["b@example.org", "a@example.org"],  # order kept, though Minari reads a set
    "code_permalink": "https://example.org/code",
    "description": "random episodes",
    "license": "CC-BY-4.0",
    "versions": {"her_store": "0.1.0"},
    "requirements": ["gymnasium>=1.0"],
    "ref_min_score": -50.0,
    "ref_max_score": 0.0,
    "reward_function": "her_store.envs:point_reward",
    "goal_keys": ["achieved_goal", "desired_goal"],
    "success_threshold": 0.05,
}


def _spaces(kind: str) -> tuple[spaces.Dict, spaces.Space, dict]:
    obs, act = fetch_spaces()
    if kind == "image":  # a uint8 frame Minari would JPEG-encode by default
        obs = spaces.Dict({**obs.spaces, "pixels": spaces.Box(0, 255, (32, 32, 3), np.uint8)})
        return obs, act, {"is_success": spaces.Box(-np.inf, np.inf, (), np.float32)}
    obs = spaces.Dict({**obs.spaces, "contacts": spaces.MultiBinary(4), "mode": spaces.Discrete(3, start=1)})
    return obs, spaces.Discrete(5, start=-2), {"is_success": spaces.Box(-np.inf, np.inf, (), np.float32),
                                               "force": spaces.Box(-1, 1, (2,), np.float64)}


def _episode(obs, act, info_spaces, T, seed, terminated=False):
    ep = make_episode(obs, act, T, seed, ("is_success",), terminated)
    if "force" in info_spaces:
        ep["force"] = np.random.default_rng(seed).uniform(-1, 1, (T, 2))
    return ep


def _store(path, kind="image", n=5, card=CARD):
    obs, act, info = _spaces(kind)
    eps = [_episode(obs, act, info, 3 + 2 * i, i, terminated=i % 2 == 0) for i in range(n)]
    with EpisodeStore.create(path, obs, act, info_keys=info, metadata=card) as store:
        for ep in eps:
            store.append_episode(ep)
    return eps


@pytest.mark.parametrize("kind", ["image", "discrete"])
def test_store_to_minari_to_store_is_bit_exact(tmp_path, kind):
    eps = _store(tmp_path / "src", kind)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
        schema = src.schema.to_json()
    assert sorted(os.listdir(tmp_path / "random-v0" / "data")) == ["main_data.hdf5", "metadata.json"]
    assert import_minari(tmp_path / "random-v0", tmp_path / "back") == len(eps)
    with EpisodeStore.open(tmp_path / "back") as back:
        assert back.schema.to_json() == schema  # spaces, info spaces included, exactly
        assert list(back.metadata.items()) == list(CARD.items())  # every card entry, in order, authors as written
        assert back.num_episodes == len(eps)
        for i, ep in enumerate(eps):
            got = back.episode(i)
            assert_episode_equal(got, ep)
            for k in ep:
                assert got[k].dtype == back.schema.by_name[k].dtype


def test_minari_load_dataset_opens_the_export(tmp_path, monkeypatch):
    eps = _store(tmp_path / "src")
    root = tmp_path / "minari_root"
    (root / "point").mkdir(parents=True)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, [3, 1], root / "point" / "random-v0")  # a selection, in the order given
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    dataset = minari.load_dataset("point/random-v0")
    assert dataset.total_episodes == 2 and dataset.total_steps == 9 + 5
    assert dataset.spec.dataset_id == "point/random-v0"
    meta = dataset.storage.metadata
    assert meta["author"] == {"Ada"} and meta["author_email"] == {"a@example.org", "b@example.org"}
    assert meta["algorithm_name"] == "random policy" and meta["ref_min_score"] == -50.0
    assert meta["success_threshold"] == 0.05 and meta["goal_keys"] == ["achieved_goal", "desired_goal"]
    assert meta["jpeg_encoding"] is False
    assert dataset.observation_space == _spaces("image")[0]
    for got, want in zip(dataset.iterate_episodes(), (eps[3], eps[1])):
        T = len(want["action"])
        assert len(got) == T
        assert got.observations.keys() == {"observation", "achieved_goal", "desired_goal", "pixels"}
        for k, v in got.observations.items():
            np.testing.assert_array_equal(v, want[k])
            assert v.shape[0] == T + 1
        np.testing.assert_array_equal(got.actions, want["action"])
        np.testing.assert_array_equal(got.rewards, want["reward"])
        np.testing.assert_array_equal(got.terminations, want["terminated"])
        np.testing.assert_array_equal(got.truncations, want["truncated"])
        # infos align with the observations, as Minari's DataCollector records them: the reset's first (not kept: 0)
        np.testing.assert_array_equal(got.infos["is_success"], np.r_[0, want["is_success"]])


@pytest.mark.slow
def test_a_dataset_recorded_by_minaris_data_collector_imports(tmp_path, monkeypatch):
    pytest.importorskip("jax", reason="Minari's DataCollector needs jax (pip install 'minari[create]')")
    import gymnasium as gym

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "root"))
    env = minari.DataCollector(gym.make("her_store/PointGoal-v0", max_episode_steps=6), record_infos=True)
    env.action_space.seed(0)
    for seed in range(4):
        env.reset(seed=seed)
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            done = terminated or truncated
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's advice to name a code permalink and an author email
        dataset = env.create_dataset("point/collected-v0", algorithm_name="random", author="Ada", description="x")
    env.close()
    assert import_minari("point/collected-v0", tmp_path / "store") == 4  # by id, from the local Minari root
    with EpisodeStore.open(tmp_path / "store") as store:
        card = store.metadata
        assert card["dataset_id"] == "point/collected-v0" and card["author"] == "Ada"
        assert card["algorithm_name"] == "random" and card["env_id"] == "her_store/PointGoal-v0"
        assert json.loads(card["env_spec"])["max_episode_steps"] == 6
        assert store.info_keys == ("is_success",)
        assert store.episodes["length"].tolist() == [6] * 4 and store.episodes["truncated"].all()
        for i, want in enumerate(dataset.iterate_episodes()):
            got = store.episode(i)
            for k in ("observation", "achieved_goal", "desired_goal"):
                np.testing.assert_array_equal(got[k], want.observations[k])
            np.testing.assert_array_equal(got["action"], want.actions)
            np.testing.assert_array_equal(got["reward"], want.rewards.astype(np.float32))
            np.testing.assert_array_equal(got["is_success"], want.infos["is_success"][1:])  # the reset's dropped
        np.testing.assert_array_equal(
            store.episodes["success"], [int(e.infos["is_success"][-1] > 0.5) for e in dataset]
        )


def _minari_dataset(observation_space, episodes):
    """Dataset ``flat-v0`` in the Minari root, written by Minari's create_dataset_from_buffers (no jax needed)."""
    from minari.data_collector.episode_buffer import EpisodeBuffer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return minari.create_dataset_from_buffers(
            "flat-v0", [EpisodeBuffer(**e) for e in episodes], observation_space=observation_space,
            action_space=spaces.Box(-1, 1, (2,), np.float32), algorithm_name="random",
        )


def _flat_episode(T, seed):
    rng = np.random.default_rng(seed)
    return {"observations": rng.standard_normal((T + 1, 3)).astype(np.float32),
            "actions": rng.uniform(-1, 1, (T, 2)).astype(np.float32), "rewards": np.zeros(T),
            "terminations": np.zeros(T, bool), "truncations": np.eye(1, T, T - 1, dtype=bool)[0]}


def test_a_dataset_without_goals_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "root"))
    _minari_dataset(spaces.Box(-np.inf, np.inf, (3,), np.float32), [_flat_episode(4, 0)])
    with pytest.raises(
        ValueError,
        match=r"not a goal-conditioned dataset.*Dict observation space with "
        r"\['observation', 'achieved_goal', 'desired_goal'\]",
    ):
        import_minari(tmp_path / "root" / "flat-v0", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_spaces_must_be_declared_and_the_environment_is_never_built(tmp_path):
    _store(tmp_path / "src", n=2)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
    meta_path = tmp_path / "random-v0" / "data" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    # Minari itself would gym.make this spec to find the spaces, running the entry point's module
    meta["env_spec"] = json.dumps({"id": "Evil-v0", "entry_point": "os:system", "kwargs": {}})
    del meta["observation_space"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="declares no observation_space in metadata.json"):
        import_minari(tmp_path / "random-v0", tmp_path / "store")
    meta["observation_space"] = json.dumps({"type": "Box", "dtype": "float32", "shape": [1 << 40], "low": 0, "high": 1})
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="its observation_space is not a space a store holds"):
        import_minari(tmp_path / "random-v0", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def test_dataset_id_from_the_destination_name_or_a_clear_error(tmp_path):
    card = {k: v for k, v in CARD.items() if k != "dataset_id"}
    _store(tmp_path / "src", n=2, card=card)
    with EpisodeStore.open(tmp_path / "src") as src:
        with pytest.raises(ValueError, match=r"destination's name 'no version' is not a Minari dataset id"):
            export_minari(src, [0, 1], tmp_path / "no version")
        export_minari(src, [0, 1], tmp_path / "pushes-v2")
    assert not (tmp_path / "no version").exists()
    assert json.loads((tmp_path / "pushes-v2" / "data" / "metadata.json").read_text())["dataset_id"] == "pushes-v2"
    import_minari(tmp_path / "pushes-v2" / "data", tmp_path / "back")  # the data directory itself works too
    with EpisodeStore.open(tmp_path / "back") as back:
        assert back.metadata == {**card, "dataset_id": "pushes-v2"}


def test_existing_destinations_are_refused(tmp_path):
    _store(tmp_path / "src", n=2)
    (tmp_path / "random-v0").mkdir()
    (tmp_path / "random-v0" / "keep.txt").write_text("mine")
    with EpisodeStore.open(tmp_path / "src") as src:
        with pytest.raises(FileExistsError, match="random-v0 exists"):
            export_minari(src, [0], tmp_path / "random-v0")
        export_minari(src, [0], tmp_path / "other-v0")
    assert os.listdir(tmp_path / "random-v0") == ["keep.txt"]
    with pytest.raises(FileExistsError, match="src exists"):
        import_minari(tmp_path / "other-v0", tmp_path / "src")
    with pytest.raises(FileNotFoundError, match="no Minari dataset 'absent/name-v0' in the local Minari root"):
        import_minari("absent/name-v0", tmp_path / "new")


def _damage(path, episode):
    """The first row of ``episode`` in the store's float32 pack no longer matches its crc32."""
    with EpisodeStore.open(path) as src:
        start, _ = src.index.rows_of(episode)
        row_bytes = 4 * next(a for a in src.layout.arrays if a.path == "packs/float32").row_shape[0]
    chunk = path / "packs" / "float32" / "c" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[start * row_bytes : start * row_bytes + 4] = b"\xff\xff\xff\xff"
    chunk.write_bytes(bytes(raw))


def test_failures_leave_nothing(tmp_path):
    _store(tmp_path / "src", n=5)
    _damage(tmp_path / "src", 3)
    with EpisodeStore.open(tmp_path / "src") as src:
        with pytest.raises(CorruptStoreError, match="episode 3"):
            export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
        export_minari(src, [0, 1, 2], tmp_path / "good-v0")
    assert sorted(os.listdir(tmp_path)) == ["good-v0", "src"]  # no partial output beside it

    import h5py

    with h5py.File(tmp_path / "good-v0" / "data" / "main_data.hdf5", "a") as f:
        del f["episode_2/actions"]
    with pytest.raises(ValueError, match="episode 2: KeyError"):
        import_minari(tmp_path / "good-v0", tmp_path / "back")
    assert sorted(os.listdir(tmp_path)) == ["good-v0", "src"]


def test_a_data_file_reading_outside_itself_or_disagreeing_with_its_metadata_is_refused(tmp_path):
    import h5py

    _store(tmp_path / "src", n=3)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
    data = tmp_path / "random-v0" / "data"
    meta = json.loads((data / "metadata.json").read_text())
    for total in (2, 0, 10**11):
        (data / "metadata.json").write_text(json.dumps({**meta, "total_episodes": total}))
        with pytest.raises(ValueError, match="total_episodes is 0|says 2 episodes|says 100,000,000,000 episodes"):
            import_minari(tmp_path / "random-v0", tmp_path / "store")
    (data / "metadata.json").write_text(json.dumps(meta))
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"private " * 1000)
    with h5py.File(data / "main_data.hdf5", "r+") as f:
        shape, dtype = f["episode_0/rewards"].shape, f["episode_0/rewards"].dtype
        del f["episode_0/rewards"]
        f.create_dataset("episode_0/rewards", shape=shape, dtype=dtype, external=[(str(secret), 0, 8 * shape[0])])
    with pytest.raises(ValueError, match="episode_0/rewards keeps its data outside the file"):
        import_minari(tmp_path / "random-v0", tmp_path / "store")
    assert not (tmp_path / "store").exists()


def _replace_datasets(data_dir, arrays):
    """Rewrite datasets of a Minari export's main_data.hdf5 (``{path: array}``), as another tool might save them."""
    import h5py

    with h5py.File(data_dir / "main_data.hdf5", "r+") as f:
        for path, a in arrays.items():
            del f[path]
            f.create_dataset(path, data=a)


def test_casts_that_keep_every_value_are_stated_once_per_array(tmp_path):
    """float64 rewards of float32 values, 0/1 contacts saved as bool, a float32 info saved as float64: imported
    bit-exact, each cast stated once (however many episodes hold it) with the file's dtype and the store's."""
    import h5py

    eps = _store(tmp_path / "src", "discrete", n=3)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
    data = tmp_path / "random-v0" / "data"
    with h5py.File(data / "main_data.hdf5", "r") as f:
        stored = {i: {k: f[f"episode_{i}/{k}"][()] for k in ("rewards", "observations/contacts", "infos/is_success")}
                  for i in range(3)}
    _replace_datasets(data, {f"episode_{i}/rewards": stored[i]["rewards"].astype(np.float64) for i in range(3)})
    _replace_datasets(data, {f"episode_{i}/observations/contacts": stored[i]["observations/contacts"].astype(bool)
                             for i in range(3)})
    _replace_datasets(data, {f"episode_{i}/infos/is_success": stored[i]["infos/is_success"].astype(np.float64)
                             for i in range(3)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert import_minari(tmp_path / "random-v0", tmp_path / "back") == 3
    notes = sorted(str(w.message) for w in caught if "every value kept exactly" in str(w.message))
    assert notes == [
        f"the Minari dataset at {data}: {name} is {dtype} in the file, stored as {want} (every value kept exactly)"
        for name, dtype, want in [("infos/is_success", "float64", "float32"), ("observations/contacts", "bool", "int8"),
                                  ("rewards", "float64", "float32")]
    ]
    with EpisodeStore.open(tmp_path / "back") as back:
        for i, ep in enumerate(eps):
            assert_episode_equal(back.episode(i), ep)


@pytest.mark.parametrize(
    "path,value,words",
    [
        ("observations/observation", lambda a: a.astype(np.float64) + 1e-9,
         r"observations/observation is float64 in the file and float32 in the store: casting would change "
         r"[-0-9.e]+ at \(0, 0\) of episode 1 to [-0-9.e]+; refused"),
        ("observations/contacts", lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, 300, a.astype(np.int16)),
         r"observations/contacts is int16 in the file and int8 in the store: casting would change 300 at \(1, 1\) of "
         r"episode 1 to 44; refused"),
        ("terminations", lambda a: np.where(np.arange(len(a)) == 2, np.nan, a),
         r"terminations is float64 in the file and bool in the store: casting would change nan at \(2,\) of "
         r"episode 1 to True; refused"),
    ],
    ids=["float64 past float32", "int out of range", "NaN into a flag"],
)
def test_casts_that_would_change_a_value_are_refused(tmp_path, path, value, words):
    """A value the store's dtype cannot hold exactly: the import stops, naming the dataset, episode, array, the file's
    dtype and the store's, and leaves nothing."""
    import h5py

    _store(tmp_path / "src", "discrete", n=3)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
    data = tmp_path / "random-v0" / "data"
    with h5py.File(data / "main_data.hdf5", "r") as f:
        a = f[f"episode_1/{path}"][()]
    _replace_datasets(data, {f"episode_1/{path}": value(a.astype(np.float64) if path == "terminations" else a)})
    with pytest.raises(ValueError, match=rf"^the Minari dataset at {data}: {words}$"):
        import_minari(tmp_path / "random-v0", tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_export_of_a_ring_store_its_writer_overwrites_meanwhile(tmp_path):
    """``her-store export --to minari`` of a ring store whose writer (a thread with its own handle) evicts and
    overwrites every exported episode while the export writes the Minari dataset: the export reads as the other
    exports do (one commit's rows, checked), succeeds, and each exported episode is bit-exact the store's episode of
    that id as it was committed."""
    import threading
    import time

    from her_store.interop import export_store

    obs, act = fetch_spaces()
    path, out = str(tmp_path / "ring"), tmp_path / "out"
    out.mkdir()
    with EpisodeStore.create(path, obs, act, capacity=150, info_keys=["is_success"], metadata=CARD) as store:
        for i in range(25):
            store.append_episode(make_episode(obs, act, 5 + i % 7, i, ("is_success",), terminated=i % 3 == 0))
    with EpisodeStore.open(path) as store:
        ids = range(store.first_episode, store.end_episode)
        assert store.first_episode > 0  # the ring has evicted already
        want = [store.episode(i) for i in ids]
    during: list[int] = []

    def overwrite() -> None:  # once the export's staging directory appears: every exported episode's rows rewritten
        with EpisodeStore.open(path, mode="a", commit_interval=0.0) as w:
            while not os.listdir(out):
                time.sleep(0.0002)
            for i in range(4):
                w.append_episode(make_episode(obs, act, 70, 100 + i, ("is_success",)))
                w.flush()
                during.append(w.first_episode)

    writer = threading.Thread(target=overwrite)
    writer.start()
    try:
        assert export_store(path, "minari", out / "random-v0") == (len(want), sum(len(e["action"]) for e in want))
    finally:
        writer.join()
    assert during[-1] >= ids.stop  # the writer evicted (and overwrote) every exported episode
    dataset = minari.MinariDataset(str(out / "random-v0" / "data"))
    assert dataset.total_episodes == len(want)
    for got, ep in zip(dataset.iterate_episodes(), want):
        for k in ("observation", "achieved_goal", "desired_goal"):
            np.testing.assert_array_equal(got.observations[k], ep[k])
        np.testing.assert_array_equal(got.actions, ep["action"])
        np.testing.assert_array_equal(got.rewards, ep["reward"])
        np.testing.assert_array_equal(got.terminations, ep["terminated"])
        np.testing.assert_array_equal(got.truncations, ep["truncated"])
        np.testing.assert_array_equal(got.infos["is_success"][1:], ep["is_success"])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["a link out of the dataset", "a FIFO"])
def test_a_data_file_that_is_no_regular_file_of_the_dataset_is_refused_at_once(tmp_path, what):
    """Minari's reader opened data/main_data.hdf5 by path: a FIFO there blocked the import forever, and a link to a
    file outside the directory was read (while a linked metadata.json was refused). Every entry below the dataset's
    directory must now be a directory or a regular file, refused by name before anything is read."""
    import subprocess
    import sys

    src = str(tmp_path / "s")
    _store(src, n=2)
    out = str(tmp_path / "d-v0")
    with EpisodeStore.open(src) as store:
        export_minari(store, store.episodes["episode_id"], out)
    data = os.path.join(out, "data", "main_data.hdf5")
    if what == "a FIFO":
        os.remove(data)
        os.mkfifo(data)
    else:
        os.replace(data, tmp_path / "elsewhere.hdf5")
        os.symlink(tmp_path / "elsewhere.hdf5", data)
    code = "import sys; from her_store.interop.minari import import_minari; import_minari(sys.argv[1], sys.argv[2])"
    proc = subprocess.run([sys.executable, "-c", code, out, str(tmp_path / "back")], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 1
    assert f"ValueError: the Minari dataset at {os.path.dirname(data)}: {data} is " in proc.stderr
    assert not os.path.exists(tmp_path / "back")


def test_metadata_whose_spaces_make_no_store_or_whose_data_is_not_hdf5_is_refused_naming_the_dataset(tmp_path):
    """Spaces that make no store (an info named like a step field, a nested Dict) were refused without naming the
    dataset; an arrow dataset (whose data the HDF5 check never saw) was refused as an unreadable HDF5 file."""
    _store(tmp_path / "src", n=2)
    with EpisodeStore.open(tmp_path / "src") as src:
        export_minari(src, src.episodes["episode_id"], tmp_path / "random-v0")
    meta_path = tmp_path / "random-v0" / "data" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    where = "the Minari dataset at " + str(tmp_path / "random-v0" / "data")
    cases = {
        "info": (
            {
                "her_store_info_spaces": {
                    "action": {"type": "Box", "shape": [], "dtype": "float32", "low": 0, "high": 1}
                }
            },
            "its spaces in metadata.json make no store: field names \\['action'\\] are used twice",
        ),
        "huge info": ({"her_store_info_spaces": {"x": {"type": "Box", "shape": [10**9, 10**9], "dtype": "float32",
                                                       "low": 0, "high": 1}}},
                      "its her_store_info_spaces in metadata.json: Box space"),
        "arrow": ({"data_format": "arrow"}, "data_format 'arrow'; her_store imports Minari's hdf5 datasets"),
    }
    for name, (change, words) in cases.items():
        meta_path.write_text(json.dumps({**meta, **change}))
        with pytest.raises(ValueError, match=re.escape(where) + ": " + words):
            import_minari(tmp_path / "random-v0", tmp_path / "store")
        assert not (tmp_path / "store").exists(), name


# -- JPEG-encoded datasets: Minari decodes every image frame at the size its header declares ------------------------
IMAGE = spaces.Box(0, 255, (64, 64, 3), np.uint8)


def _png(width, height):
    """A real RGB PNG of one colour, its rows deflated as they are made (no image of that size is ever in memory):
    9000x9000 takes about 240 KB and decodes to 243 MB."""

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    row = bytes(1 + 3 * width)  # filter type 0, then the row's samples
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _image_dataset(root, monkeypatch, observation_space, episodes, name="pixels-v0"):
    """A goal dataset written by Minari with its default JPEG encoding of image frames; returns its data directory."""
    from minari.data_collector.episode_buffer import EpisodeBuffer

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    buffers = [
        EpisodeBuffer(observations={k: ep[k] for k in observation_space.spaces}, actions=ep["action"],
                      rewards=ep["reward"], terminations=ep["terminated"], truncations=ep["truncated"])
        for ep in episodes
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's advice to name a code permalink and an author email
        dataset = minari.create_dataset_from_buffers(name, buffers, observation_space=observation_space,
                                                     action_space=fetch_spaces()[1], algorithm_name="random")
    assert dataset.storage.metadata["jpeg_encoding"] is True
    return root / name / "data"


def _pixels_dataset(root, monkeypatch, steps=(11, 6)):
    """Goal observations and 64x64 RGB frames, episodes of ``steps`` steps, as Minari writes them."""
    obs, act = fetch_spaces()
    obs = spaces.Dict({**obs.spaces, "pixels": IMAGE})
    return _image_dataset(root, monkeypatch, obs, [make_episode(obs, act, T, i) for i, T in enumerate(steps)])


def _set_frames(data_dir, episode, frames, **options):
    import h5py

    with h5py.File(data_dir / "main_data.hdf5", "r+") as f:
        del f[f"episode_{episode}/observations/pixels"]
        f.create_dataset(f"episode_{episode}/observations/pixels", data=frames, **options)


_MEASURED_IMPORT = """
import json, resource, sys
import h5py, minari, PIL.Image, PIL.ImageMode, PIL.PngImagePlugin, PIL.JpegImagePlugin
import minari.dataset._storages.hdf5_storage
from her_store.errors import StoreError
from her_store.interop import import_source

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

_, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (1 << 30), hard))  # 1 GiB beyond what is mapped now
before = status("VmHWM")
try:
    import_source(sys.argv[1], sys.argv[2], "minari")
    out = {"error": None}
except Exception as e:
    out = {"error": str(e), "kind": type(e).__name__, "store_error": isinstance(e, StoreError)}
out["growth"] = status("VmHWM") - before  # this image's peak RSS (ru_maxrss keeps the forking parent's across exec)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("craft", ["9000x9000 PNG headers", "100,000 frames"])
def test_encoded_frames_that_would_decode_past_memory_are_refused_before_anything_decodes(tmp_path, monkeypatch, craft):
    """A 3 MB dataset (``jpeg_encoding`` true, 64x64x3 declared) whose 12 frames are real PNGs of 9000x9000 decoded
    to 2.9 GB in Minari's reader before the shape was checked; 100,000 frames of a valid 64x64 PNG in deflated rows
    claim 1.2 GB the same way. The import, in a process of its own with its address space capped 1 GiB beyond what
    it maps at the start, now refuses each from the file alone: its peak RSS grows by less than one decoded frame."""
    import subprocess
    import sys

    from PIL import Image

    data = _pixels_dataset(tmp_path / "root", monkeypatch)
    if craft == "9000x9000 PNG headers":
        frame = _png(9000, 9000)
        with Image.open(io.BytesIO(frame)) as image:
            assert image.size == (9000, 9000) and image.mode == "RGB"
            image.verify()  # a well-formed PNG: chunks and CRCs intact
        _set_frames(data, 0, np.frombuffer(frame, np.uint8)[None].repeat(12, 0))
        words = (f"the Minari dataset at {data}: episode 0: observations/pixels frame 0 is a 9000x9000 RGB PNG image, "
                 "which decodes to (9000, 9000, 3) uint8; its space declares (64, 64, 3) uint8 frames")
    else:
        frame = _png(64, 64)
        _set_frames(data, 1, np.frombuffer(frame, np.uint8)[None].repeat(100_000, 0), chunks=True, compression="gzip")
        words = (f"episode_1/observations/pixels is (100000, {len(frame)}) of uint8, 100,000 encoded frames of 12,288 "
                 f"bytes each decoded ({100_000 * (len(frame) + 64 * 64 * 3):,} bytes); at most 1,073,741,824 per "
                 "dataset")
    assert os.path.getsize(data / "main_data.hdf5") < 4 << 20
    proc = subprocess.run([sys.executable, "-c", _MEASURED_IMPORT, str(data.parent), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["error"] is not None and words in out["error"], out
    # a frame unlike its space: the episode's refusal (a StoreError); too many frames: the HDF5 file's bound
    assert (out["kind"], out["store_error"]) == (("EpisodeValidationError", True) if craft.startswith("9000")
                                                 else ("ValueError", False)), out
    assert out["growth"] < 128 << 20, out  # one decoded 9000x9000 frame is 243 MB, a 64x64x3 one 12 KB
    assert not (tmp_path / "store").exists()


def _jpeg(frame, size=None):
    """``frame`` as a JPEG (what Minari writes), its header's size (SOF0) set to ``size`` (width, height) if given."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG")
    raw = bytearray(buffer.getvalue())
    if size is not None:
        at = raw.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
        raw[at + 5 : at + 9] = struct.pack(">HH", size[1], size[0])
    return np.frombuffer(bytes(raw), np.uint8)


@pytest.mark.parametrize(
    "frame,words",
    [
        (lambda f: _jpeg(f, (9000, 9000)),
         "is a 9000x9000 RGB JPEG image, which decodes to (9000, 9000, 3) uint8"),
        (lambda f: _jpeg(f[..., 0]), "is a 64x64 L JPEG image, which decodes to (64, 64) uint8"),
        (lambda f: np.frombuffer(b"GIF89a" + bytes(200), np.uint8),
         "is no JPEG or PNG image whose header can be read (UnidentifiedImageError)"),
    ],
    ids=["a 9000x9000 header", "grey frame", "no JPEG or PNG"],
)
def test_an_encoded_frame_its_space_does_not_declare_is_refused_naming_episode_and_frame(tmp_path, monkeypatch, frame,
                                                                                          words):
    """Frame 2 of episode 1 (frames of unequal lengths, stored as Minari stores them then) replaced: a JPEG whose
    header says 9000x9000 (Minari's reader decoded it to 243 MB before the shape stopped it), a grey frame where RGB
    is declared, bytes of no image format PIL reads: each refused from its header, before Minari reads the dataset,
    as an EpisodeValidationError naming the dataset, episode, frame, its size and the space's."""
    import h5py

    data = _pixels_dataset(tmp_path / "root", monkeypatch)
    with h5py.File(data / "main_data.hdf5", "r") as f:
        frames = list(f["episode_1/observations/pixels"][()])
    assert len(frames) == 7
    frames[2] = frame(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    rows = np.empty(len(frames), object)
    rows[:] = frames
    _set_frames(data, 1, rows, dtype=h5py.vlen_dtype(np.uint8))
    with pytest.raises(EpisodeValidationError) as e:
        import_minari(data.parent, tmp_path / "store")
    assert str(e.value) == (f"the Minari dataset at {data}: episode 1: observations/pixels frame 2 {words}; its space "
                            "declares (64, 64, 3) uint8 frames")
    assert not (tmp_path / "store").exists()


def test_a_jpeg_encoded_dataset_minari_writes_imports_as_minaris_reader_decodes_it(tmp_path, monkeypatch):
    """Minari's default JPEG encoding, of RGB frames whose files differ in length (stored as variable-length rows)
    and of constant grey frames (files of one length, stored as a 2-D array): the import checks every frame's header
    and stores the frames exactly as Minari's own reader decodes them."""
    obs, act = fetch_spaces()
    obs = spaces.Dict({**obs.spaces, "pixels": IMAGE, "grey": spaces.Box(0, 255, (48, 40), np.uint8)})
    episodes = [make_episode(obs, act, T, i) for i, T in enumerate((5, 9, 1))]
    for ep in episodes:
        ep["grey"][:] = 77
    data = _image_dataset(tmp_path / "root", monkeypatch, obs, episodes)
    import h5py

    with h5py.File(data / "main_data.hdf5", "r") as f:
        assert h5py.check_vlen_dtype(f["episode_0/observations/pixels"].dtype) == np.uint8
        assert f["episode_0/observations/grey"].dtype == np.uint8 and f["episode_0/observations/grey"].ndim == 2
    assert import_minari(data.parent, tmp_path / "store") == 3
    with EpisodeStore.open(tmp_path / "store") as store:
        for i, want in enumerate(minari.MinariDataset(str(data)).iterate_episodes()):
            got = store.episode(i)
            for k in ("pixels", "grey"):
                np.testing.assert_array_equal(got[k], want.observations[k])
            np.testing.assert_array_equal(got["grey"], 77)
            np.testing.assert_array_equal(got["action"], episodes[i]["action"])


# -- her-store export --to minari: the destination -------------------------------------------------------------------
def test_export_to_minari_makes_the_directories_above_its_destination(tmp_path, monkeypatch, capsys):
    """``her-store export --to minari`` into a Minari root that does not exist yet, nor the namespace's directory in
    it (refused before: "the directory of .../random-v0 does not exist"): both are made, and minari.load_dataset
    opens the dataset by its id."""
    eps = _store(tmp_path / "src", n=3)
    root = tmp_path / "minari_root"
    assert main(["export", str(tmp_path / "src"), "--to", "minari", str(root / "point" / "random-v0"), "--quiet"]) == 0
    assert "exported 3 episodes" in capsys.readouterr().out
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    dataset = minari.load_dataset("point/random-v0")
    assert dataset.total_episodes == 3 and dataset.spec.dataset_id == "point/random-v0"
    for got, want in zip(dataset.iterate_episodes(), eps):
        for k, v in got.observations.items():
            np.testing.assert_array_equal(v, want[k])
        np.testing.assert_array_equal(got.actions, want["action"])


def test_a_failed_export_to_minari_leaves_none_of_the_directories_it_made(tmp_path, capsys):
    """An export that fails once it has begun writing (episode 3 of 5 damaged; a store of images is read an episode at
    a time) removes the dataset's partial directory and the directories it made above it."""
    _store(tmp_path / "src", n=5)
    _damage(tmp_path / "src", 3)
    dest = tmp_path / "made" / "point" / "random-v0"
    assert main(["export", str(tmp_path / "src"), "--to", "minari", str(dest), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("her-store export: ") and "episode 3" in err[0], err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_export_to_minari_says_in_one_line_what_a_destination_must_look_like(tmp_path, capsys):
    """A destination whose name is no Minari id, from a store whose card names none: one line says what a
    destination must be, or how to name the id in the card; nothing is made. Following either works."""
    _store(tmp_path / "src", n=2, card={k: v for k, v in CARD.items() if k != "dataset_id"})
    src = str(tmp_path / "src")
    assert main(["export", src, "--to", "minari", str(tmp_path / "out" / "dataset"), "--quiet"]) == 2
    assert capsys.readouterr().err.splitlines() == [(
        "her-store export: the destination's name 'dataset' is not a Minari dataset id, and the store's card has no "
        "dataset_id: the destination must be a new directory named name-v<version> (e.g. datasets/random-v0), or the "
        "card must name the id (her-store card STORE --set dataset_id=point/random-v0)"
    )]
    assert sorted(os.listdir(tmp_path)) == ["src"]
    assert main(["export", src, "--to", "minari", str(tmp_path / "datasets" / "random-v0"), "--quiet"]) == 0
    assert minari.MinariDataset(str(tmp_path / "datasets" / "random-v0" / "data")).spec.dataset_id == "random-v0"
    assert main(["card", src, "--set", "dataset_id=point/random-v0"]) == 0
    assert main(["export", src, "--to", "minari", str(tmp_path / "out" / "dataset"), "--quiet"]) == 0
    assert minari.MinariDataset(str(tmp_path / "out" / "dataset" / "data")).spec.dataset_id == "point/random-v0"
