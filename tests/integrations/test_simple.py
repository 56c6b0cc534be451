"""The simple HER API over the disk store: episodes by done, future goals of the same episode, recomputed rewards."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from her_store import EpisodeStore
from her_store.checks import ArgumentTypeError
from her_store.envs import PointGoalEnv
from her_store.errors import SchemaMismatchError, StoreError
from her_store.integrations.rllte import HerReplayStorage
from her_store.integrations.simple import HindsightExperienceReplay, goal_reached_reward

FAR = np.array([-1000.0, -1000.0])  # the goal every stored transition has: a relabelled goal is never it
STORED_REWARD = 5.0  # what every stored transition's reward is: a recomputed one is 0 or -1


def state(ep: int, t: int) -> np.ndarray:
    """A state whose achieved goal (first 2 entries) names its episode and step."""
    return np.array([ep * 100 + t, ep, 0.5, t], np.float32)


def fill(her: HindsightExperienceReplay, lengths: list[int], first_ep: int = 0, unfinished: int = 0) -> None:
    """Episodes of the given lengths, then ``unfinished`` steps of one more."""
    for i, L in enumerate([*lengths, unfinished]):
        ep = first_ep + i
        for t in range(L):
            done = t == L - 1 and i < len(lengths)
            her.store_transition(state(ep, t), [t, -t], STORED_REWARD, state(ep, t + 1), done, FAR)


def check_batch(batch, B: int, tolerance: float = 0.05) -> np.ndarray:
    """Check a batch's shapes and HER semantics; returns which rows were relabelled."""
    states, actions, rewards, next_states, dones, goals = (x.numpy() for x in batch)
    assert [x.shape for x in (states, actions, rewards, next_states, dones, goals)] == [
        (B, 4), (B, 2), (B, 1), (B, 4), (B, 1), (B, 2)]
    assert all(x.dtype == torch.float32 for x in batch)
    np.testing.assert_array_equal(next_states[:, 3], states[:, 3] + 1)  # t + 1 of the same episode
    np.testing.assert_array_equal(actions[:, 0], states[:, 3])
    relabelled = (goals != FAR).any(axis=1)
    # a relabelled goal is the achieved goal of a state reached later in the same episode: step j + 1 >= t + 1
    g_ep, g_step = goals[relabelled, 1], goals[relabelled, 0] - 100 * goals[relabelled, 1]
    np.testing.assert_array_equal(g_ep, states[relabelled, 1])
    assert (g_step >= states[relabelled, 3] + 1).all()
    np.testing.assert_array_equal(goals[relabelled], np.stack([100 * g_ep + g_step, g_ep], 1))
    want = goal_reached_reward(next_states[relabelled, :2], goals[relabelled], tolerance=tolerance)
    np.testing.assert_array_equal(rewards[relabelled, 0], want)
    assert (rewards[~relabelled] == STORED_REWARD).all()
    return relabelled


def test_none_until_batch_size_then_relabelled_future_goals(tmp_path):
    her = HindsightExperienceReplay(4, 2, 1000, 64, path=tmp_path / "s", seed=0)
    assert len(her) == 0 and her.sample() is None and her.goal_dim is None
    fill(her, [], unfinished=40)  # no episode ended yet: the unfinished one counts and is sampled
    assert len(her) == 40 and her.sample() is None and her.goal_dim == 2
    fill(her, [30], first_ep=1, unfinished=0)  # its first state is no next_state of episode 0: a new episode
    assert len(her) == 70
    table = her.storage.store.episodes
    assert table["length"].tolist() == [40, 30] and table["truncated"].tolist() == [True, False]
    relabelled = check_batch(her.sample(), 64)
    assert int(0.8 * 64) - 1 <= relabelled.sum() <= int(0.8 * 64)
    her.close()


def test_batches_mix_ended_and_unfinished_episodes(tmp_path):
    her = HindsightExperienceReplay(4, 2, 1000, 64, path=tmp_path / "s", seed=1)
    fill(her, [20, 20, 20, 20], unfinished=20)  # the unfinished episode is id 4
    assert len(her) == 100
    episodes = np.concatenate([her.sample()[0][:, 1].numpy() for _ in range(16)])
    counts = np.bincount(episodes.astype(int), minlength=5)
    assert (counts > 120).all() and counts.sum() == 1024  # each ~205 of 1024
    for _ in range(5):
        check_batch(her.sample(), 64)
    states, _, _, next_states, dones, _ = (x.numpy() for x in her.sample())
    np.testing.assert_array_equal(dones[:, 0], (next_states[:, 3] == 20) & (states[:, 1] < 4))
    assert dones.any()
    her.close()


