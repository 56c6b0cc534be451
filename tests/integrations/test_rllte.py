"""rllte's HerReplayStorage over the disk store: real PointGoal envs, real stores in tmp_path, torch tensors in."""

from __future__ import annotations

import gc
import os
import tempfile
import time

import numpy as np
import pytest
import torch
from gymnasium import spaces

from her_store import EpisodeStore, StepWriter, open_dataset, open_store
from her_store.checks import ArgumentTypeError
from her_store.envs import ENV_ID, PointGoalEnv
from her_store.errors import EpisodeValidationError, SchemaMismatchError, StoreError
from her_store.integrations.rllte import HerReplayBatch, HerReplayStorage, NoEpisodeError
from tests.conftest import fetch_spaces

ENV = PointGoalEnv()
OBS, ACT = ENV.observation_space, ENV.action_space


def stack(obs: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.stack([o[k] for o in obs])) for k in OBS.spaces}


def collect(storage: HerReplayStorage, steps: int, seed: int = 0, episode_steps: int = 5) -> None:
    """Step ``storage.num_envs`` PointGoal envs with random actions, handing rllte-style tensors to ``add``."""
    n = storage.num_envs
    envs = [PointGoalEnv(max_episode_steps=episode_steps + i) for i in range(n)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        actions = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
        results = [env.step(a) for env, a in zip(envs, actions, strict=True)]
        nxt = [r[0] for r in results]
        storage.add(
            stack(obs), torch.as_tensor(actions), torch.tensor([r[1] for r in results]),
            torch.tensor([float(r[2]) for r in results]), torch.tensor([float(r[3]) for r in results]),
            [r[4] for r in results], stack(nxt),
        )
        obs = [env.reset()[0] if r[2] or r[3] else o for env, r, o in zip(envs, results, nxt, strict=True)]


def stored_rows(store: EpisodeStore) -> dict[bytes, tuple[np.ndarray, int]]:
    """Observation bytes -> (the episode's next achieved goals from that step on, step) for every stored row."""
    rows = {}
    for i in range(store.first_episode, store.end_episode):
        ep = store.episode(i)
        for t in range(len(ep["action"])):
            rows[ep["observation"][t].tobytes()] = (ep["achieved_goal"][t + 1 :], t)
    return rows


@pytest.fixture
def storage(tmp_path):
    s = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=64, storage_size=500, path=tmp_path / "s", seed=0,
                         metadata={"env_id": ENV_ID})
    yield s
    s.close()


def test_batch_shapes_dtypes_and_future_goals(storage):
    collect(storage, 23)
    batch = storage.sample(step=100)
    assert isinstance(batch, HerReplayBatch)
    assert batch._fields == ("observations", "actions", "rewards", "terminateds", "truncateds", "next_observations")
    B = 64
    assert {k: tuple(v.shape) for k, v in batch.observations.items()} == {
        "observation": (B, 4), "achieved_goal": (B, 2), "desired_goal": (B, 2)}
    assert batch.actions.shape == (B, 2)
    for t in (batch.rewards, batch.terminateds, batch.truncateds):
        assert t.shape == (B, 1) and t.dtype == torch.float32 and t.device.type == "cpu"
    rows = stored_rows(storage.store)
    n_her = int(0.8 * B)
    desired = batch.observations["desired_goal"].numpy()
    np.testing.assert_array_equal(desired, batch.next_observations["desired_goal"].numpy())
    for i in range(n_her):  # each relabelled goal is an achieved goal reached later in the sampled episode
        future, _ = rows[batch.observations["observation"][i].numpy().tobytes()]
        assert (future == desired[i]).all(axis=1).any()
    # rewards recomputed with the env's compute_reward (the default, from the store's env_id)
    want = ENV.compute_reward(batch.next_observations["achieved_goal"].numpy()[:n_her], desired[:n_her], None)
    np.testing.assert_array_equal(batch.rewards.numpy()[:n_her, 0], want)
    assert storage.update(batch, step=1) is None


