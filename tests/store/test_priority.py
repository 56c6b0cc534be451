"""Episode priorities: computed at append (trajectory energy or priority_fn), committed in the index, kept across
reopen, kill -9 and ring eviction; stores of format version 3 are read and appended to without them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from her_store import EpisodeStore, HerSampler, StoreError, open_store
from her_store.errors import EpisodeValidationError
from her_store.store.energy import EnergyPriority
from tests.conftest import fetch_spaces, make_episode

V3_STORE = os.path.join(os.path.dirname(__file__), "..", "data", "v3_store")


def _energy_by_steps(ag: np.ndarray, clip=0.5, dt=0.04, m=1.0, g=9.81, height_axis=2) -> float:
    """The paper's trajectory energy written step by step, as a reference."""
    total, prev = 0.0, 0.0
    for t in range(1, len(ag)):
        v = (ag[t] - ag[t - 1]) / dt
        e = 0.5 * m * float(v @ v)
        if len(ag[t]) > height_axis:
            e += m * g * (ag[t][height_axis] - ag[0][height_axis])
        total += min(max(e - prev, 0.0), clip)
        prev = e
    return total


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("clip", [0.5, 2.5, 100.0])
def test_energy_is_the_clipped_sum_of_the_paths_energy_increases(dim, clip):
    rng = np.random.default_rng(dim)
    ag = np.cumsum(rng.normal(0, 0.02, (51, dim)), axis=0).astype(np.float32)
    got = EnergyPriority(clip=clip)({"achieved_goal": ag})
    assert got == pytest.approx(_energy_by_steps(ag.astype(np.float64), clip=clip), rel=1e-9)
    assert 0 < got <= clip * 50


def test_energy_priority_refuses_bad_parameters():
    with pytest.raises(ValueError, match="delta_t"):
        EnergyPriority(delta_t=0)
    with pytest.raises(ValueError, match="clip"):
        EnergyPriority(clip=-1)


def test_each_appended_episode_commits_its_energy_and_reopens_with_it(store_path):
    obs, act = fetch_spaces()
    episodes = [make_episode(obs, act, 5 + i % 9, i) for i in range(30)]
    with open_store(store_path, obs, act) as store:
        for ep in episodes:
            store.append_episode(ep)
    with EpisodeStore.open(store_path) as store:
        got = store.episodes["priority"]
    want = [_energy_by_steps(ep["achieved_goal"].astype(np.float64)) for ep in episodes]
    np.testing.assert_allclose(got, want, rtol=1e-9)


def test_a_priority_fn_given_at_open_sets_the_priorities(store_path):
    obs, act = fetch_spaces()
    with open_store(store_path, obs, act, priority_fn=lambda ep: float(len(ep["action"]))) as store:
        for i in range(5):
            store.append_episode(make_episode(obs, act, 3 + i, i))
        w = store.writer(2)
        for t in range(4):
            o = {k: np.zeros((2, *s.shape), np.float32) for k, s in obs.spaces.items()}
            w.add(o, o, np.zeros((2, 4), np.float32), np.zeros(2), np.array([False, t == 3]), np.array([t == 3, False]))
    with EpisodeStore.open(store_path) as store:
        assert store.episodes["priority"].tolist() == [3.0, 4.0, 5.0, 6.0, 7.0, 4.0, 4.0]


@pytest.mark.parametrize("value", [float("nan"), -1.0, "high", None, True, float("inf")])
def test_a_priority_fn_returning_no_priority_refuses_the_episode_and_keeps_the_store(store_path, value):
    obs, act = fetch_spaces()
    with open_store(store_path, obs, act, priority_fn=lambda ep: value if len(ep["action"]) == 4 else 1.0) as store:
        store.append_episode(make_episode(obs, act, 3, 0))
        with pytest.raises(EpisodeValidationError, match="priority_fn .* returned .* expected a finite number >= 0"):
            store.append_episode(make_episode(obs, act, 4, 1))
        store.append_episode(make_episode(obs, act, 5, 2))
    with EpisodeStore.open(store_path) as store:
        assert store.episodes["length"].tolist() == [3, 5] and store.episodes["priority"].tolist() == [1.0, 1.0]


def test_priorities_follow_their_episodes_through_ring_eviction(store_path):
    obs, act = fetch_spaces()
    episodes = {i: make_episode(obs, act, 7 + i % 5, i) for i in range(80)}
    with open_store(store_path, obs, act, capacity=200) as store:
        for ep in episodes.values():
            store.append_episode(ep)
        assert store.first_episode > 20  # wrapped several times
    with EpisodeStore.open(store_path) as store:
        table = store.episodes
        want = [EnergyPriority()(episodes[int(i)]) for i in table["episode_id"]]
        np.testing.assert_allclose(table["priority"], want, rtol=1e-12)
        assert np.all(store.snapshot().priorities == table["priority"])


def test_priorities_committed_before_a_kill_9_are_there_after(tmp_path):
    path = tmp_path / "store"
    script = textwrap.dedent(f"""
        import os, signal
        from her_store import open_store
        from tests.conftest import fetch_spaces, make_episode
        obs, act = fetch_spaces()
        store = open_store({str(path)!r}, obs, act, commit_interval=0)
        for i in range(12):
            store.append_episode(make_episode(obs, act, 6, i))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == -signal.SIGKILL
    obs, act = fetch_spaces()
    with EpisodeStore.open(path) as store:
        assert store.num_episodes == 12
        want = [EnergyPriority()(make_episode(obs, act, 6, i)) for i in range(12)]
        np.testing.assert_allclose(store.episodes["priority"], want, rtol=1e-12)


def test_a_version_3_store_reads_appends_and_refuses_energy_sampling_by_name(tmp_path):
    path = tmp_path / "v3"
    shutil.copytree(V3_STORE, path)
    with EpisodeStore.open(path, mode="a") as store:
        n = store.num_episodes
        assert store.layout.version == 3 and not store.episodes["priority"].any()
        ep = {k: np.asarray(v) for k, v in store.episode(store.first_episode).items()}
        store.append_episode(ep)
        with pytest.raises(StoreError, match="format version 3, whose episodes have no priority"):
            HerSampler(store, 8, prioritize="energy", n_sampled_goal=0)
        HerSampler(store, 8, prioritize="td", n_sampled_goal=0, priority_checkpoint=None).sample()
    assert not os.path.exists(path / "episodes" / "priority")
    with EpisodeStore.open(path) as store:
        assert store.num_episodes == n + 1 and store.layout.version == 3


def test_goals_with_nan_are_appended_with_the_energy_of_their_other_steps(store_path, tmp_path):
    obs, act = fetch_spaces()
    ep = make_episode(obs, act, 6, 0)
    ep["achieved_goal"][3] = np.nan
    clean = {**ep, "achieved_goal": ep["achieved_goal"][:3]}
    with open_store(store_path, obs, act) as store:
        store.append_episode(ep)
        got = store.episodes["priority"][0]
    assert np.isfinite(got) and got >= EnergyPriority()(clean)  # the NaN steps add nothing
    v3 = tmp_path / "v3"
    shutil.copytree(V3_STORE, v3)
    with EpisodeStore.open(v3, mode="a") as store:
        copy = {k: np.asarray(v) for k, v in store.episode(store.first_episode).items()}
        copy["achieved_goal"] = copy["achieved_goal"].astype(np.float64) * np.nan
        store.append_episode(copy)  # a version 3 store computes no priority: nothing to refuse
        assert not store.episodes["priority"].any()  # and holds none in memory that it would not store
