"""GoalMixture: offline goal-conditioned sampling (current, future, random goals) in relabel.py and HerSampler.

Statistics against the mixture's law (shares, uniform and truncated-geometric future steps, transition-uniform random
goals), goals that stay inside their episode and among the live episodes of a ring, rewards that agree with the
chosen goal, fixed seeds, validation, and the offline behaviour-cloning example run end to end.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from her_store import EpisodeStore, GoalMixture, HerSampler
from her_store.sampling.relabel import parse_strategy
from tests.conftest import ROOT, fetch_spaces
from tests.sampling.test_sampler import _chi2, _chi2_crit, coded_episode, sparse_reward


@pytest.fixture
def coded_store(tmp_path):
    """40 episodes of lengths 1..40 whose achieved goal at row r of episode e is (e, r, 0)."""
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act) as store:
        for i in range(40):
            store.append_episode(coded_episode(obs, act, i, T=i + 1, seed=i))
        yield store


def _goal_steps(batch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Episode ids, steps t, goal episodes and goal steps j (the goal is the next achieved goal at step j)."""
    goal = batch.observations["desired_goal"].numpy()
    return batch.episode_ids.numpy(), batch.steps.numpy(), goal[:, 0].astype(int), goal[:, 1].astype(int) - 1


# -- the index maths (relabel.py) -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p", [(0.2, 0.5, 0.3), (0.0, 1.0, 0.0), (1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.5, 0.0, 0.5), (0.1, 0.9, 0.0)]
)
def test_shares_of_current_future_and_random_goals_are_the_probabilities(p):
    n = 200_000
    steps, lengths = np.zeros(n, np.int64), np.full(n, 100)  # t < L - 1: a future step is always later than t
    j, anywhere = GoalMixture(*p).select(steps, lengths, np.random.default_rng(0))
    counts = np.array([(~anywhere & (j == steps)).sum(), (~anywhere & (j > steps)).sum(), anywhere.sum()])
    expected = n * np.array(p)
    assert (counts[expected == 0] == 0).all(), "a source of probability 0 is never drawn"
    live = expected > 0
    if live.sum() > 1:
        assert _chi2(counts[live], expected[live]) < _chi2_crit(int(live.sum()) - 1)
    else:
        assert counts[live][0] == n


def test_uniform_future_steps_are_uniform_over_the_later_steps():
    rng = np.random.default_rng(1)
    n = 100_000
    j, _ = GoalMixture(0.0, 1.0, 0.0).select(np.full(n, 5), np.full(n, 20), rng)
    assert j.min() == 6 and j.max() == 19
    counts = np.bincount(j - 6, minlength=14)
    assert len(counts) == 14 and _chi2(counts, np.full(14, n / 14)) < _chi2_crit(13)
    # the last step has no later one: its future goal is its own
    j, _ = GoalMixture(0.0, 1.0, 0.0).select(np.array([0, 3, 9]), np.array([1, 4, 10]), rng)
    np.testing.assert_array_equal(j, [0, 3, 9])


@pytest.mark.parametrize("discount", [0.5, 0.9])
def test_geometric_future_steps_follow_the_truncated_geometric_law(discount):
    rng = np.random.default_rng(2)
    n, m = 200_000, 14  # t = 0, L = 15: offsets 1..14, the tail beyond the episode folded onto its last step
    j, _ = GoalMixture(0.0, 1.0, 0.0, discount=discount).select(np.zeros(n, np.int64), np.full(n, m + 1), rng)
    assert j.min() >= 1 and j.max() <= m
    k = np.arange(1, m + 1)
    pmf = (1 - discount) * discount ** (k - 1)
    pmf[-1] = discount ** (m - 1)
    counts = np.bincount(j, minlength=m + 1)[1:]
    keep = n * pmf >= 5  # chi-square wants expected counts of at least 5 per cell
    assert _chi2(counts[keep], n * pmf[keep]) < _chi2_crit(int(keep.sum()) - 1)
    # mean of the truncated law: sum_{i < m} discount**i
    mean = (1 - discount**m) / (1 - discount)
    sd = np.sqrt(((k - mean) ** 2 * pmf).sum() / n)
    assert abs(j.mean() - mean) < 5 * sd
    # far from the end the offset is the plain geometric law, mean 1 / (1 - discount)
    j, _ = GoalMixture(0.0, 1.0, 0.0, discount=discount).select(np.zeros(n, np.int64), np.full(n, 10_000), rng)
    assert abs(j.mean() - 1 / (1 - discount)) < 5 * np.sqrt(discount / n) / (1 - discount)


