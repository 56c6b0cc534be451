"""sb3_layout: a store's episodes materialised in SB3's HerReplayBuffer layout, checked against SB3's own buffer."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore, open_store
from her_store.checks import ArgumentTypeError
from her_store.integrations.sb3_layout import SB3Arrays, env_columns, sb3_arrays
from tests.conftest import fetch_spaces, make_episode, random_rows

pytest.importorskip("stable_baselines3", reason='pip install "her_store[sb3]"')

from stable_baselines3.her import HerReplayBuffer

FIELDS = ("actions", "rewards", "dones", "timeouts", "ep_start", "ep_length")


def _run(
    path, obs_space, act_space, n_envs, n_steps, buffer_size, seed, *, capacity=None, handle_timeout=True, p_done=0.15
):
    """Step SB3's HerReplayBuffer and a store's StepWriter with the same random steps; return both."""
    rng = np.random.default_rng(seed)
    sb3 = HerReplayBuffer(
        buffer_size * n_envs,
        obs_space,
        act_space,
        env=None,
        n_envs=n_envs,
        handle_timeout_termination=handle_timeout,
    )
    store = open_store(path, obs_space, act_space, capacity=capacity)
    writer = store.writer(n_envs)
    obs = {k: random_rows(s, n_envs, rng) for k, s in obs_space.spaces.items()}
    for _ in range(n_steps):
        nxt = {k: random_rows(s, n_envs, rng) for k, s in obs_space.spaces.items()}
        action = random_rows(act_space, n_envs, rng)
        reward = rng.standard_normal(n_envs).astype(np.float32)
        done = rng.random(n_envs) < p_done
        timeout = done & (rng.random(n_envs) < 0.5)
        infos = [{"TimeLimit.truncated": bool(t)} for t in timeout]
        sb3.add({k: v.copy() for k, v in obs.items()}, nxt, action.copy(), reward, done, infos)
        writer.add(obs, nxt, action, reward, done & ~timeout, timeout, infos)
        obs = {k: random_rows(s, n_envs, rng) for k, s in obs_space.spaces.items()}  # the next episode's reset
        for k in obs:  # an env that did not end goes on from its next observation
            obs[k][~done] = nxt[k][~done]
    return sb3, store, writer


def _assert_same(got: SB3Arrays, sb3: HerReplayBuffer, rows: np.ndarray | None = None) -> None:
    sel = slice(None) if rows is None else rows
    assert got.pos == sb3.pos and got.full == sb3.full
    np.testing.assert_array_equal(got.current_ep_start, sb3._current_ep_start)
    for name in FIELDS:
        want = getattr(sb3, name)
        assert getattr(got, name).dtype == want.dtype and getattr(got, name).shape == want.shape, name
        np.testing.assert_array_equal(getattr(got, name)[sel], want[sel], err_msg=name)
    for attr in ("observations", "next_observations"):
        for k, want in getattr(sb3, attr).items():
            assert getattr(got, attr)[k].dtype == want.dtype and getattr(got, attr)[k].shape == want.shape
            np.testing.assert_array_equal(getattr(got, attr)[k][sel], want[sel], err_msg=f"{attr}[{k!r}]")


@pytest.mark.parametrize(
    ("n_envs", "n_steps", "buffer_size"),
    [(1, 60, 200), (3, 60, 200), (1, 137, 16), (3, 137, 16), (3, 64, 16), (2, 90, 5)],
    ids=["1env", "3envs", "1env-ring", "3envs-ring", "3envs-exact-wrap", "2envs-ring-shorter-than-episodes"],
)
def test_every_array_equals_sb3s_own(tmp_path, n_envs, n_steps, buffer_size):
    obs_space, act_space = fetch_spaces(4, 2, 3)
    sb3, store, writer = _run(str(tmp_path / "s"), obs_space, act_space, n_envs, n_steps, buffer_size, seed=n_steps)
    got = sb3_arrays(store, sb3.buffer_size, n_envs, [writer.pending(e) for e in range(n_envs)])
    _assert_same(got, sb3)
    assert got.full == (n_steps >= buffer_size)
    if buffer_size == 5:  # some episodes outlived the ring: SB3's length % buffer_size rule was exercised
        assert (store.episodes["length"] > 5).any()
    else:
        assert (got.ep_length > 0).any()
    store.close()


def test_random_configurations(tmp_path):
    """Ring sizes from 1 row, step counts around the wrap, episodes from 1 step to many rings long."""
    obs_space, act_space = fetch_spaces(2, 1, 1)
    rng = np.random.default_rng(2024)
    for k in range(12):
        n_envs, bs = int(rng.integers(1, 5)), int(rng.integers(1, 24))
        n_steps = int(rng.choice([bs - 1, bs, bs + 1, rng.integers(1, 6 * bs + 2)])) or 1
        p_done = float(rng.choice([0.02, 0.3, 0.9]))
        sb3, store, writer = _run(
            str(tmp_path / str(k)), obs_space, act_space, n_envs, n_steps, bs, seed=k, p_done=p_done
        )
        _assert_same(sb3_arrays(store, bs, n_envs, [writer.pending(e) for e in range(n_envs)]), sb3)
        store.close()


def test_discrete_actions_and_no_timeout_handling(tmp_path):
    obs_space, _ = fetch_spaces(4, 2, 3)
    act_space = spaces.Discrete(5)
    sb3, store, writer = _run(str(tmp_path / "s"), obs_space, act_space, 2, 50, 20, seed=3, handle_timeout=False)
    got = sb3_arrays(store, 20, 2, [writer.pending(e) for e in range(2)], handle_timeout_termination=False)
    _assert_same(got, sb3)
    assert got.actions.dtype == np.int64 and got.actions.shape == (20, 2, 1)
    assert not got.timeouts.any() and got.dones.any()
    store.close()


def test_truncate_last_trajectory_matches_flush_partial(tmp_path):
    """What load_replay_buffer does to SB3's buffer, flush_partial does to the store."""
    obs_space, act_space = fetch_spaces(4, 2, 3)
    sb3, store, writer = _run(str(tmp_path / "s"), obs_space, act_space, 3, 41, 16, seed=5)
    assert writer.pending_steps.any()
    with pytest.warns(UserWarning, match="truncated"):
        sb3.truncate_last_trajectory()
    writer.flush_partial()
    _assert_same(sb3_arrays(store, 16, 3, [writer.pending(e) for e in range(3)]), sb3)
    store.close()


