"""Export and import (her_store.interop): round trips through npz, HDF5 and OGBench's npz, SB3 pickles, refusals."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.cli.main import main
from her_store.errors import CorruptStoreError, EpisodeNotFoundError, StoreError
from her_store.interop import export_store, guess_format, import_source, read_batches
from tests.conftest import GOAL_KEYS, ROOT, assert_episode_equal, fetch_spaces, make_episode

CARD = {
    "env_id": "her_store/PointGoal-v0",
    "author": ["Ada", "Bo"],
    "license": "CC-BY-4.0",
    "ref_max_score": 1.5,
    "versions": {"her_store": "0.1.0"},
    "goal_keys": ["achieved_goal", "desired_goal"],
    "custom": {"x": [1, 2]},
}
FORMATS = ("npz", "hdf5", "ogbench")
SUFFIX = {"npz": ".npz", "hdf5": ".hdf5", "ogbench": ".npz"}
# what a format needs beyond the core, and the extra that installs it
NEEDS = {"hdf5": ("h5py", "hdf5"), "minari": ("minari", "minari"), "sb3": ("stable_baselines3", "sb3")}


def needs(fmt: str | None) -> Any:
    """The module format ``fmt`` needs beyond the core (None if none); the test skips where it is not installed."""
    if fmt not in NEEDS:
        return None
    module, extra = NEEDS[fmt]
    return pytest.importorskip(module, reason=f'pip install "her_store[{extra}]"')


def image_spaces() -> tuple[spaces.Dict, spaces.Space, dict[str, spaces.Space]]:
    """uint8 frames beside float goals, a Discrete action, two info keys (one of them an int vector)."""
    obs = spaces.Dict(
        {
            "observation": spaces.Box(0, 255, (3, 8, 8), np.uint8),
            "achieved_goal": spaces.Box(-np.inf, np.inf, (2,), np.float32),
            "desired_goal": spaces.Box(-np.inf, np.inf, (2,), np.float32),
            "joints": spaces.Box(-1, 1, (3,), np.float64),
        }
    )
    infos = {"is_success": spaces.Box(-np.inf, np.inf, (), np.float32), "contacts": spaces.Box(0, 9, (2,), np.int16)}
    return obs, spaces.Discrete(5), infos


def image_episode(obs, act, infos, T, seed, terminated=False):
    ep = make_episode(obs, act, T, seed, terminated=terminated)
    rng = np.random.default_rng(seed + 1000)
    ep["is_success"] = (rng.random(T) > 0.5).astype(np.float32)
    ep["contacts"] = rng.integers(0, 10, (T, 2)).astype(np.int16)
    return ep


@pytest.fixture
def image_store(tmp_path):
    obs, act, infos = image_spaces()
    path = str(tmp_path / "images")
    with EpisodeStore.create(path, obs, act, info_keys=infos, metadata=CARD) as store:
        for i in range(6):
            store.append_episode(image_episode(obs, act, infos, 3 + 2 * i, i, terminated=i % 2 == 0))
    return path


@pytest.fixture
def ring_store(tmp_path):
    """A ring store whose first episodes were evicted."""
    obs, act = fetch_spaces()
    path = str(tmp_path / "ring")
    with EpisodeStore.create(path, obs, act, capacity=120, info_keys=["is_success"], metadata=CARD) as store:
        for i in range(30):
            store.append_episode(make_episode(obs, act, 5 + i % 7, i, ("is_success",), terminated=i % 3 == 0))
        store.flush()
        assert store.first_episode > 0
    return path


def assert_same_store(got_path: str, want_path: str, ids) -> None:
    """The store at got_path holds episodes ``ids`` of want_path, in order, bit-exact, with its spaces and card."""
    with EpisodeStore.open(got_path) as got, EpisodeStore.open(want_path) as want:
        assert got.num_episodes == len(ids)
        assert got.schema.to_json() == want.schema.to_json()
        assert got.metadata == want.metadata
        for j, i in enumerate(ids):
            g, w = got.episode(got.first_episode + j), want.episode(i)
            assert_episode_equal(g, w)
            assert all(g[k].dtype == w[k].dtype for k in w)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_images_infos_and_card(image_store, tmp_path, fmt):
    """store -> format -> store: uint8 frames, Discrete actions, float64 and int16 fields, the card, bit-exact."""
    needs(fmt)
    dest = str(tmp_path / f"out{SUFFIX[fmt]}")
    assert main(["export", image_store, "--to", fmt, dest, "--quiet"]) == 0
    assert guess_format(dest) == fmt
    assert main(["import", dest, str(tmp_path / "back"), "--quiet"]) == 0
    assert_same_store(str(tmp_path / "back"), image_store, range(6))
    assert sorted(os.listdir(tmp_path)) == sorted(["images", os.path.basename(dest), "back"])  # no scratch left


@pytest.mark.parametrize("fmt", FORMATS)
def test_ring_store_with_evictions_and_selection(ring_store, tmp_path, fmt):
    """Only live episodes are exported; --episodes picks a subset (negative ids count from the end)."""
    needs(fmt)
    with EpisodeStore.open(ring_store) as s:
        first, end = s.first_episode, s.end_episode
    whole, part = str(tmp_path / f"all{SUFFIX[fmt]}"), str(tmp_path / f"part{SUFFIX[fmt]}")
    assert main(["export", ring_store, "--to", fmt, whole, "--quiet"]) == 0
    assert import_source(whole, str(tmp_path / "all")) == end - first
    assert_same_store(str(tmp_path / "all"), ring_store, range(first, end))
    assert main(["export", ring_store, "--to", fmt, part, "--episodes", f"{first + 1}:{first + 3},-1", "--quiet"]) == 0
    assert import_source(part, str(tmp_path / "part"), fmt) == 3
    assert_same_store(str(tmp_path / "part"), ring_store, [first + 1, first + 2, end - 1])


def test_npz_layout_is_plain_numpy(ring_store, tmp_path):
    """The npz opens with allow_pickle=False; episode_lengths cut the concatenated fields into episodes."""
    dest = str(tmp_path / "x.npz")
    assert main(["export", ring_store, "--to", "npz", dest, "--quiet"]) == 0
    z = np.load(dest, allow_pickle=False)
    lengths = z["episode_lengths"]
    head = json.loads(z["her_store_header"].tobytes())
    assert head["format"] == "her_store.npz" and head["metadata"] == CARD
    with EpisodeStore.open(ring_store) as s:
        np.testing.assert_array_equal(z["episode_ids"], np.arange(s.first_episode, s.end_episode))
        last = s.episode(s.end_episode - 1)
    assert len(z["actions"]) == lengths.sum() and len(z["observations/observation"]) == lengths.sum() + len(lengths)
    np.testing.assert_array_equal(z["observations/observation"][-lengths[-1] - 1 :], last["observation"])
    np.testing.assert_array_equal(z["infos/is_success"][-lengths[-1] :], last["is_success"])


@pytest.mark.parametrize("compact", [False, True])
def test_ogbench_loader_reads_the_stores_transitions(ring_store, tmp_path, compact):
    """ogbench.utils.load_dataset yields the store's transitions (observation, next observation, action)."""
    ogbench_utils = pytest.importorskip("ogbench.utils", reason='pip install "her_store[ogbench]"')
    dest = str(tmp_path / "ring-v0.npz")
    assert main(["export", ring_store, "--to", "ogbench", dest, "--quiet"]) == 0
    ds = ogbench_utils.load_dataset(dest, compact_dataset=compact)
    with EpisodeStore.open(ring_store) as s:
        eps = [s.episode(i) for i in range(s.first_episode, s.end_episode)]
    obs = np.concatenate([e["observation"][:-1] for e in eps])
    nxt = np.concatenate([e["observation"][1:] for e in eps])
    act = np.concatenate([e["action"] for e in eps])
    last = np.concatenate([np.arange(e.length) == e.length - 1 for e in eps])
    if compact:  # every state kept; valids marks the rows that start a transition
        valid = ds["valids"].astype(bool)
        np.testing.assert_array_equal(ds["observations"][valid], obs)
        np.testing.assert_array_equal(ds["actions"][valid], act)
        np.testing.assert_array_equal(ds["observations"][np.flatnonzero(valid) + 1], nxt)
    else:
        np.testing.assert_array_equal(ds["observations"], obs)
        np.testing.assert_array_equal(ds["next_observations"], nxt)
        np.testing.assert_array_equal(ds["actions"], act)
        np.testing.assert_array_equal(ds["terminals"].astype(bool), last)