def test_reward_fn_shape_n1_and_wrong_count(tmp_path):
    calls = []

    def column(ag, dg, infos):
        calls.append(len(infos))
        return np.full((len(ag), 1), 7.0)

    s = HerReplayStorage(OBS, ACT, batch_size=10, reward_fn=column, path=tmp_path / "a", storage_size=100)
    collect(s, 6)
    b = s.sample()
    assert b.rewards.shape == (10, 1) and (b.rewards[:8] == 7.0).all() and calls == [8]
    s.sampler.reward_fn = lambda ag, dg, infos: np.zeros(3)
    with pytest.raises(ValueError, match=r"reward_fn returned 3 values .* for 8 transitions"):
        s.sample()
    s.close()


def test_random_strategy_takes_goals_from_any_episode(tmp_path):
    s = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=200, goal_selection_strategy="random",
                         reward_fn=ENV.compute_reward, path=tmp_path / "r", seed=1)
    collect(s, 30)
    b = s.sample()
    achieved = {g.tobytes() for i in range(s.store.end_episode) for g in s.store.episode(i)["achieved_goal"][1:]}
    rows = stored_rows(s.store)
    goals = b.observations["desired_goal"].numpy()[:160]
    assert all(g.tobytes() in achieved for g in goals)
    own = sum(any((rows[o.tobytes()][0] == g).all(axis=1))
              for o, g in zip(b.observations["observation"].numpy()[:160], goals, strict=True))
    assert own < 160  # not restricted to the transition's own episode
    s.close()


def test_copy_info_dict_hands_per_transition_infos(tmp_path):
    seen = []

    def reward(ag, dg, infos):
        seen.extend(infos)
        return ENV.compute_reward(ag, dg, None)

    s = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=50, reward_fn=reward, copy_info_dict=True,
                         info_keys=["is_success"], path=tmp_path / "i", storage_size=None)
    assert s.store.capacity is None  # unbounded
    collect(s, 12)
    s.sample()
    assert len(seen) == 40 and all(set(d) == {"is_success"} for d in seen)
    stored = np.concatenate([s.store.episode(i)["is_success"] for i in range(s.store.end_episode)])
    assert {float(d["is_success"]) for d in seen} <= set(stored.tolist())
    s.close()
    with pytest.raises(ValueError, match="info_keys"):
        HerReplayStorage(OBS, ACT, copy_info_dict=True, reward_fn=reward, path=tmp_path / "j")


def test_resume_keeps_episodes_and_ends_unfinished_ones(tmp_path):
    path = tmp_path / "run"
    s = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=8, path=path, storage_size=500, metadata={"env_id": ENV_ID},
                         commit_interval=0)
    collect(s, 13)
    with EpisodeStore.open(path) as reader:  # committed as each episode ended
        assert reader.num_episodes == 4  # envs of 5 and 6 steps: 2 + 2 episodes ended, 3 and 1 steps unfinished
    assert s.writer.pending_steps.tolist() == [3, 1]
    s.close()
    s.close()
    with HerReplayStorage(OBS, ACT, num_envs=2, batch_size=8, path=path, storage_size=500) as again:
        table = again.store.episodes
        assert sorted(table["length"].tolist()) == [1, 3, 5, 5, 6, 6]
        assert table["truncated"].all()  # the unfinished ones were closed as truncated
        assert again.sample().rewards.shape == (8, 1)  # reward_fn from the stored env_id
        assert "run" in repr(again)
    again.close()
    with pytest.raises(StoreError, match="is closed"):
        again.sample()
    with pytest.raises(StoreError, match="is closed"):
        collect(again, 1)
    lost = HerReplayStorage(OBS, ACT, num_envs=2, path=path, storage_size=500)
    collect(lost, 2)
    del lost  # garbage collection ends the unfinished episodes as close() does
    gc.collect()
    with EpisodeStore.open(path) as store:
        assert store.episodes["length"].tolist()[-2:] == [2, 2]


def test_temporary_store_removed_at_close_and_by_gc():
    s = HerReplayStorage(OBS, ACT, batch_size=4, reward_fn=ENV.compute_reward)
    where = os.path.dirname(s.path)
    collect(s, 6)
    assert "temporary" in repr(s) and os.path.isdir(where)
    s.close()
    assert not os.path.exists(where)
    s = HerReplayStorage(OBS, ACT, batch_size=4, reward_fn=ENV.compute_reward)
    where = os.path.dirname(s.path)
    del s
    gc.collect()
    assert not os.path.exists(where)