def test_goal_sampling_strategy_applied_on_top_and_rewards_follow(tmp_path):
    seen = []

    def shift(goals: torch.Tensor) -> torch.Tensor:
        seen.append(goals.clone())
        return goals + torch.tensor([0.0, 0.01])  # within the default tolerance of 0.05

    her = HindsightExperienceReplay(4, 2, 1000, 32, shift, path=tmp_path / "s", seed=2)
    fill(her, [10, 10, 10, 10])
    _, _, rewards, next_states, _, goals = her.sample()
    np.testing.assert_allclose(goals.numpy(), seen[0].numpy() + [0, 0.01], rtol=1e-6)
    want = goal_reached_reward(next_states[:, :2].numpy(), goals.numpy())
    np.testing.assert_array_equal(rewards[:, 0].numpy(), want)  # every goal changed, every reward recomputed
    assert (rewards == 0).sum() > 0  # relabelled goals reached (j = t) stay rewarded
    her.goal_sampling_strategy = lambda g: g
    relabelled = check_batch(her.sample(), 32)
    assert relabelled.any()
    her.goal_sampling_strategy = lambda g: g[:3]
    with pytest.raises(ValueError, match=r"goal_sampling_strategy returned shape \(3, 2\), expected \(32, 2\)"):
        her.sample()
    her.close()


def test_custom_reward_fn_and_wrong_count(tmp_path):
    def reward(ag, dg, info):
        assert len(info) == len(ag)
        return np.full((len(ag), 1), 3.0)

    her = HindsightExperienceReplay(4, 2, 1000, 40, path=tmp_path / "s", reward_fn=reward, goal_dim=2, seed=3)
    fill(her, [20], unfinished=20)
    r = her.sample()[2].numpy()[:, 0]
    assert set(r.tolist()) == {3.0, STORED_REWARD}
    her.reward_fn = lambda ag, dg, info: np.zeros(2)
    her.storage.sampler.reward_fn = her.reward_fn
    for _ in range(3):  # the ended episode's rows (through the sampler) and the unfinished one's
        with pytest.raises(ValueError, match="reward_fn returned 2 values"):
            her.sample()
    her.goal_sampling_strategy = lambda g: g + 1
    her.storage.sampler.reward_fn = reward
    her.reward_fn = lambda ag, dg, info: np.zeros(len(ag) + 1)
    fill(her, [], first_ep=5, unfinished=0)
    with pytest.raises(ValueError, match="reward_fn returned"):
        her.sample()
    assert len(her) == 40  # nothing lost
    her.close()


def test_resume_keeps_episodes(tmp_path):
    path = tmp_path / "run"
    with HindsightExperienceReplay(4, 2, 1000, 16, path=path) as her:
        fill(her, [10, 10], unfinished=5)
    again = HindsightExperienceReplay(4, 2, 1000, 16, path=path, seed=4)
    assert again.goal_dim == 2 and len(again) == 25  # the unfinished episode was stored, ended, at close
    with EpisodeStore.open(path) as store:
        assert store.episodes["length"].tolist() == [10, 10, 5]
        assert store.episodes["truncated"].tolist() == [False, False, True]
    fill(again, [6], first_ep=3)
    assert len(again) == 31
    check_batch(again.sample(), 16)
    again.close()
    with pytest.raises(SchemaMismatchError, match="goals of size 2, got goal_dim=3"):
        HindsightExperienceReplay(4, 2, 1000, 16, path=path, goal_dim=3)
    with pytest.raises(SchemaMismatchError, match="observation_space differs"):
        HindsightExperienceReplay(5, 2, 1000, 16, path=path)
    with pytest.raises(SchemaMismatchError, match="action_space differs"):
        HindsightExperienceReplay(4, 3, 1000, 16, path=path)
    with pytest.raises(SchemaMismatchError, match=r"keeps 750 .*buffer_size=900 with segment_steps=225 keeps 675"):
        HindsightExperienceReplay(4, 2, 900, 16, path=path)
    with pytest.raises(SchemaMismatchError, match="segment_steps=10 keeps 990"):
        HindsightExperienceReplay(4, 2, 1000, 16, path=path, segment_steps=10)
    with EpisodeStore.open(path) as store:
        assert len(store) == 31