def test_ogbench_file_from_elsewhere(tmp_path):
    """An OGBench file as OGBench writes it (savez_compressed, bool terminals, a real action in the last row, qpos,
    a scalar setting): episodes split at terminals, goals = observation / final observation, rewards -1 then 0."""
    rng = np.random.default_rng(0)
    sizes = [4, 6, 3]
    n = sum(sizes)
    terminals = np.zeros(n, bool)
    terminals[np.cumsum(sizes) - 1] = True
    data = {
        "observations": rng.standard_normal((n, 5)).astype(np.float32),
        "actions": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
        "terminals": terminals,
        "qpos": rng.standard_normal((n, 3)).astype(np.float32),
        "button_states": rng.integers(0, 2, (n, 2)).astype(np.int64),
        "observation_interval": np.asarray(1, np.int32),
        "next_observations": rng.standard_normal((n, 5)).astype(np.float32),  # OGBench's own, derived: not stored
        "valids": np.ones(n, np.float32),
    }
    src = str(tmp_path / "pointmaze-tiny-navigate-v0.npz")
    np.savez_compressed(src, **data)
    assert guess_format(src) == "ogbench"
    assert main(["import", src, str(tmp_path / "s"), "--quiet"]) == 0
    with EpisodeStore.open(str(tmp_path / "s")) as s:
        assert s.num_episodes == 3 and s.episodes["length"].tolist() == [3, 5, 2]
        assert s.metadata["dataset_id"] == "pointmaze-tiny-navigate-v0"
        assert set(s.observation_space.spaces) == {*GOAL_KEYS, "qpos", "button_states"}
        row = 0
    assert main(["export", str(tmp_path / "s"), "--to", "ogbench", str(tmp_path / "again.npz"), "--quiet"]) == 0
    with EpisodeStore.open(str(tmp_path / "s")) as s:
        for i, size in enumerate(sizes):
            ep, T = s.episode(i), size - 1
            np.testing.assert_array_equal(ep["observation"], data["observations"][row : row + size])
            np.testing.assert_array_equal(ep["achieved_goal"], ep["observation"])
            np.testing.assert_array_equal(ep["desired_goal"], np.repeat(ep["observation"][-1:], size, 0))
            np.testing.assert_array_equal(ep["qpos"], data["qpos"][row : row + size])
            np.testing.assert_array_equal(ep["button_states"], data["button_states"][row : row + size])
            np.testing.assert_array_equal(ep["action"], data["actions"][row : row + T])  # the last row's action dropped
            np.testing.assert_array_equal(ep["reward"], [-1.0] * (T - 1) + [0.0])
            assert not ep["terminated"].any() and ep["truncated"].tolist() == [False] * (T - 1) + [True]
            row += size


def _ogbench_file(path: str, **arrays) -> None:
    """An OGBench file as OGBench writes it (no header): trajectories of 4 and 3 states, with ``arrays`` beside."""
    rng = np.random.default_rng(1)
    terminals = np.array([0, 0, 0, 1, 0, 0, 1], bool)
    np.savez_compressed(
        path,
        observations=rng.standard_normal((7, 2)).astype(np.float32),
        actions=rng.uniform(-1, 1, (7, 2)).astype(np.float32),
        terminals=terminals,
        **arrays,
    )


def test_ogbench_casts_that_keep_every_value_are_stated_once(tmp_path):
    """float64 rewards of float32 values and 0/1 truncations as floats: imported as the store's float32 and bool,
    each cast stated once for the whole file, with both dtypes."""
    src = str(tmp_path / "cube-v0.npz")
    rewards = np.array([-1, -0.5, 0, 0, -1, 0.25, 0], np.float64)
    truncations = np.array([0, 0, 1, 0, 0, 1, 0], np.float64)
    _ogbench_file(src, rewards=rewards, truncations=truncations)
    with pytest.warns(UserWarning) as caught:
        assert import_source(src, str(tmp_path / "s")) == 2
    notes = sorted(str(w.message) for w in caught if "every value kept exactly" in str(w.message))
    assert notes == [
        f"{src}: rewards is float64 in the file, stored as float32 (every value kept exactly)",
        f"{src}: truncations is float64 in the file, stored as bool (every value kept exactly)",
    ]
    with EpisodeStore.open(str(tmp_path / "s")) as s:
        ep = s.episode(1)
        assert ep["reward"].dtype == np.float32 and ep["reward"].tolist() == [-1.0, 0.25]
        assert ep["truncated"].tolist() == [False, True]