def test_discount_zero_takes_the_next_step():
    t, L = np.array([0, 4, 9]), np.array([10, 10, 10])
    j, _ = GoalMixture(0.0, 1.0, 0.0, discount=0.0).select(t, L, np.random.default_rng(0))
    np.testing.assert_array_equal(j, [1, 5, 9])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.5, 0.5, 0.1), "must sum to 1"),
        ((0.5, 0.4, 0.0), "must sum to 1"),
        ((-0.1, 1.1, 0.0), "p_current must be >= 0"),
        ((0.0, 1.0, -0.0000001), "p_random must be >= 0"),
        ((float("nan"), 1.0, 0.0), "p_current must be a finite real number"),
        ((0.0, "1", 0.0), "p_future must be a finite real number"),
        ((True, 0.0, 0.0), "p_current must be a finite real number"),
        ((0.0, 1.0, 0.0, 1.0), r"discount must be in \[0, 1\) or None"),
        ((0.0, 1.0, 0.0, -0.5), r"discount must be in \[0, 1\) or None"),
        ((0.0, 1.0, 0.0, float("inf")), "discount must be a finite real number"),
    ],
)
def test_a_bad_mixture_is_refused_naming_what_is_wrong(args, message):
    with pytest.raises(ValueError, match=message):
        GoalMixture(*args)


def test_probabilities_within_rounding_of_one_are_accepted_and_frozen():
    m = GoalMixture(1 / 3, 1 / 3, 1 / 3 + 5e-7, discount=np.float32(0.5))
    assert isinstance(m.discount, float) and parse_strategy(m) is m
    with pytest.raises(AttributeError):
        m.p_current = 1.0  # type: ignore[misc]


# -- through HerSampler -----------------------------------------------------------------------------------------


def test_every_transition_is_relabelled_unless_relabelling_is_off(coded_store):
    for n_goal in (1, 4):
        s = HerSampler(coded_store, 257, n_sampled_goal=n_goal, goal_selection_strategy=GoalMixture(0, 1, 0), seed=0,
                       reward_fn=sparse_reward)
        assert s.her_ratio == 1.0 and bool(s.sample().is_relabeled.all())
    s = HerSampler(coded_store, 64, n_sampled_goal=0, goal_selection_strategy=GoalMixture(0, 1, 0), seed=0)
    b = s.sample()
    assert s.reward_fn is None and not bool(b.is_relabeled.any())


def test_future_goals_stay_in_their_episode_and_never_go_backwards(coded_store):
    for discount in (None, 0.9):
        s = HerSampler(coded_store, 65_536, goal_selection_strategy=GoalMixture(0, 1, 0, discount=discount),
                       reward_fn=sparse_reward, seed=3)
        ids, t, gids, j = _goal_steps(s.sample())
        L = ids + 1
        assert (gids == ids).all()
        assert ((j > t) | ((j == t) & (t == L - 1))).all() and (j <= L - 1).all()
        # given 19 steps after t: offsets j - t uniform over 1..19, or the truncated geometric law
        sel = L - 1 - t == 19
        counts = np.bincount(j[sel] - t[sel] - 1, minlength=19)
        assert sel.sum() > 1000 and len(counts) == 19
        if discount is None:
            pmf = np.full(19, 1 / 19)
        else:
            pmf = (1 - discount) * discount ** np.arange(19)
            pmf[-1] = discount**18
        keep = sel.sum() * pmf >= 5
        assert _chi2(counts[keep], sel.sum() * pmf[keep]) < _chi2_crit(int(keep.sum()) - 1)


def test_current_goals_are_the_transitions_own_next_achieved_goal(coded_store):
    p_current = 0.3
    s = HerSampler(coded_store, 65_536, goal_selection_strategy=GoalMixture(p_current, 1 - p_current, 0),
                   reward_fn=sparse_reward, seed=4)
    b = s.sample()
    ids, t, gids, j = _goal_steps(b)
    assert (gids == ids).all()
    # j == t for a current goal, and for a future goal at the last step
    last = t == ids
    n = len(t)
    expected = p_current * n + (1 - p_current) * last.sum()
    var = p_current * (1 - p_current) * (~last).sum()
    assert abs((j == t).sum() - expected) < 5 * np.sqrt(var)
    own = j == t
    goals, reached = b.observations["desired_goal"].numpy(), b.next_observations["achieved_goal"].numpy()
    np.testing.assert_array_equal(goals[own], reached[own])
    assert (b.rewards.numpy()[own, 0] == 0).all(), "a current goal is reached by the transition itself"


def test_random_goals_are_transition_uniform_over_the_store(coded_store):
    lengths = np.arange(1, 41)
    s = HerSampler(coded_store, 65_536, goal_selection_strategy=GoalMixture(0, 0, 1), reward_fn=sparse_reward, seed=5)
    _, _, gids, j = _goal_steps(s.sample())
    assert ((0 <= j) & (j < lengths[gids])).all()
    counts = np.bincount(gids, minlength=40)
    assert _chi2(counts, len(gids) * lengths / lengths.sum()) < _chi2_crit(39)
    # within an episode the step is uniform too
    sel = gids == 39
    assert _chi2(np.bincount(j[sel], minlength=40), np.full(40, sel.sum() / 40)) < _chi2_crit(39)