def test_store_made_by_someone_else(tmp_path):
    env = PointGoalEnv()
    storage = HerReplayStorage(env.observation_space, env.action_space, reward_fn=env.compute_reward,
                               path=tmp_path / "p")
    storage.close()
    with pytest.raises(SchemaMismatchError, match="observation_space differs"):
        HindsightExperienceReplay(4, 2, 1_001_000, 16, path=tmp_path / "p")  # its capacity; other spaces
    HerReplayStorage(env.observation_space, env.action_space, reward_fn=env.compute_reward, storage_size=None,
                     path=tmp_path / "u").close()
    with pytest.raises(SchemaMismatchError, match="keeps an unbounded number of transitions"):
        HindsightExperienceReplay(4, 2, 1000, 16, path=tmp_path / "u")
    with pytest.raises(SchemaMismatchError, match="goals of shape"):
        bad = {k: s for k, s in env.observation_space.spaces.items()}
        from gymnasium import spaces

        bad["desired_goal"] = bad["achieved_goal"] = spaces.Box(-1, 1, (2, 2))
        HerReplayStorage(spaces.Dict(bad), env.action_space, reward_fn=env.compute_reward, path=tmp_path / "q").close()
        HindsightExperienceReplay(4, 2, 1_000_000, 16, path=tmp_path / "q")


def test_bad_transitions_are_refused_and_change_nothing(tmp_path):
    her = HindsightExperienceReplay(4, 2, 1000, 8, path=tmp_path / "s")
    fill(her, [3], unfinished=2)
    s, a = state(9, 0), np.zeros(2)
    cases = [
        ((np.zeros(5), a, 0.0, s, False, FAR), ValueError, r"state has shape \(5,\), expected \(4,\) \(state_dim\)"),
        ((s, a, 0.0, np.zeros((2, 4)), False, FAR), ValueError, "next_state has shape"),
        ((s, np.zeros(3), 0.0, s, False, FAR), ValueError, r"action has shape \(3,\), expected \(2,\)"),
        ((s, a, 0.0, s, False, np.zeros(3)), ValueError, r"goal has shape \(3,\), expected \(2,\) \(goal_dim\)"),
        ((s, a, [0.0, 1.0], s, False, FAR), ValueError, "reward must be a single value"),
        ((s, a, 0.0, s, [True, False], FAR), ValueError, "done must be a single value"),
        ((s, a, 0.0, s, 0.5, FAR), ValueError, "done must hold booleans or 0/1"),
        ((np.array(["a"] * 4), a, 0.0, s, False, FAR), TypeError, "state has dtype <U1, expected numbers"),
        ((s, a, np.float64(1e300), s, False, FAR), ValueError, "reward"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            her.store_transition(*args)
        assert len(her) == 5
    her.store_transition(torch.as_tensor(s), torch.zeros(1, 2), torch.tensor(1.0), s, torch.tensor(1.0), FAR)
    assert len(her) == 6 and her.storage.writer.pending_steps.tolist() == [0]
    her.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dim": 0}, ValueError, "state_dim must be an int >= 1"),
        ({"batch_size": 1.5}, ValueError, "batch_size must be an int >= 1"),
        ({"goal_dim": 5}, ValueError, "goal_dim=5 exceeds state_dim=4"),
        ({"goal_dim": 0}, ValueError, "goal_dim must be an int >= 1"),
        ({"goal_sampling_strategy": "future"}, TypeError, "goal_sampling_strategy must be a callable"),
        ({"reward_fn": 1}, TypeError, "reward_fn must be a callable"),
        ({"buffer_size": 1}, ValueError, "buffer_size must be an int >= 2"),
        ({"segment_steps": 0}, ValueError, "segment_steps must be an int >= 1"),
        ({"segment_steps": 100}, ValueError, "segment_steps=100 must be less than buffer_size=100"),
        ({"n_sampled_goal": -1}, ValueError, "n_sampled_goal must be an int >= 0"),
        ({"tolerance": float("nan")}, ValueError, "tolerance must be a real number >= 0"),
        ({"device": "cuda:7"}, ValueError, "device 'cuda:7' is not available here"),  # no such GPU in CI
        ({"goal_dim": None, "device": "warp"}, ValueError, "device 'warp' is not available here"),
    ],
)
def test_bad_construction(tmp_path, kwargs, error, match):
    args = {"state_dim": 4, "action_dim": 2, "buffer_size": 100, "batch_size": 8, "goal_dim": 2,
            "path": tmp_path / "x"}
    with pytest.raises(error, match=match):
        HindsightExperienceReplay(**{**args, **kwargs})
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dim": True}, ArgumentTypeError, "state_dim must be an int >= 1, not a bool: got True"),
        ({"action_dim": 2.0}, ArgumentTypeError, "action_dim must be an int >= 1, not a float: got 2.0"),
        ({"buffer_size": "100"}, ArgumentTypeError, "buffer_size must be an int >= 2, not a str: got '100'"),
        ({"buffer_size": 2**52 + 1}, ValueError, "buffer_size must be an int <= 4503599627370495: got"),
        ({"batch_size": -8}, ValueError, "batch_size must be an int >= 1: got -8"),
        ({"goal_dim": 2.0}, ArgumentTypeError, "goal_dim must be an int >= 1 or None, not a float: got 2.0"),
        ({"n_sampled_goal": True}, ArgumentTypeError, "n_sampled_goal must be an int >= 0, not a bool: got True"),
        ({"segment_steps": 10.0}, ArgumentTypeError, "segment_steps must be an int >= 1, not a float: got 10.0"),
        ({"tolerance": True}, ArgumentTypeError, "tolerance must be a real number >= 0, not a bool: got True"),
        ({"tolerance": "0.1"}, ArgumentTypeError, "tolerance must be a real number >= 0, not a str: got '0.1'"),
        ({"tolerance": -0.5}, ValueError, "tolerance must be a real number >= 0: got -0.5"),
        ({"seed": -1}, ValueError, "seed must be an int >= 0 or None: got -1"),
        ({"seed": 0.5}, ArgumentTypeError, "seed must be an int >= 0 or None, not a float: got 0.5"),
    ],
)
def test_options_are_checked_by_name_before_anything_is_created(tmp_path, kwargs, error, match):
    args = {"state_dim": 4, "action_dim": 2, "buffer_size": 100, "batch_size": 8, "goal_dim": 2,
            "path": tmp_path / "x"}
    with pytest.raises(error, match=match):
        HindsightExperienceReplay(**{**args, **kwargs})
    assert not (tmp_path / "x").exists()