@pytest.mark.filterwarnings("ignore:The last trajectory")
def test_a_reopened_store_gives_the_same_arrays(tmp_path):
    obs_space, act_space = fetch_spaces(4, 2, 3)
    path = str(tmp_path / "s")
    sb3, store, writer = _run(path, obs_space, act_space, 2, 70, 24, seed=7)
    writer.flush_partial()
    sb3.truncate_last_trajectory()
    store.close()
    with EpisodeStore.open(path) as reader:
        empty = [writer.pending(e) for e in range(2)]
        _assert_same(sb3_arrays(reader, 24, 2, empty), sb3)


@pytest.mark.filterwarnings("ignore:The last trajectory")
def test_an_evicting_ring_keeps_every_sampleable_row(tmp_path):
    """A capacity ring evicts whole episodes: rows SB3 can sample are all there when `steps` pins the position."""
    obs_space, act_space = fetch_spaces(4, 2, 3)
    n_envs, bs, n_steps = 2, 16, 120
    sb3, store, writer = _run(
        str(tmp_path / "s"), obs_space, act_space, n_envs, n_steps, bs, seed=11, capacity=n_envs * bs + 4
    )
    assert store.first_episode > 0
    pending = [writer.pending(e) for e in range(n_envs)]
    got = sb3_arrays(store, bs, n_envs, pending, steps=n_steps)
    sampleable = sb3.ep_length > 0
    np.testing.assert_array_equal(got.ep_length, sb3.ep_length)
    assert got.pos == sb3.pos and got.full
    for name in ("actions", "rewards", "dones", "timeouts", "ep_start"):
        np.testing.assert_array_equal(getattr(got, name)[sampleable], getattr(sb3, name)[sampleable], err_msg=name)
    for k in obs_space.spaces:
        np.testing.assert_array_equal(got.next_observations[k][sampleable], sb3.next_observations[k][sampleable])
    # rows of evicted episodes still in SB3's ring are zeros in the layout, never another episode's data
    placed = got.rewards != 0
    np.testing.assert_array_equal(got.rewards[placed], sb3.rewards[placed])
    assert (sb3.rewards[~placed] != 0).any()
    store.close()