def test_no_reward_fn_and_no_env_id_says_how_to_pass_one(tmp_path, monkeypatch):
    with pytest.raises(StoreError, match=r"reward_fn=env.unwrapped.compute_reward"):
        HerReplayStorage(OBS, ACT, path=tmp_path / "n")
    assert not EpisodeStore.open(tmp_path / "n").num_episodes  # the store was created, then released
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    with pytest.raises(StoreError, match="reward_fn"):
        HerReplayStorage(OBS, ACT)
    with pytest.raises(SchemaMismatchError, match="Dict"):
        HerReplayStorage(spaces.Box(-1, 1, (3,)), ACT, reward_fn=ENV.compute_reward)
    assert os.listdir(tmp_path / "tmp") == []  # no temporary directory left behind


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"observation_space": spaces.Box(-1, 1, (4,))}, SchemaMismatchError, "must be a gymnasium Dict"),
        ({"observation_space": spaces.Dict({"observation": spaces.Box(-1, 1, (4,))})}, SchemaMismatchError,
         "missing"),
        ({"goal_selection_strategy": "nearest"}, ValueError, "'nearest' is not one of"),
        ({"num_envs": 0}, ValueError, "num_envs must be an int >= 1"),
        ({"storage_size": 0}, ValueError, "storage_size must be an int >= 1"),
        ({"batch_size": 2.5}, ValueError, "batch_size must be an int >= 1"),
        ({"num_goals": -1}, ValueError, "num_goals must be an int >= 0"),
        ({"reward_fn": "sparse"}, TypeError, "reward_fn must be a callable"),
        ({"segment_steps": 0}, ValueError, "segment_steps must be an int >= 1"),
        ({"storage_size": 10, "segment_steps": 11}, ValueError, "segment_steps=11 exceeds storage_size=10"),
        ({"device": "cuda:7"}, ValueError, "device 'cuda:7' is not available here"),  # no such GPU in CI
        ({"device": "warp"}, ValueError, "device 'warp' is not available here"),
    ],
)
def test_bad_construction_creates_nothing(tmp_path, kwargs, error, match):
    args = {"observation_space": OBS, "action_space": ACT, "reward_fn": ENV.compute_reward, "path": tmp_path / "x"}
    with pytest.raises(error, match=match):
        HerReplayStorage(**{**args, **kwargs})
    assert not (tmp_path / "x").exists() or not os.listdir(tmp_path / "x")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"storage_size": True}, ArgumentTypeError, "storage_size must be an int >= 1 or None, not a bool: got True"),
        ({"storage_size": 1e6}, ArgumentTypeError, "storage_size must be an int >= 1 or None, not a float"),
        ({"storage_size": 2**52}, ValueError, "storage_size must be an int <= 4503599627370495: got 4503599627370496"),
        ({"num_envs": 2.0}, ArgumentTypeError, "num_envs must be an int >= 1, not a float: got 2.0"),
        ({"batch_size": "64"}, ArgumentTypeError, "batch_size must be an int >= 1, not a str: got '64'"),
        ({"num_goals": True}, ArgumentTypeError, "num_goals must be an int >= 0, not a bool: got True"),
        ({"segment_steps": 2.5}, ArgumentTypeError, "segment_steps must be an int >= 1, not a float: got 2.5"),
        ({"copy_info_dict": 1}, ArgumentTypeError, "copy_info_dict must be True or False, not an int: got 1"),
        ({"copy_info_dict": "no"}, ArgumentTypeError, "copy_info_dict must be True or False, not a str"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0 or None: got -1"),
        ({"seed": 1.5}, ArgumentTypeError, "seed must be an int >= 0 or None, not a float: got 1.5"),
        ({"commit_interval": -1.0}, ValueError, r"commit_interval must be a finite real number >= 0 or None: got -1.0"),
        ({"commit_interval": float("inf")}, ValueError, "commit_interval must be a finite real number >= 0 or None"),
        ({"commit_interval": "1"}, ArgumentTypeError, "commit_interval must be a finite real number >= 0 or None, not"),
    ],
)
def test_options_are_checked_by_name_before_anything_is_created(tmp_path, kwargs, error, match):
    args = {"observation_space": OBS, "action_space": ACT, "reward_fn": ENV.compute_reward, "path": tmp_path / "x"}
    with pytest.raises(error, match=match):
        HerReplayStorage(**{**args, **kwargs})
    assert not (tmp_path / "x").exists()