def test_numpy_ints_and_floats_are_accepted(tmp_path):
    her = HindsightExperienceReplay(
        np.int64(4), np.int32(2), np.int64(1000), np.uint8(16), path=tmp_path / "s", goal_dim=np.int64(2),
        n_sampled_goal=np.int64(4), tolerance=np.float32(0.1), seed=np.int64(0), segment_steps=np.int64(50),
    )
    assert (her.state_dim, her.buffer_size, her.batch_size, her.segment_steps, her.goal_dim) == (4, 1000, 16, 50, 2)
    assert type(her.batch_size) is int and her.her_ratio == pytest.approx(0.8)
    fill(her, [10, 10])
    check_batch(her.sample(), 16, tolerance=0.1)
    her.close()


def test_goal_larger_than_state_at_first_transition():
    her = HindsightExperienceReplay(4, 2, 100, 8)
    with pytest.raises(ValueError, match="goal_dim=6 exceeds state_dim=4"):
        her.store_transition(np.zeros(4), np.zeros(2), 0.0, np.zeros(4), False, np.zeros(6))
    assert len(her) == 0
    her.store_transition(np.zeros(4), np.zeros(2), 0.0, np.zeros(4), False, np.zeros(3))
    assert her.goal_dim == 3 and len(her) == 1
    her.close()
    with HindsightExperienceReplay(2, 1, 100, 1) as scalars:  # size-1 vectors may be scalars
        scalars.store_transition([0.0, 1.0], 0.5, 0.0, [1.0, 1.0], True, 1.0)
        _, actions, _, _, dones, goals = scalars.sample()
        assert actions.tolist() == [[0.5]] and goals.shape == (1, 1) and dones.tolist() == [[1.0]]