def test_the_share_of_goals_from_other_episodes_is_that_of_random_goals(coded_store):
    p = (0.2, 0.5, 0.3)
    s = HerSampler(coded_store, 65_536, goal_selection_strategy=GoalMixture(*p, discount=0.9), reward_fn=sparse_reward,
                   seed=6)
    ids, _, gids, _ = _goal_steps(s.sample())
    w = np.arange(1, 41) / np.arange(1, 41).sum()  # a random goal's episode is the transition's own with P sum w^2
    q = p[2] * (1 - (w**2).sum())
    n = len(ids)
    assert abs((gids != ids).sum() - n * q) < 5 * np.sqrt(n * q * (1 - q))


def test_rewards_are_recomputed_for_the_chosen_goal(coded_store):
    s = HerSampler(coded_store, 4096, goal_selection_strategy=GoalMixture(0.2, 0.5, 0.3, discount=0.95),
                   reward_fn=sparse_reward, seed=7)
    b = s.sample()
    desired = b.observations["desired_goal"].numpy()
    np.testing.assert_array_equal(b.next_observations["desired_goal"].numpy(), desired)
    want = sparse_reward(b.next_observations["achieved_goal"].numpy(), desired, None)
    np.testing.assert_array_equal(b.rewards.numpy()[:, 0], want)
    assert 0.15 < (want == 0).mean() < 0.35, "current goals (and a few others) are reached"


def test_fixed_seeds_reproduce_the_goals(coded_store):
    def goals(seed, prefetch=0):
        with HerSampler(coded_store, 512, goal_selection_strategy=GoalMixture(0.2, 0.5, 0.3, discount=0.9),
                        reward_fn=sparse_reward, seed=seed, prefetch=prefetch) as s:
            return [s.sample().observations["desired_goal"].numpy().copy() for _ in range(3)]

    a, b, c, d = goals(8), goals(8), goals(9), goals(8, prefetch=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert all(np.array_equal(x, y) for x, y in zip(a, d))
    assert not np.array_equal(a[0], c[0])


def test_random_goals_of_a_ring_come_only_from_its_live_episodes(tmp_path):
    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "s", obs, act, capacity=200, chunk_rows=32) as store:
        lengths = {}
        for i in range(60):  # the ring wraps several times: rows past the write position hold evicted episodes
            lengths[i] = 5 + i % 11
            store.append_episode(coded_episode(obs, act, i, T=lengths[i], seed=i))
        store.flush()
        first, end = store.first_episode, store.end_episode
        assert first > 30
        s = HerSampler(store, 20_000, goal_selection_strategy=GoalMixture(0.1, 0.2, 0.7), reward_fn=sparse_reward,
                       seed=9)
        ids, _, gids, j = _goal_steps(s.sample())
        assert ((first <= gids) & (gids < end)).all() and ((first <= ids) & (ids < end)).all()
        L = np.array([lengths[g] for g in gids])
        assert ((0 <= j) & (j < L)).all()
        live = np.array([lengths[e] for e in range(first, end)])
        counts = np.bincount(gids[gids != ids] - first, minlength=end - first)
        assert (counts > 0).all(), "every live episode is a source of random goals"
        # current and future goals come from the transition's own episode, drawn transition-uniformly as well
        expected = len(gids) * live / live.sum()
        assert _chi2(np.bincount(gids - first, minlength=end - first), expected) < _chi2_crit(end - first - 1)


# -- the offline behaviour-cloning example ----------------------------------------------------------------------


@pytest.mark.slow
def test_offline_gcbc_example_learns_to_beat_a_random_policy(tmp_path):
    # seeds 0..11 at these settings: random 8-18%, GCBC 46-78%, GCBC ahead by 34 points or more
    out = subprocess.run(
        [sys.executable, str(Path(ROOT) / "examples" / "offline_gcbc.py"), "--collect-steps", "8000", "--steps", "300",
         "--eval-episodes", "50", "--seed", "0", "--store", str(tmp_path / "data")],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    found = re.findall(r"^(random|GCBC) policy success rate: ([0-9.]+)%", out.stdout, re.MULTILINE)
    rates = {k: float(v) for k, v in found}
    assert set(rates) == {"random", "GCBC"}, out.stdout
    assert rates["GCBC"] >= rates["random"] + 15, out.stdout
    with EpisodeStore.open(tmp_path / "data") as store:  # the dataset is kept where --store points
        assert store.num_transitions == 8000 and store.metadata["env_id"] == "her_store/PointGoal-v0"