def test_numpy_ints_bools_and_floats_are_accepted(tmp_path):
    storage = HerReplayStorage(
        OBS, ACT, storage_size=np.int64(500), num_envs=np.int32(2), batch_size=np.uint16(8), num_goals=np.int64(4),
        reward_fn=ENV.compute_reward, copy_info_dict=np.bool_(False), path=tmp_path / "s", seed=np.int64(3),
        commit_interval=np.float32(0.5), segment_steps=np.int64(100),
    )
    assert (storage.num_envs, storage.batch_size, storage.segment_steps) == (2, 8, 100)
    assert type(storage.batch_size) is int and storage.copy_info_dict is False
    assert storage.store.capacity == 500 and storage.store.commit_interval == 0.5
    collect(storage, 12)
    assert storage.sample().rewards.shape == (8, 1)
    storage.close()


def test_a_store_handed_over_open_is_written_checked_and_closed(tmp_path):
    """An open store (here a writer's shard of a dataset of many) is used as it is: checked as open_store checks a
    store it resumes, closed when refused and at close."""
    shard = open_store(tmp_path / "dataset", OBS, ACT, shard="actor-1", capacity=500)
    storage = HerReplayStorage(OBS, ACT, storage_size=500, num_envs=2, batch_size=8, reward_fn=ENV.compute_reward,
                               path=shard)
    assert storage.store is shard
    collect(storage, 12)
    storage.close()
    assert "closed" in repr(shard)
    again = open_store(tmp_path / "dataset", OBS, ACT, shard="actor-1")  # its writer lock was released
    with pytest.raises(SchemaMismatchError, match="capacity"):
        HerReplayStorage(OBS, ACT, reward_fn=ENV.compute_reward, path=again)  # storage_size 1,000,000
    assert "closed" in repr(again)
    other_obs, _ = fetch_spaces()
    again = open_store(tmp_path / "dataset", OBS, ACT, shard="actor-1")
    with pytest.raises(SchemaMismatchError, match="observation_space differs"):
        HerReplayStorage(other_obs, ACT, storage_size=500, reward_fn=ENV.compute_reward, path=again)
    assert "closed" in repr(again)
    with open_dataset(tmp_path / "dataset") as view:
        assert view.num_episodes == 5  # the unfinished ones were ended at close


def test_store_at_path_with_other_spaces_or_capacity_is_refused_intact(tmp_path, storage):
    collect(storage, 12)
    storage.close()
    path = tmp_path / "s"
    other_obs, other_act = fetch_spaces()
    with pytest.raises(SchemaMismatchError, match="observation_space differs"):
        HerReplayStorage(other_obs, ACT, path=path, storage_size=500)
    with pytest.raises(SchemaMismatchError, match="action_space differs"):
        HerReplayStorage(OBS, other_act, path=path, storage_size=500)
    with pytest.raises(SchemaMismatchError, match="capacity"):
        HerReplayStorage(OBS, ACT, path=path)
    with EpisodeStore.open(path) as store:
        assert store.num_episodes == 5 and len(store) == 24  # the unfinished one was ended at close