def test_nan_states_do_not_split_episodes():
    with HindsightExperienceReplay(2, 1, 100, 4, goal_dim=1) as her:
        for t in range(3):
            her.store_transition([t, np.nan], 0.0, -1.0, [t + 1, np.nan], False, 9.0)
        assert her.storage.writer.pending_steps.tolist() == [3]
        her.store_transition([0, np.nan], 0.0, -1.0, [1, np.nan], False, 9.0)  # a jump back: a new episode
        assert her.storage.writer.pending_steps.tolist() == [1] and len(her) == 4


def test_same_seed_same_batches(tmp_path):
    out = []
    for name in ("a", "b"):
        her = HindsightExperienceReplay(4, 2, 1000, 32, path=tmp_path / name, seed=7)
        fill(her, [15, 15], unfinished=4)
        out.append([x.numpy() for x in her.sample()])
        her.close()
    for x, y in zip(*out, strict=True):
        np.testing.assert_array_equal(x, y)



def bit_flipping_success(n_sampled_goal: int, n: int = 4) -> float:
    """Tabular Q-learning from batches of random-policy bit flipping (n bits); the greedy policy's success rate
    over every (start, goal) pair. A transition whose reward is 0 (goal reached) is treated as terminal."""
    rng = np.random.default_rng(0)
    her = HindsightExperienceReplay(n, 1, 10_000, 256, seed=0, n_sampled_goal=n_sampled_goal)
    for _ in range(150):
        s, g = rng.integers(0, 2, n), rng.integers(0, 2, n)
        for t in range(n + 2):
            a = rng.integers(0, n)
            nxt = s.copy()
            nxt[a] ^= 1
            reached = bool((nxt == g).all())
            her.store_transition(s, [a], -1.0 + reached, nxt, reached or t == n + 1, g)
            s = nxt
            if reached:
                break
    code = 2 ** np.arange(n)
    q = np.full((2**n, 2**n, n), -10.0)
    for _ in range(60):
        states, actions, rewards, next_states, _, goals = (x.numpy() for x in her.sample())
        si, ni, gi = (states @ code).astype(int), (next_states @ code).astype(int), (goals @ code).astype(int)
        a = actions[:, 0].astype(int)
        q[si, gi, a] += 0.5 * (rewards[:, 0] + 0.9 * (rewards[:, 0] < 0) * q[ni, gi].max(axis=1) - q[si, gi, a])
    her.close()
    wins = 0
    for start in range(2**n):
        for g in range(2**n):
            s = start
            for _ in range(n):
                if s == g:
                    break
                s ^= 1 << int(q[s, g].argmax())
            wins += s == g
    return wins / 4**n


def test_her_batches_teach_bit_flipping():
    """A small learning check: with relabelling the learned policy reaches (nearly) every goal; without, it does
    not (random goals are rarely reached by a random policy)."""
    assert bit_flipping_success(4) > 0.95
    assert bit_flipping_success(0) < 0.9


def continuing(her: HindsightExperienceReplay, steps: int, start: float = 0.0) -> float:
    """``steps`` transitions of one trajectory without done (a continuing task); returns the state reached."""
    x = start
    for _ in range(steps):
        her.store_transition([x, 0.0], [x], -1.0, [x + 1, 0.0], False, [1e6])
        x += 1
    return x


def test_an_episode_without_done_is_cut_into_segments_within_buffer_size(tmp_path):
    her = HindsightExperienceReplay(2, 1, 100, 16, path=tmp_path / "s", goal_dim=1, seed=0)
    assert her.segment_steps == 25  # a quarter of buffer_size
    x = 0.0
    for _ in range(25):  # 250 steps: never more than a segment in memory, never more than buffer_size held
        x = continuing(her, 10, x)
        assert her.storage.writer.pending_steps[0] <= 25 and len(her) <= 100
    assert her.storage.writer.pending_steps[0] == 0 and len(her) == 75
    her.store_transition([x, 0.0], [x], -1.0, [x + 1, 0.0], True, [1e6])  # done after 250 steps: nothing dropped
    table = her.storage.store.episodes
    assert table["length"].tolist() == [25, 25, 1] and table["truncated"].tolist() == [True, True, False]
    first = [her.storage.store.episode(int(i)) for i in table["episode_id"]]
    for a, b in itertools.pairwise(first):  # seamless: a segment starts where the one before ended
        np.testing.assert_array_equal(a["observation"][-1], b["observation"][0])
    states, _, _, next_states, _, goals = (x.numpy() for x in her.sample())
    relabelled = goals[:, 0] != 1e6
    assert relabelled.any() and not relabelled.all()
    # a relabelled goal is reached later in the same segment: at most 25 - 1 steps after the next state
    segment = states[:, 0] // 25
    assert (goals[relabelled, 0] >= next_states[relabelled, 0]).all()
    assert (goals[relabelled, 0] <= (segment[relabelled] + 1) * 25).all()
    her.close()