@pytest.mark.parametrize(
    "name,values,words",
    [
        ("rewards", np.array([-1, -1, 0, 0, -1, 0.1, 0]), r"rewards is float64 in the file and float32 in the store: "
         r"casting would change 0\.1 at \(1,\) of episode 1 to 0\.10000000149011612"),
        ("truncations", np.array([0, 0.5, 1, 0, 0, 1, 0]), r"truncations is float64 in the file and bool in the "
         r"store: casting would change 0\.5 at \(1,\) of episode 0 to True"),
        ("rewards", np.array([0, 0, 0, 0, 0, 1e300, 0]), r"rewards is float64 in the file and float32 in the store: "
         r"casting would change 1e\+300 at \(1,\) of episode 1 to inf"),
    ],
    ids=["float64 past float32", "0.5 into a flag", "overflow"],
)
def test_ogbench_casts_that_would_change_a_value_are_refused(tmp_path, name, values, words):
    """An OGBench file (no header: the store's spaces come from its arrays) with values the store's dtypes cannot
    hold exactly: refused naming the file, the array, both dtypes and the episode, leaving nothing."""
    src = str(tmp_path / "cube-v0.npz")
    _ogbench_file(src, **{name: values})
    with pytest.raises(ValueError, match=rf"^{re.escape(src)}: {words}; refused$"):
        import_source(src, str(tmp_path / "s"))
    assert not os.path.exists(tmp_path / "s")


# -- SB3 replay buffers -----------------------------------------------------------------------------------------
def _fill_sb3(rb, n_envs: int, steps: int):
    """Step PointGoal envs with random actions and add() every step as SB3's off-policy loop does (done =
    terminated or truncated, TimeLimit.truncated in infos, next_obs the final observation). Returns the episodes
    each env completed and its unfinished one, each step with the step index it was taken at."""
    from her_store.envs import PointGoalEnv

    envs = [PointGoalEnv(max_episode_steps=7 + 3 * i, distance_threshold=0.3) for i in range(n_envs)]
    obs = [e.reset(seed=i)[0] for i, e in enumerate(envs)]
    rng = np.random.default_rng(0)
    done_eps: list[list] = [[] for _ in envs]
    current: list[list] = [[] for _ in envs]

    def stack(ds):
        return {k: np.stack([d[k] for d in ds]) for k in ds[0]}

    for t in range(steps):
        acts = rng.uniform(-1, 1, (n_envs, 2)).astype(np.float32)
        res = [e.step(a) for e, a in zip(envs, acts)]
        term = np.array([r[4]["is_success"] > 0 for r in res])  # reaching the goal ends an episode here
        trunc = np.array([r[3] for r in res]) & ~term
        nxt = [r[0] for r in res]
        rewards = np.array([r[1] for r in res], np.float32)
        rb.add(stack(obs), stack(nxt), acts, rewards, term | trunc, [{"TimeLimit.truncated": bool(x)} for x in trunc])
        for i in range(n_envs):
            current[i].append((t, obs[i], acts[i], rewards[i], nxt[i], term[i]))
            if term[i] or trunc[i]:
                done_eps[i].append(current[i])
                current[i] = []
        obs = [envs[i].reset()[0] if term[i] or trunc[i] else nxt[i] for i in range(n_envs)]
    return done_eps, current


def _as_episode(steps, ended: bool) -> dict[str, np.ndarray]:
    T = len(steps)
    ep = {k: np.stack([s[1][k] for s in steps] + [steps[-1][4][k]]) for k in GOAL_KEYS}
    ep["action"] = np.stack([s[2] for s in steps])
    ep["reward"] = np.array([s[3] for s in steps], np.float32)
    ep["terminated"] = np.zeros(T, bool)
    ep["truncated"] = np.zeros(T, bool)
    (ep["terminated"] if ended and steps[-1][5] else ep["truncated"])[-1] = True
    return ep


def _sb3_pickle(path: str, kind: str, n_envs: int, rows_per_env: int, steps: int):
    """A real SB3 buffer of ``kind`` ("her": HerReplayBuffer, "dict": DictReplayBuffer), filled by :func:`_fill_sb3`
    and saved by SAC's save_replay_buffer at ``path``; returns what :func:`_fill_sb3` returns."""
    needs("sb3")
    from stable_baselines3 import SAC, HerReplayBuffer
    from stable_baselines3.common.buffers import DictReplayBuffer
    from stable_baselines3.common.vec_env import DummyVecEnv

    from her_store.envs import PointGoalEnv

    venv = DummyVecEnv([PointGoalEnv] * n_envs)
    cls, kw = (HerReplayBuffer, {"env": venv}) if kind == "her" else (DictReplayBuffer, {})
    model = SAC(
        "MultiInputPolicy",
        venv,
        buffer_size=rows_per_env * n_envs,
        replay_buffer_class=cls,
        device="cpu",
        learning_starts=10**9,
    )
    model.replay_buffer = cls(
        rows_per_env * n_envs, venv.observation_space, venv.action_space, device="cpu", n_envs=n_envs, **kw
    )
    filled = _fill_sb3(model.replay_buffer, n_envs, steps)
    assert model.replay_buffer.full == (rows_per_env < steps)
    model.save_replay_buffer(path)
    return filled


@pytest.mark.parametrize("kind", ["her", "dict"])
@pytest.mark.parametrize("rows_per_env", [200, 25])
def test_sb3_replay_buffer_pickle(tmp_path, kind, rows_per_env):
    """A real SB3 buffer (2 envs, real add() calls, saved by SB3's save_replay_buffer) imports as the episodes it
    holds, in the order they ended: with rows_per_env=25 the ring wrapped, so episodes it overwrote are gone (and a
    DictReplayBuffer also drops each column's oldest episode, whose start it cannot know); the unfinished episodes
    end truncated."""
    n_envs, steps = 2, 60
    path = str(tmp_path / "rb.pkl")
    done_eps, current = _sb3_pickle(path, kind, n_envs, rows_per_env, steps)

    window = max(0, steps - rows_per_env)  # the first step still in each column
    expected = []
    for env in range(n_envs):
        for ep in done_eps[env]:
            first = ep[0][0]
            if first > window or (first == window and (kind == "her" or window == 0)):
                expected.append((ep[-1][0], env, _as_episode(ep, True)))
        if current[env] and (
            current[env][0][0] > window or window == 0 or (kind == "her" and current[env][0][0] == window)
        ):
            expected.append((current[env][-1][0], env, _as_episode(current[env], False)))
    expected.sort(key=lambda e: (e[0], e[1]))
    if rows_per_env < steps:
        assert sum(len(e) for e in done_eps) > len(expected) - n_envs  # some episodes were overwritten

    assert guess_format(path) == "sb3"
    assert main(["import", path, str(tmp_path / "s"), "--quiet"]) == 0
    with EpisodeStore.open(str(tmp_path / "s")) as s:
        assert s.num_episodes == len(expected)
        assert s.episodes["terminated"].sum() == sum(bool(e[2]["terminated"].any()) for e in expected)
        assert s.episodes["terminated"].any() or rows_per_env < steps  # both kinds of ending are covered
        for i, (_, _, want) in enumerate(expected):
            assert_episode_equal(s.episode(i), want)
        assert "stable-baselines3" in s.metadata["description"]