def test_bad_steps_are_refused_and_change_nothing(storage):
    collect(storage, 3)
    obs = {k: torch.zeros(2, *s.shape) for k, s in OBS.spaces.items()}
    ok = (obs, torch.zeros(2, 2), torch.zeros(2), torch.zeros(2), torch.zeros(2), [{}, {}], obs)
    cases = [
        ((obs, torch.zeros(3, 2), *ok[2:]), EpisodeValidationError, r"action has shape \(3, 2\)"),
        ((obs, *ok[1:3], torch.tensor([0.5, 0.0]), *ok[4:]), ValueError, "terminateds must hold booleans or 0/1"),
        ((obs, *ok[1:4], np.array(["a", "b"]), *ok[5:]), ValueError,
         "truncateds must hold"),
        (({"observation": obs["observation"]}, *ok[1:]), EpisodeValidationError, "no key 'achieved_goal'"),
        (({**obs, "observation": torch.zeros(2, 5)}, *ok[1:]), EpisodeValidationError, "observation"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            storage.add(*args)
        assert storage.writer.pending_steps.tolist() == [3, 3]
    ended = len(storage.writer.episode_ids)
    storage.add(*ok)  # numpy infos list, float flags: accepted; zeros are no env's last next obs: a reset in between
    assert storage.writer.pending_steps.tolist() == [1, 1]
    assert len(storage.writer.episode_ids) == ended + 2  # each env's 3 steps, ended there as truncated


def test_sample_before_any_episode_raises_what_rllte_raises(storage):
    collect(storage, 2)
    for error in (RuntimeError, StoreError, NoEpisodeError):  # rllte's RuntimeError, and a her_store error
        with pytest.raises(error, match="Unable to sample before the end of the first episode"):
            storage.sample()
    collect(storage, 5)  # env 0 truncated at its 5th step: an episode ends
    assert storage.sample().rewards.shape == (64, 1)


def test_gymnasium_vector_infos_and_numpy_inputs(tmp_path):
    s = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=16, reward_fn=ENV.compute_reward, path=tmp_path / "v",
                         info_keys=["is_success"])
    obs = {k: np.zeros((2, *sp.shape), np.float32) for k, sp in OBS.spaces.items()}
    for t in range(3):
        infos = {"is_success": torch.tensor([1.0, 0.0]), "_is_success": np.array([True, True])}
        s.add(obs, np.zeros((2, 2)), np.zeros(2), np.zeros(2, bool), np.array([t == 2] * 2), infos, obs)
    assert s.store.episode(0)["is_success"].tolist() == [1.0] * 3
    assert isinstance(s.writer, StepWriter)
    s.close()



def test_long_episodes_are_cut_into_segments(tmp_path):
    s = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=8, reward_fn=ENV.compute_reward, path=tmp_path / "g",
                         segment_steps=4)
    collect(s, 10, episode_steps=50)  # no episode ends: each env's is cut every 4 steps, as truncated
    assert s.writer.pending_steps.tolist() == [2, 2]
    table = s.store.episodes
    assert table["length"].tolist() == [4] * 4 and table["truncated"].all() and not table["terminated"].any()
    for env in (0, 1):  # seamless: an env's next segment starts where its last one ended
        a, b = (s.store.episode(int(i)) for i in table["episode_id"][table["env_index"] == env])
        np.testing.assert_array_equal(a["observation"][-1], b["observation"][0])
    s.close()


def test_an_episode_longer_than_the_store_is_cut_not_dropped(tmp_path):
    s = HerReplayStorage(OBS, ACT, batch_size=8, storage_size=6, reward_fn=ENV.compute_reward, path=tmp_path / "c")
    assert s.segment_steps == 6
    collect(s, 10, episode_steps=10)  # ends after 10 steps: stored as a 6-step segment (evicted) and a 4-step one
    assert s.store.episodes["length"].tolist() == [4] and s.writer.pending_steps.tolist() == [0]
    unbounded = HerReplayStorage(OBS, ACT, storage_size=None, reward_fn=ENV.compute_reward, path=tmp_path / "u")
    assert unbounded.segment_steps is None
    collect(unbounded, 30, episode_steps=40)
    assert unbounded.writer.pending_steps.tolist() == [30]
    s.close()
    unbounded.close()


def test_sample_draws_from_every_ended_episode_between_group_commits(tmp_path):
    s = HerReplayStorage(OBS, ACT, batch_size=32, reward_fn=ENV.compute_reward, path=tmp_path / "e",
                         commit_interval=3600, seed=0)
    collect(s, 5)  # one episode ends
    s.sample()
    collect(s, 5, seed=1)  # another ends, long before the group commit is due
    with EpisodeStore.open(tmp_path / "e") as reader:
        assert len(reader) == 5
    s.sample()  # commits it first, as rllte samples every ended episode
    assert s.store.snapshot().num_transitions == 10
    with EpisodeStore.open(tmp_path / "e") as reader:
        assert len(reader) == 10
    s.close()