@pytest.mark.slow
def test_segments_bound_memory_and_what_a_kill_loses(tmp_path):
    path = tmp_path / "k"
    child = f"""
import os, signal
from her_store.integrations.simple import HindsightExperienceReplay
her = HindsightExperienceReplay(2, 1, 400, 16, path={str(path)!r}, goal_dim=1)
for x in range(250):
    her.store_transition([x, 0.0], [x], -1.0, [x + 1, 0.0], False, [1e6])
print(len(her), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    out = subprocess.run([sys.executable, "-c", child], check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL and out.stdout.split() == ["250"], out.stderr
    with HindsightExperienceReplay(2, 1, 400, 16, path=path) as her:
        assert len(her) == 200  # two segments of 100 survive; only the unfinished 50 steps are lost
        assert her.storage.store.episodes["length"].tolist() == [100, 100]


def test_ended_episodes_are_committed_in_groups_and_every_one_is_sampled(tmp_path):
    her = HindsightExperienceReplay(2, 1, 1000, 64, path=tmp_path / "g", goal_dim=1, seed=0)
    store = her.storage.store
    generation = store.commit_record.generation
    for i in range(40):  # each state a jump, as in the seed's example: each transition its own episode
        her.store_transition([10.0 * i, 0.0], [i], -1.0, [10.0 * i + 1, 0.0], False, [1e6])
    assert store.commit_record.generation - generation < 10  # not a commit per episode (39 ended)
    assert her.sample() is None and len(her) == 40  # both see every ended episode (len commits them)
    with EpisodeStore.open(tmp_path / "g") as reader:
        assert len(reader) == 39  # the 40th is the unfinished one
    for i in range(40, 70):
        her.store_transition([10.0 * i, 0.0], [i], -1.0, [10.0 * i + 1, 0.0], False, [1e6])
    states = her.sample()[0].numpy()[:, 0]
    assert store.snapshot().num_transitions == 69  # the batch was drawn from every ended episode
    assert set(states.tolist()) <= {10.0 * i for i in range(70)}
    her.close()


def test_a_closed_replay_says_so(tmp_path):
    """After close(), store_transition failed with "env 0: episode of 3 steps dropped (... store is closed)", an
    episode the caller never ended; now each call says the replay is closed."""
    her = HindsightExperienceReplay(state_dim=4, action_dim=2, buffer_size=100, batch_size=2, path=str(tmp_path / "s"),
                                    goal_dim=2)
    for t in range(3):
        her.store_transition(np.full(4, t), np.zeros(2), -1.0, np.full(4, t + 1), False, np.ones(2))
    her.close()
    for call in (lambda: her.store_transition(np.full(4, 3), np.zeros(2), -1.0, np.full(4, 4), False, np.ones(2)),
                 her.sample, lambda: len(her)):
        with pytest.raises(StoreError, match=r"this HindsightExperienceReplay \(.*\) is closed"):
            call()
    her.close()  # idempotent


def test_td_prioritized_batches_end_with_weights_and_indices_and_take_updates(tmp_path):
    her = HindsightExperienceReplay(4, 2, 1000, 32, path=tmp_path / "s", seed=0, goal_dim=2, prioritize="td",
                                    alpha=1.0)
    fill(her, [], unfinished=40)
    assert her.sample() is None  # nothing committed yet: only committed transitions are drawn by priority
    fill(her, [30, 20], first_ep=1, unfinished=5)
    *batch, weights, indices = her.sample()
    check_batch(batch, 32)
    assert weights.shape == (32,) and torch.all(weights == 1) and indices.dtype == torch.int64
    assert her.update_priorities(indices, torch.full((32,), 9.0)) == 32
    leaves = her.storage.sampler.priorities.tree.leaves
    assert leaves.max() == pytest.approx(9.0 + 1e-6)
    her.close()