def _her_episode_rows(rb, env: int) -> np.ndarray:
    """The buffer rows of the first ended episode of ``env`` in ``rb`` (in the order written) of 3 steps or more."""
    start, length = rb.ep_start[:, env], rb.ep_length[:, env]
    order = (rb.pos + np.arange(rb.buffer_size)) % rb.buffer_size if rb.full else np.arange(rb.pos)
    s = next(int(r) for r in order if start[r] == r and length[r] > 2)
    return (s + np.arange(length[s])) % rb.buffer_size


def _cut_short(rb, env):  # the hostile case: the episode's first row says it is one step long
    rb.ep_length[_her_episode_rows(rb, env)[0], env] = 1


def _done_inside(rb, env):  # a done on a middle row that ep_length says belongs to a longer episode
    rb.dones[_her_episode_rows(rb, env)[1], env] = 1.0


def _episode_dropped(rb, env):  # every row of an episode says length 0 (SB3 sets that only for overwritten rows)
    rb.ep_length[_her_episode_rows(rb, env), env] = 0


@pytest.mark.parametrize("rows_per_env,steps", [(16, 12), (16, 30)])
@pytest.mark.parametrize("corrupt", [_cut_short, _done_inside, _episode_dropped])
def test_sb3_her_pickle_whose_episodes_do_not_tile_its_rows_is_refused(tmp_path, rows_per_env, steps, corrupt):
    """A real HerReplayBuffer (3 envs, 16 rows each; filled part-way, and wrapped) saved by save_replay_buffer, then
    loaded, given an ep_length or done that disagrees with ep_start and the rows written, and pickled again: refused
    with the env and row named, never imported as fragments of episodes. The buffer as SB3 saved it imports."""
    path, bad = str(tmp_path / "rb.pkl"), str(tmp_path / "bad.pkl")
    done_eps, _ = _sb3_pickle(path, "her", 3, rows_per_env, steps)
    assert done_eps[1]  # env 1 ended an episode, which is corrupted below
    assert import_source(path, str(tmp_path / "good")) >= 3
    with open(path, "rb") as f:
        rb = pickle.load(f)
    rows = _her_episode_rows(rb, 1)
    corrupt(rb, 1)
    with open(bad, "wb") as f:
        pickle.dump(rb, f)
    at = rows[1] if corrupt is _done_inside else rows[0]
    with pytest.raises(ValueError, match=rf"bad\.pkl: env 1: .*\brow {at}\b"):
        import_source(bad, str(tmp_path / "s"))
    assert not os.path.exists(tmp_path / "s")


def test_sb3_pickle_of_something_else(tmp_path):
    needs("sb3")
    path = str(tmp_path / "x.pkl")
    with open(path, "wb") as f:
        pickle.dump({"observations": 1}, f)
    with pytest.raises(ValueError, match="expected an SB3 DictReplayBuffer"):
        import_source(path, str(tmp_path / "s"), "sb3")
    assert not os.path.exists(tmp_path / "s")


# -- refusals and failures --------------------------------------------------------------------------------------
def test_existing_destinations_are_refused(image_store, tmp_path, capsys):
    dest = tmp_path / "taken.npz"
    dest.write_bytes(b"keep")
    assert main(["export", image_store, "--to", "npz", str(dest), "--quiet"]) == 2
    assert dest.read_bytes() == b"keep"
    assert "exists" in capsys.readouterr().err
    good = str(tmp_path / "good.npz")
    assert main(["export", image_store, "--to", "npz", good, "--quiet"]) == 0
    assert main(["import", good, image_store, "--quiet"]) == 2  # an existing store is never written into
    with EpisodeStore.open(image_store) as s:
        assert s.num_episodes == 6