def test_temporary_stores_of_killed_processes_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = HerReplayStorage(OBS, ACT, reward_fn=ENV.compute_reward)  # its process holds the writer lock
    dirs = {"abandoned": tmp_path / "her_store-dead", "fresh": tmp_path / "her_store-new",
            "other content": tmp_path / "her_store-more", "not ours": tmp_path / "mine", "live": tmp_path / "x"}
    for d in dirs.values():
        if d.name != "x":
            EpisodeStore.create(d / "store", OBS, ACT).close()  # no process holds its lock, as after a kill -9
    (dirs["other content"] / "notes.txt").write_text("kept")
    dirs["live"] = tmp_path / os.path.basename(os.path.dirname(live.path))
    long_ago = time.time() - 3600
    for name, d in dirs.items():
        if name != "fresh":
            os.utime(d, (long_ago, long_ago))
    with HerReplayStorage(OBS, ACT, reward_fn=ENV.compute_reward) as again:
        assert not dirs["abandoned"].exists()
        assert all(d.exists() for name, d in dirs.items() if name != "abandoned")
        assert os.path.exists(again.path)
    live.close()
    assert not dirs["live"].exists()


def test_a_step_that_does_not_start_where_the_last_one_ended_ends_the_episode_there(tmp_path):
    """rllte's add takes obs and next obs apart: a step whose obs is not its env's last next obs (a reset without an
    end flag) overwrote the last transition's next observation with it (the store keeps a step's next observation
    as the following row): (1 -> 2) was stored and sampled as (1 -> 50). Each transition is now kept as added: the
    episode ends there, truncated, and the step starts the next one."""
    obs_space = spaces.Dict(
        {k: spaces.Box(-1e3, 1e3, (1,), np.float32) for k in ("observation", "achieved_goal", "desired_goal")}
    )
    act = spaces.Box(-1, 1, (1,), np.float32)
    with HerReplayStorage(obs_space, act, num_envs=1, batch_size=4, storage_size=100, path=tmp_path / "s",
                          reward_fn=lambda a, d, i: np.zeros(len(a)), seed=0) as storage:
        added = [(0, 1), (1, 2), (50, 51), (51, 52)]
        for i, (o, n) in enumerate(added):
            ob = {k: torch.tensor([[float(o)]]) for k in obs_space.spaces}
            nx = {k: torch.tensor([[float(n)]]) for k in obs_space.spaces}
            storage.add(ob, torch.tensor([[0.1 * i]]), torch.zeros(1), torch.zeros(1), torch.zeros(1), [{}], nx)
        store = storage.store
        storage.writer.flush_partial()
        store.flush()
        stored = []
        for e in range(store.first_episode, store.end_episode):
            ep = store.episode(e)
            stored += [
                (float(ep["observation"][t, 0]), float(ep["observation"][t + 1, 0])) for t in range(len(ep["action"]))
            ]
            assert ep["truncated"][-1]
        assert stored == [(float(o), float(n)) for o, n in added]
        assert store.num_episodes == 2


def test_td_prioritized_batches_carry_weights_and_indices_and_updates_reach_the_tree(tmp_path):
    storage = HerReplayStorage(OBS, ACT, num_envs=2, batch_size=64, storage_size=500, path=tmp_path / "s", seed=0,
                               metadata={"env_id": ENV_ID}, prioritize="td", alpha=1.0, beta=1.0)
    collect(storage, 40)
    b = storage.sample()
    assert b.weights.shape == (64,) and b.indices.dtype == torch.int64 and torch.all(b.weights == 1)
    tree = storage.sampler.priorities.tree
    storage.update({"indices": b.indices, "priorities": torch.full((64,), 4.0)})  # rllte's metrics
    values = tree.leaves[tree.leaves > 0]
    assert np.count_nonzero(np.isclose(values, 4.0)) == len(set(b.indices.tolist()))  # alpha=1: (4 + eps) ** 1
    assert set(np.round(values, 4).tolist()) == {1.0, 4.0}
    assert storage.update_priorities(b.indices, torch.zeros(64)) == 64
    storage.update({"loss": 1.0})  # other metrics: nothing
    plain = HerReplayStorage(OBS, ACT, batch_size=8, storage_size=100, path=tmp_path / "u",
                             metadata={"env_id": ENV_ID})
    collect(plain, 12)
    assert not hasattr(plain.sample(), "weights")
    with pytest.raises(ValueError, match="update_priorities is for prioritize='td'"):
        plain.update_priorities(torch.zeros(8, dtype=torch.int64), torch.zeros(8))
    storage.close()
    plain.close()