def test_episodes_appended_whole_fill_a_single_column_by_id(tmp_path, fetch):
    """A store someone filled with whole episodes (no env recorded), then trained on with one env."""
    obs_space, act_space = fetch
    store = open_store(str(tmp_path / "s"), obs_space, act_space)
    eps = [make_episode(obs_space, act_space, T, seed=T, terminated=T == 3) for T in (3, 4)]
    for ep in eps:
        store.append_episode(ep)
    w = store.writer(1)
    ep = make_episode(obs_space, act_space, 2, seed=9)
    w.add(
        {k: ep[k][:1] for k in obs_space.spaces},
        {k: ep[k][1:2] for k in obs_space.spaces},
        ep["action"][:1],
        ep["reward"][:1],
        np.zeros(1, bool),
        np.zeros(1, bool),
    )
    got = sb3_arrays(store, 6, 1, [w.pending(0)])
    # steps 0-2, 3-6 and the pending one (step 7) in a ring of 6: rows 0-1 hold steps 6-7, rows 2-5 steps 2-5
    assert (got.pos, got.full) == (2, True)
    np.testing.assert_array_equal(
        got.actions[:, 0],
        np.concatenate([eps[1]["action"][3:], ep["action"][:1], eps[0]["action"][2:], eps[1]["action"][:3]]),
    )
    assert got.ep_length[:, 0].tolist() == [4, 0, 0, 4, 4, 4]  # the first episode is partly overwritten
    assert got.ep_start[:, 0].tolist() == [3, 1, 0, 3, 3, 3] and got.current_ep_start.tolist() == [1]
    assert got.dones[:, 0].tolist() == [1, 0, 1, 0, 0, 0] and got.timeouts[:, 0].tolist() == [1, 0, 0, 0, 0, 0]
    store.close()


def test_episodes_of_no_env_in_range_are_dealt_to_the_columns_in_turn(tmp_path, fetch):
    """Episodes appended whole (env_index -1) or of a run with more envs take the columns in turn, in id order."""
    obs_space, act_space = fetch
    store = open_store(str(tmp_path / "s"), obs_space, act_space)
    w3 = store.writer(3)
    eps = [make_episode(obs_space, act_space, T, seed=T) for T in (2, 3, 4, 5)]
    store.append_episode(eps[0])  # id 0, env_index -1
    for t in range(2):  # env 2 of a 3-env run ends an episode of 2 steps: id 1
        ep = eps[0]
        w3.add(
            {k: np.repeat(ep[k][t : t + 1], 3, 0) for k in obs_space.spaces},
            {k: np.repeat(ep[k][t + 1 : t + 2], 3, 0) for k in obs_space.spaces},
            np.repeat(ep["action"][t : t + 1], 3, 0),
            np.zeros(3, np.float32),
            np.array([False, False, t == 1]),
            np.zeros(3, bool),
        )
    store.flush()
    for ep in eps[1:]:
        store.append_episode(ep)  # ids 2-4, env_index -1
    columns, steps = env_columns(store, 2)
    assert store.episodes["env_index"].tolist() == [-1, 2, -1, -1, -1]
    assert columns.tolist() == [0, 1, 0, 1, 0] and steps.tolist() == [2 + 3 + 5, 2 + 4]
    w2 = store.writer(2)
    got = sb3_arrays(store, 16, 2, [w2.pending(e) for e in range(2)])
    assert (got.pos, got.full) == (10, False)
    assert got.ep_length[:, 0].tolist() == [2] * 2 + [3] * 3 + [5] * 5 + [0] * 6
    assert got.ep_length[:, 1].tolist() == [0] * 4 + [2] * 2 + [4] * 4 + [0] * 6  # ends at row pos - 1, as env 0
    np.testing.assert_array_equal(got.actions[6:10, 1], eps[2]["action"])
    assert env_columns(store, 1)[1].tolist() == [16] and env_columns(store, 3)[0].tolist() == [0, 2, 1, 2, 0]
    with pytest.raises(ValueError, match="n_envs must be an int >= 1"):
        env_columns(store, 0)
    store.close()


def test_empty_store_and_no_steps(tmp_path, fetch):
    store = open_store(str(tmp_path / "s"), *fetch)
    w = store.writer(2)
    got = sb3_arrays(store, 8, 2, [w.pending(0), w.pending(1)])
    assert got.pos == 0 and not got.full and not got.ep_length.any()
    assert got.observations["observation"].shape == (8, 2, 10) and got.actions.shape == (8, 2, 4)
    store.close()