@pytest.mark.parametrize("fmt", FORMATS)
def test_source_cut_short_leaves_nothing(image_store, tmp_path, fmt):
    """A file truncated half-way: the import fails with one line and no store, no temporary store is left."""
    needs(fmt)
    dest = str(tmp_path / f"x{SUFFIX[fmt]}")
    assert main(["export", image_store, "--to", fmt, dest, "--quiet"]) == 0
    raw = Path(dest).read_bytes()
    cut = str(tmp_path / f"cut{SUFFIX[fmt]}")
    Path(cut).write_bytes(raw[: len(raw) // 2])
    before = set(os.listdir(tmp_path))
    assert main(["import", cut, str(tmp_path / "s"), "--from", fmt, "--quiet"]) == 2
    assert set(os.listdir(tmp_path)) == before


def test_npz_member_damaged_after_some_episodes_leaves_nothing(image_store, tmp_path):
    """Episodes already appended when a member's CRC fails: the whole import is undone."""
    dest = str(tmp_path / "x.npz")
    assert main(["export", image_store, "--to", "npz", dest, "--quiet"]) == 0
    with zipfile.ZipFile(dest) as z:
        info = z.getinfo("actions.npy")
    raw = bytearray(Path(dest).read_bytes())
    at = info.header_offset + 30 + len(info.filename) + info.compress_size - 1  # the last byte of actions' data
    raw[at] ^= 0xFF
    Path(dest).write_bytes(bytes(raw))
    before = set(os.listdir(tmp_path))
    with pytest.raises(ValueError, match="not a complete npz"):
        import_source(dest, str(tmp_path / "s"))
    assert set(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("which", ["image_store", "ring_store"])
def test_failed_export_leaves_nothing(request, tmp_path, which, capsys):
    """An episode whose rows fail their checksum half-way through an export (read one by one from an image store,
    in batches from an uncompressed one): no DEST, no scratch files."""
    path = request.getfixturevalue(which)
    with EpisodeStore.open(path) as s:
        start, eid = int(s.episodes["start_row"][-2]), s.end_episode - 2
        row_bytes = next(a.row_shape[0] * 4 for a in s.layout.arrays if a.path == "packs/float32")
        chunk_rows = next(a.chunk_rows for a in s.layout.arrays if a.path == "packs/float32")
    with open(os.path.join(path, "packs", "float32", "c", str(start // chunk_rows), "0"), "r+b") as f:
        f.seek(start % chunk_rows * row_bytes)  # the first row of the last episode but one
        f.write(b"\xff" * row_bytes)
    for fmt in ("npz", "ogbench", "hdf5"):  # the core's formats first: without h5py the test skips at the last
        needs(fmt)
        before = set(os.listdir(tmp_path))
        assert main(["export", path, "--to", fmt, str(tmp_path / f"y{SUFFIX[fmt]}"), "--quiet"]) == 2
        assert f"episode {eid} do not match the crc32" in capsys.readouterr().err
        assert set(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("batch_rows", [1, 7, 40, 1 << 18])
def test_batches_are_the_episodes(ring_store, batch_rows):
    """Episodes read in batches (any batch size, a selection with gaps) are store.episode()'s, bit for bit."""
    with EpisodeStore.open(ring_store) as s:
        ids = np.arange(s.first_episode, s.end_episode)[[0, 1, 2, 5, 6, -1]]
        got = [(i, ep) for b in read_batches(s, ids, False, "x", batch_rows) for i, ep in b.episodes()]
        assert [i for i, _ in got] == ids.tolist()
        for i, ep in got:
            assert_episode_equal(ep, s.episode(i))


def _one_line(args: list[str], cwd: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "her_store.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.slow
def test_broken_inputs_exit_2_with_one_line(ring_store, tmp_path):
    root = ROOT
    good = str(tmp_path / "good.npz")
    assert main(["export", ring_store, "--to", "npz", good, "--quiet"]) == 0
    z = dict(np.load(good, allow_pickle=False))
    wrong_keys = str(tmp_path / "wrong.npz")
    np.savez(wrong_keys, something=np.zeros(3))
    mismatched = str(tmp_path / "mismatched.npz")
    np.savez(mismatched, **{**z, "episode_lengths": z["episode_lengths"] + 1})
    bad_card = str(tmp_path / "card.npz")
    head = json.loads(z["her_store_header"].tobytes())
    head["metadata"]["ref_min_score"] = "low"
    np.savez(bad_card, **{**z, "her_store_header": np.frombuffer(json.dumps(head).encode(), np.uint8)})
    no_header_h5 = str(tmp_path / "plain.h5")
    h5py = needs("hdf5")

    with h5py.File(no_header_h5, "w") as f:
        f.create_dataset("x", data=np.zeros(3))
    cases = {
        "wrong": (["import", wrong_keys, str(tmp_path / "a")], "neither"),
        "mismatched": (["import", mismatched, str(tmp_path / "b")], "episode_lengths"),
        "card": (["import", bad_card, str(tmp_path / "c")], "ref_min_score"),
        "h5": (["import", no_header_h5, str(tmp_path / "d")], "not written by her-store export"),
        "not a store": (["export", str(tmp_path), "--to", "npz", str(tmp_path / "e.npz")], "store"),
        "missing": (["import", str(tmp_path / "nothing.npz"), str(tmp_path / "f")], "does not exist"),
    }
    for name, (args, words) in cases.items():
        line = _one_line([*args, "--quiet"], root)
        assert line.startswith(f"her-store {args[0]}:") and words in line, (name, line)
    assert not any(os.path.exists(tmp_path / x) for x in "abcdef")


@pytest.mark.parametrize("to", ["npz", "minari"])
def test_an_empty_or_unwritable_destination_is_named_in_the_error(ring_store, tmp_path, capsys, monkeypatch, to):
    """An empty DEST is refused (it was taken for the current directory), and a destination whose directory takes
    no file is named in the error (not the partial file written beside it)."""
    if to == "minari":
        needs("minari")
    monkeypatch.chdir(tmp_path)
    assert main(["export", ring_store, "--to", to, "", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == "her-store export: the destination is an empty path; name a file to write"
    assert os.listdir(tmp_path) == ["ring"]
    if to == "npz":  # a directory of the kernel's, which takes no new file
        assert main(["export", ring_store, "--to", "npz", "/proc/x.npz", "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("her-store export: [Errno 2] /proc/x.npz cannot be written: ") and "partial" not in err


def test_import_help_warns_about_pickles(capsys):
    with pytest.raises(SystemExit):
        main(["import", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "unpickling runs code" in out and "desired_goal = the episode's final observation" in out


def test_guess_format(tmp_path):
    assert guess_format("D4RL/door/human-v2") == "minari"
    (tmp_path / "ds").mkdir()
    assert guess_format(str(tmp_path / "ds")) == "minari"
    with pytest.raises(ValueError, match="cannot tell"):
        (tmp_path / "x.bin").write_bytes(b"")
        guess_format(str(tmp_path / "x.bin"))
    with pytest.raises(ValueError, match="URL"):
        import_source(str(tmp_path / "x.bin"), "s3://bucket/store", "npz")


def test_minari_is_wired(ring_store, tmp_path):
    """--to minari and a dataset directory as SOURCE reach her_store.interop.minari."""
    needs("minari")
    dest = str(tmp_path / "ring-v0")
    assert main(["export", ring_store, "--to", "minari", dest, "--episodes=-3:", "--quiet"]) == 0
    assert guess_format(dest) == "minari"
    assert main(["import", dest, str(tmp_path / "back"), "--quiet"]) == 0
    with EpisodeStore.open(ring_store) as s, EpisodeStore.open(str(tmp_path / "back")) as b:
        assert b.num_episodes == 3
        assert_episode_equal(b.episode(2), s.episode(s.end_episode - 1))


@pytest.mark.slow
def test_export_from_object_storage(s3_url, tmp_path):
    """A store on S3 (the loopback server) exports as a local one does: batches gathered through ranged reads."""
    url, opts = s3_url
    obs, act = fetch_spaces()
    with EpisodeStore.create(url, obs, act, metadata=CARD, storage_options=opts) as store:
        for i in range(5):
            store.append_episode(make_episode(obs, act, 4 + i, i))
    with EpisodeStore.open(url, storage_options=opts) as store:
        dest = str(tmp_path / "s3.npz")
        from her_store.interop.npz import export_npz

        export_npz(store, np.arange(5), dest)
        want = [store.episode(i) for i in range(5)]
    assert import_source(dest, str(tmp_path / "back")) == 5
    with EpisodeStore.open(str(tmp_path / "back")) as got:
        assert got.metadata == CARD
        for i in range(5):
            assert_episode_equal(got.episode(i), want[i])


@pytest.mark.slow
def test_hostile_files_are_refused_in_one_line_before_they_are_read(ring_store, tmp_path):
    """Files made by someone else: data kept outside the file, links, claims of more bytes than memory holds,
    JSON nested past any parser, and npy headers that are not Python literals."""
    h5py = needs("hdf5")

    root = ROOT
    good_h5, good_npz = str(tmp_path / "good.hdf5"), str(tmp_path / "good.npz")
    assert main(["export", ring_store, "--to", "hdf5", good_h5, "--quiet"]) == 0
    assert main(["export", ring_store, "--to", "npz", good_npz, "--quiet"]) == 0
    with h5py.File(good_h5, "r") as f:
        first = sorted(f)[0]
        T = f[f"{first}/actions"].shape[0]
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"private " * 64)
    h5_cases = {
        "external": (lambda f: f.create_dataset(f"{first}/actions", shape=(T, 4), dtype="float32",
                                                external=[(str(secret), 0, T * 16)]), "outside the file"),
        "soft link": (lambda f: f.__setitem__(f"{first}/actions", h5py.SoftLink(f"/{first}/rewards")), "SoftLink"),
        "external link": (lambda f: f.__setitem__(f"{first}/actions", h5py.ExternalLink(str(secret), "/x")),
                          "ExternalLink"),
        "huge": (lambda f: f.create_dataset(f"{first}/actions", shape=(10**9, 4), dtype="float32"), "per dataset"),
    }
    for name, (make, words) in h5_cases.items():
        path = str(tmp_path / f"{name.replace(' ', '_')}.hdf5")
        with open(good_h5, "rb") as src, open(path, "wb") as dst:
            dst.write(src.read())
        with h5py.File(path, "r+") as f:
            del f[f"{first}/actions"]
            make(f)
        line = _one_line(["import", path, str(tmp_path / "out"), "--quiet"], root)
        assert words in line, (name, line)
    z = dict(np.load(good_npz, allow_pickle=False))
    deep = str(tmp_path / "deep.npz")
    np.savez(deep, **{**z, "her_store_header": np.frombuffer(b"[" * 100_000 + b"]" * 100_000, np.uint8)})
    assert "nested too deep" in _one_line(["import", deep, str(tmp_path / "out"), "--quiet"], root)
    claims = str(tmp_path / "claims.npz")  # a header that claims a billion rows over a few bytes
    with zipfile.ZipFile(good_npz) as src, zipfile.ZipFile(claims, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "actions.npy":
                head = {"descr": "<f4", "fortran_order": False, "shape": (10**9, 4)}
                buf = __import__("io").BytesIO()
                np.lib.format.write_array_header_1_0(buf, head)
                data = buf.getvalue() + b"\0" * 64
            dst.writestr(info.filename, data)
    assert "claims shape (1000000000, 4)" in _one_line(["import", claims, str(tmp_path / "out"), "--quiet"], root)
    bad_npy = str(tmp_path / "badheader.npz")
    with zipfile.ZipFile(good_npz) as src, zipfile.ZipFile(bad_npy, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "actions.npy":
                header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,\n"
                data = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header
            dst.writestr(info.filename, data)
    assert "no valid .npy header" in _one_line(["import", bad_npy, str(tmp_path / "out"), "--quiet"], root)
    assert not os.path.exists(tmp_path / "out")


def test_a_damaged_hdf5_export_is_refused_not_imported_as_other_data(ring_store, tmp_path):
    h5py = needs("hdf5")

    path = str(tmp_path / "x.hdf5")
    assert main(["export", ring_store, "--to", "hdf5", path, "--quiet"]) == 0
    with h5py.File(path, "r+") as f:
        name = sorted(f)[2]
        actions = f[f"{name}/actions"][()]
        actions.reshape(-1)[0] += 1.0  # a changed value, same shape and dtype: HDF5 itself notices nothing
        f[f"{name}/actions"][...] = actions
    with pytest.raises(ValueError, match=f"{name} does not match the crc32 its export recorded"):
        import_source(path, str(tmp_path / "s"))
    assert not os.path.exists(tmp_path / "s")


def _ring_model(obs, act, i: int) -> dict[str, np.ndarray]:
    """Episode ``i`` of the ring stores below: the same content for the same id, whichever process writes it."""
    return make_episode(obs, act, 5 + i % 7, i)


@pytest.mark.parametrize("compressed", [False, True], ids=["uncompressed", "compressed"])
def test_read_batches_leaves_out_what_the_writer_evicted_while_it_was_read(tmp_path, compressed):
    """Between two batches of an export's read, the ring's writer evicts the next batch's episodes and overwrites
    their rows: they are left out with one warning naming them, the later episodes come bit-exact, and an episode of
    the live range whose rows are damaged still raises."""
    obs, act = fetch_spaces()
    path = str(tmp_path / "ring")
    kw = {"compressors": {"observation": "zstd"}} if compressed else {}
    with EpisodeStore.create(path, obs, act, capacity=120, **kw) as w:
        for i in range(12):
            w.append_episode(_ring_model(obs, act, i))
        w.flush()
        with EpisodeStore.open(path) as store:
            ids = np.arange(store.first_episode, store.end_episode)
            batches = read_batches(store, ids, False, "exporting", batch_rows=32)
            got = [next(batches)]
            end, target = w.end_episode, int(got[0].ids[-1]) + 1  # the next batch's first episode

            def intact() -> bool:  # through the reader's own (stale) view of the index
                try:
                    store.episode(target)
                except (CorruptStoreError, EpisodeNotFoundError):
                    return False
                return True

            while intact():  # until it is evicted and its rows reused
                w.append_episode(_ring_model(obs, act, end))
                w.flush()
                end += 1
            with pytest.warns(UserWarning, match=r"evicted by the store's writer while they were read"):
                got += list(batches)
    seen = np.concatenate([b.ids for b in got])
    assert len(seen) < len(ids) and seen[0] == ids[0]  # some left out, the first batch kept
    assert np.all(np.diff(seen) > 0) and set(seen) <= set(ids.tolist())
    for batch in got:
        for i, ep in batch.episodes():
            assert_episode_equal(ep, _ring_model(obs, act, i))


@pytest.mark.slow
def test_exports_of_a_ring_its_writer_keeps_evicting(tmp_path):
    """Each export format of a small ring store while a writer process appends and commits all the time: every
    export succeeds, and every episode in it is bit-exact the episode of its id (the writer evicts some while they
    are read: those are left out, never exported torn)."""
    obs, act = fetch_spaces()
    path = str(tmp_path / "ring")
    with EpisodeStore.create(path, obs, act, capacity=400, metadata={"dataset_id": "ring-v0"}) as w:
        for i in range(40):
            w.append_episode(_ring_model(obs, act, i))
    writer = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\n"
            "from her_store import EpisodeStore\n"
            "from tests.conftest import fetch_spaces\n"
            "from tests.interop.test_interop import _ring_model\n"
            "obs, act = fetch_spaces()\n"
            "with EpisodeStore.open(sys.argv[1], mode='a', commit_interval=0.0) as s:\n"
            "    print(flush=True)\n"
            "    i = s.end_episode\n"
            "    while True:\n"
            "        s.append_episode(_ring_model(obs, act, i)); i += 1\n"
        ), path],
        cwd=str(Path(ROOT)), stdout=subprocess.PIPE,
    )
    try:
        writer.stdout.readline()  # the writer holds the store
        for fmt in ("npz", "ogbench", "hdf5", "minari"):  # the core's formats first: the others skip without theirs
            needs(fmt)
            dest = tmp_path / f"out-{fmt}-v0"
            with EpisodeStore.open(path) as source:  # the export's episodes are among ids lo .. hi - 1
                lo = source.first_episode
                with warnings.catch_warnings():  # the episodes left out are named in a warning
                    warnings.filterwarnings("ignore", "(?s).*evicted by the store's writer")
                    episodes, transitions = export_store(path, fmt, dest)
                source.refresh()
                hi = source.end_episode
            back = tmp_path / f"back-{fmt}"
            assert import_source(str(dest), str(back), fmt=fmt) == episodes
            with EpisodeStore.open(back) as store:
                assert store.num_transitions == transitions
                i = lo
                for k in range(store.first_episode, store.end_episode):  # ids ascend; a gap where some were evicted
                    ep = store.episode(k)
                    while i < hi and not _same(ep, _ring_model(obs, act, i)):
                        i += 1
                    assert i < hi, f"{fmt}: episode {k} of the export is no episode {lo}..{hi - 1} the writer wrote"
                    i += 1
    finally:
        writer.kill()
        writer.wait()


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return len(got["action"]) == len(want["action"]) and all(
        np.array_equal(np.asarray(got[k]), want[k]) for k in ("observation", "achieved_goal", "desired_goal", "action")
    )


# -- inputs made elsewhere ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("fmt", [None, "npz", "ogbench", "sb3"])
def test_an_input_that_is_a_fifo_is_refused_at_once(tmp_path, fmt):
    """Opening a FIFO blocks until someone writes to it: the import hung forever. Refused by name now."""
    needs(fmt)
    fifo = tmp_path / ("in.pkl" if fmt == "sb3" else "in.npz")
    os.mkfifo(fifo)
    args = [sys.executable, "-m", "her_store.cli", "import", "--quiet", str(fifo), str(tmp_path / "s")]
    args += ["--from", fmt] if fmt else []
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and f"{fifo} is a FIFO, not a regular file" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "s")


def test_an_npz_member_flagged_encrypted_is_refused_naming_the_file(ring_store, tmp_path):
    src = str(tmp_path / "e.npz")
    export_store(ring_store, "npz", src)
    raw = bytearray(Path(src).read_bytes())
    for magic, flag in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):  # bit 0 of each entry's flags: encrypted
        i = 0
        while (i := raw.find(magic, i)) >= 0:
            raw[i + flag] |= 1
            i += 4
    Path(src).write_bytes(raw)
    with pytest.raises(ValueError, match=rf"^{re.escape(src)} cannot be read as an npz file \(.*encrypted"):
        import_source(src, str(tmp_path / "s"))


def test_an_npz_episode_claiming_more_than_a_read_may_hold_is_refused_unread(ring_store, tmp_path, monkeypatch):
    """A file of deflated zeros can claim any episode length: each field of an episode is one read, refused past
    MEMBER_LIMIT bytes before anything is allocated (as HDF5 datasets are)."""
    from her_store.interop import checks

    src = str(tmp_path / "e.npz")
    export_store(ring_store, "npz", src)
    monkeypatch.setattr(checks, "MEMBER_LIMIT", 64)
    with pytest.raises(ValueError, match=r"rows of array '.*' are [\d,]+ bytes; at most 64 are read at once"):
        import_source(src, str(tmp_path / "s"))
    assert not os.path.exists(tmp_path / "s")


@pytest.mark.parametrize(
    "arrays,words",
    [
        ({"terminals": np.array([0, 0, np.nan, 1, 0, 0, 1], np.float32)}, r"terminals holds nan at row 2; expected 1"),
        ({"terminals": np.array([0, 0, 0, 1, 0, -1, 1])}, r"terminals holds -1 at row 5; expected 1"),
        ({"masks": np.array([1, 0.5, 1, 0, 1, 1, 0], np.float32)}, r"masks holds 0\.5 at row 1 of trajectory 0"),
        ({"observation": np.zeros((7, 2), np.float32)}, r"array 'observation' would be stored as the observation key"),
        ({"achieved_goal": np.zeros((7, 2), np.float32)}, r"has achieved_goal but not desired_goal"),
        ({"qpos": np.zeros((7, 2), np.complex64)}, r"array 'qpos' is of dtype complex64; expected numbers"),
    ],
    ids=["NaN terminal", "-1 terminal", "0.5 mask", "a second observation", "half the goals", "complex"],
)
def test_an_ogbench_file_whose_flags_or_names_mean_nothing_clear_is_refused(tmp_path, arrays, words):
    """Flags other than 0 and 1 counted as ends (NaN, 0.5, -1) or were silently not terminal; an extra array named
    'observation' replaced the observations; a lone achieved_goal was dropped. Each is refused naming the file."""
    src = str(tmp_path / "cube-v0.npz")
    rng = np.random.default_rng(1)
    base = {
        "observations": rng.standard_normal((7, 2)).astype(np.float32),
        "actions": rng.uniform(-1, 1, (7, 2)).astype(np.float32),
        "terminals": np.array([0, 0, 0, 1, 0, 0, 1], bool),
    }
    np.savez(src, **{**base, **arrays})
    with pytest.raises(ValueError, match=rf"^{re.escape(src)}:? .*{words}"):
        import_source(src, str(tmp_path / "s"), "ogbench")
    assert not os.path.exists(tmp_path / "s")


def test_hdf5_and_npz_headers_from_elsewhere_are_refused_naming_the_file(ring_store, tmp_path):
    """An episode's crc32 attribute that is an array gave numpy's 'truth value of an array is ambiguous'; a header
    whose schema is missing gave a message naming neither the file nor its header."""
    h5py = needs("hdf5")
    src = str(tmp_path / "e.hdf5")
    export_store(ring_store, "hdf5", src)
    with h5py.File(src, "r+") as f:
        first = min(k for k in f if k.startswith("episode_"))
        f[first].attrs["crc32"] = np.array([1, 2])
    with pytest.raises(ValueError, match=rf"^{re.escape(src)}: {first} does not match the crc32 its export recorded"):
        import_source(src, str(tmp_path / "s"))
    npz = str(tmp_path / "e.npz")
    header = json.dumps({"format": "her_store.npz", "version": 1, "schema": None})
    np.savez(npz, her_store_header=np.frombuffer(header.encode(), np.uint8), episode_lengths=np.array([1]))
    with pytest.raises(StoreError, match=rf"^{re.escape(npz)}: the spaces of its her_store_header: schema None"):
        import_source(npz, str(tmp_path / "t"), "npz")


@pytest.mark.parametrize("lengths", [np.array([2**64 - 1], np.uint64), np.array([2**62] * 4, np.int64)])
def test_npz_episode_lengths_past_any_episode_are_refused_before_they_wrap(ring_store, tmp_path, lengths):
    """uint64 lengths near 2**64 turned negative in the cast to int64, and huge int64 lengths wrapped their sum,
    after the check that each is at least 1."""
    src, bad = str(tmp_path / "e.npz"), str(tmp_path / "b.npz")
    export_store(ring_store, "npz", src)
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(bad, **{**arrays, "episode_lengths": lengths})
    with pytest.raises(ValueError, match=rf"^{re.escape(bad)}: episode_lengths holds [\d,]+; an episode has fewer"):
        import_source(bad, str(tmp_path / "s"))


def test_an_episode_claiming_more_than_memory_should_hold_is_refused_unread(ring_store, tmp_path, monkeypatch):
    """Each field was bounded (MEMBER_LIMIT) but not an episode's fields together: an HDF5 episode of datasets never
    written (24 KB of file) was read into 2.1 GB before its crc32 refused it, and an npz of deflated zeros imported a
    20,000,000-step episode through 3.6 GB. An episode is now refused, unread, past EPISODE_LIMIT bytes together."""
    h5py = needs("hdf5")

    from her_store.interop import checks

    monkeypatch.setattr(checks, "EPISODE_LIMIT", 1 << 20)
    good_h5, good_npz = str(tmp_path / "good.hdf5"), str(tmp_path / "good.npz")
    assert main(["export", ring_store, "--to", "hdf5", good_h5, "--quiet"]) == 0
    assert main(["export", ring_store, "--to", "npz", good_npz, "--quiet"]) == 0
    with h5py.File(good_h5, "r+") as f:
        name = sorted(f)[1]
        for key in ("observations/observation", "observations/achieved_goal", "observations/desired_goal"):
            width = f[f"{name}/{key}"].shape[1]
            del f[f"{name}/{key}"]
            f.create_dataset(f"{name}/{key}", shape=(1 << 14, width), dtype="float32", chunks=(1024, width))
    with pytest.raises(ValueError, match=f"{name} holds datasets of more than 1,048,576 bytes together"):
        import_source(good_h5, str(tmp_path / "h"))
    z = dict(np.load(good_npz, allow_pickle=False))
    T = 1 << 14  # one long episode of zeros, deflated: a few KB of file
    long = {"her_store_header": z["her_store_header"], "episode_lengths": np.array([T]), "episode_ids": np.array([0])}
    for k, v in z.items():
        if k not in long:
            long[k] = np.zeros((T + 1 if k.startswith("observations/") else T, *v.shape[1:]), v.dtype)
    path = str(tmp_path / "long.npz")
    np.savez_compressed(path, **long)
    with pytest.raises(ValueError, match=r"long.npz: episode 0 \(16,384 steps\) takes [\d,]+ bytes in its fields"):
        import_source(path, str(tmp_path / "n"))
    assert not os.path.exists(tmp_path / "h") and not os.path.exists(tmp_path / "n")


def test_episode_groups_are_named_as_export_names_them(ring_store, tmp_path):
    """``episode_00`` beside ``episode_0`` was read as id 0 twice: the episode was imported twice."""
    h5py = needs("hdf5")

    path = str(tmp_path / "x.hdf5")
    assert main(["export", ring_store, "--to", "hdf5", path, "--quiet"]) == 0
    with h5py.File(path, "r+") as f:
        first = min(f, key=lambda n: int(n.split("_")[1]))
        f.copy(first, first.replace("_", "_0"))
    with pytest.raises(ValueError, match=r"expected only groups episode_<id>, found \['episode_0"):
        import_source(path, str(tmp_path / "s"))


def test_a_refused_episode_is_named_with_its_file_and_place(ring_store, tmp_path):
    """What the store refuses in an imported episode (a value its space cannot hold, no step) names the file and the
    episode, not only the field."""
    h5py = needs("hdf5")

    obs, _ = fetch_spaces()
    act = spaces.Discrete(3)
    src = str(tmp_path / "discrete")
    with EpisodeStore.create(src, obs, act) as store:
        for i in range(2):
            ep = make_episode(obs, act, 4, i)
            store.append_episode(ep)
    npz = str(tmp_path / "d.npz")
    assert main(["export", src, "--to", "npz", npz, "--quiet"]) == 0
    z = dict(np.load(npz, allow_pickle=False))
    z["actions"] = z["actions"].copy()
    z["actions"][5] = 7  # episode 1's second action
    np.savez(npz, **z)
    with pytest.raises(ValueError, match=r"d.npz: episode 1 \(4 steps\): field 'action' has 7"):
        import_source(npz, str(tmp_path / "s"))
    h5 = str(tmp_path / "r.hdf5")
    assert main(["export", ring_store, "--to", "hdf5", h5, "--quiet"]) == 0
    with h5py.File(h5, "r+") as f:
        name = min(f)
        for key in list(f[name].keys()):
            if isinstance(f[f"{name}/{key}"], h5py.Dataset):
                d = f[f"{name}/{key}"]
                shape, dtype = d.shape, d.dtype
                del f[f"{name}/{key}"]
                f.create_dataset(f"{name}/{key}", shape=(1 if key == "observations" else 0, *shape[1:]), dtype=dtype)
        for key in f[f"{name}/observations"]:
            d = f[f"{name}/observations/{key}"]
            shape, dtype = d.shape, d.dtype
            del f[f"{name}/observations/{key}"]
            f.create_dataset(f"{name}/observations/{key}", shape=(1, *shape[1:]), dtype=dtype)
        f[name].attrs["crc32"] = 0
    with pytest.raises(ValueError, match=rf"r.hdf5: {name}"):
        import_source(h5, str(tmp_path / "t"))


def test_a_64_bit_integer_past_what_its_space_holds_is_refused(tmp_path):
    """An OGBench file without a header gets integer spaces bounded at +-2**53 (the store's JSON spaces hold no more
    exactly); a value past them was stored anyway, under a space that excludes it, and verify called it clean."""
    path = str(tmp_path / "og.npz")
    actions = np.zeros((7, 2), np.int64)
    actions[5, 1] = 2**62
    rng = np.random.default_rng(1)
    np.savez(path, observations=rng.standard_normal((7, 2)).astype(np.float32), actions=actions,
             terminals=np.array([0, 0, 0, 1, 0, 0, 1], bool))
    with pytest.raises(ValueError, match=r"'actions' holds 4611686018427387904 at row 1 of trajectory 1"):
        import_source(path, str(tmp_path / "s"), "ogbench")
    actions[5, 1] = 2**53  # at the bound: kept
    np.savez(path, observations=rng.standard_normal((7, 2)).astype(np.float32), actions=actions,
             terminals=np.array([0, 0, 0, 1, 0, 0, 1], bool))
    assert import_source(path, str(tmp_path / "s"), "ogbench") == 2
    with EpisodeStore.open(str(tmp_path / "s")) as store:
        assert store.episode(1)["action"][1, 1] == 2**53