def test_bad_input_is_refused_and_the_store_is_intact(tmp_path, fetch):
    obs_space, act_space = fetch
    store = open_store(str(tmp_path / "s"), obs_space, act_space)
    store.append_episode(make_episode(obs_space, act_space, 5, seed=1))  # appended whole: env_index -1
    other = open_store(str(tmp_path / "t"), obs_space, act_space)
    w2 = other.writer(3)
    ep = make_episode(obs_space, act_space, 2, seed=2)
    for t in range(2):
        step = {k: np.repeat(ep[k][t : t + 1], 3, 0) for k in obs_space.spaces}
        nxt = {k: np.repeat(ep[k][t + 1 : t + 2], 3, 0) for k in obs_space.spaces}
        w2.add(
            step,
            nxt,
            np.repeat(ep["action"][t : t + 1], 3, 0),
            np.zeros(3, np.float32),
            np.array([False, False, t == 1]),
            np.zeros(3, bool),
        )
    pend = [w2.pending(e) for e in range(3)]
    with pytest.raises(ValueError, match="sequence of 3 episodes"):
        sb3_arrays(other, 8, 3, pend[:2])
    with pytest.raises(ValueError, match="sequence of 3"):
        sb3_arrays(other, 8, 3, pend[0])
    with pytest.raises(TypeError, match="store must be an EpisodeStore"):
        sb3_arrays(str(tmp_path / "t"), 8, 3, pend)
    with pytest.raises(ValueError, match="buffer_size must be an int >= 1"):
        sb3_arrays(other, 0, 3, pend)
    with pytest.raises(ValueError, match="n_envs must be an int >= 1"):
        sb3_arrays(other, 8, True, pend)
    with pytest.raises(ValueError, match=r"pending\[1\].*missing \['reward'\]"):
        sb3_arrays(other, 8, 3, [pend[0], {k: v for k, v in pend[1].items() if k != "reward"}, pend[2]])
    with pytest.raises(ValueError, match=r"pending\[0\]\['achieved_goal'\] has shape \(2, 3\), expected 3 rows"):
        sb3_arrays(other, 8, 3, [{**pend[0], "achieved_goal": pend[0]["achieved_goal"][:2]}, *pend[1:]])
    with pytest.raises(ValueError, match=r"pending\[0\]\['observation'\] has shape \(3, 9\)"):
        sb3_arrays(other, 8, 3, [{**pend[0], "observation": pend[0]["observation"][:, :9]}, *pend[1:]])
    with pytest.raises(ValueError, match=r"pending\[1\]\['action'\] has shape \(2, 3\), expected 2 actions of 4"):
        sb3_arrays(other, 8, 3, [pend[0], {**pend[1], "action": pend[1]["action"][:, :3]}, pend[2]])
    with pytest.raises(ValueError, match=r"pending\[2\] must be a mapping"):
        sb3_arrays(other, 8, 3, [*pend[:2], None])
    with pytest.raises(ValueError, match=r"steps must be an int >= 2"):
        sb3_arrays(other, 8, 3, pend, steps=1)
    good = sb3_arrays(other, 8, 3, pend, steps=5)
    assert good.pos == 5 and good.current_ep_start.tolist() == [3, 3, 5]
    good.rewards[:] = 7  # the arrays are copies: the store does not change
    assert other.num_episodes == 1 and not other.episode(0)["reward"].any()
    assert store.num_episodes == 1
    store.close()
    other.close()


def test_counts_and_flags_are_checked_by_name_and_numpy_ints_accepted(tmp_path, fetch):
    obs_space, act_space = fetch
    store = open_store(str(tmp_path / "s"), obs_space, act_space)
    store.append_episode(make_episode(obs_space, act_space, 5, seed=1))
    w = store.writer(2)
    pend = [w.pending(e) for e in range(2)]
    cases = [
        ({"buffer_size": 8.0}, "buffer_size must be an int >= 1, not a float: got 8.0"),
        ({"buffer_size": True}, "buffer_size must be an int >= 1, not a bool: got True"),
        ({"n_envs": 2.0}, "n_envs must be an int >= 1, not a float: got 2.0"),
        ({"steps": 7.5}, "steps must be an int >= 5, not a float: got 7.5"),
        ({"handle_timeout_termination": "yes"}, "handle_timeout_termination must be True or False, not a str"),
        ({"handle_timeout_termination": 1}, "handle_timeout_termination must be True or False, not an int: got 1"),
    ]
    for change, match in cases:
        kwargs = {"buffer_size": 8, "n_envs": 2, "pending": pend, **change}
        with pytest.raises(ArgumentTypeError, match=match):
            sb3_arrays(store, **kwargs)
    with pytest.raises(ArgumentTypeError, match="n_envs must be an int >= 1, not a str: got '2'"):
        env_columns(store, "2")
    got = sb3_arrays(
        store, np.int64(8), np.int32(2), pend, handle_timeout_termination=np.bool_(False), steps=np.uint8(6)
    )
    assert (got.pos, got.full) == (6, False) and not got.timeouts.any()
    assert env_columns(store, np.int64(2))[1].tolist() == [5, 0]
    store.close()
