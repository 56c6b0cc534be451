"""WorkingSetSampler: rows and rewards as the store holds them, the long-run share of every episode, the byte budget,
whole-chunk reads over S3, and a ring writer evicting while the set is refilled."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

from her_store import EpisodeStore
from her_store.errors import StoreError
from her_store.sampling.working_set import WorkingSetSampler
from tests.conftest import fetch_spaces
from tests.sampling.test_sampler import coded_episode, sparse_reward

# rows of one transition here: packs/float32 (observation 10, goals 3 + 3, action 4, reward 1) and the flags
OBS, ACT = fetch_spaces()


def coded(i: int) -> dict:
    """Episode ``i``: length 3..13 by id, achieved_goal row r = (i, r, 0); rebuilt from its id alone."""
    return coded_episode(OBS, ACT, i, T=3 + (i * 7) % 11, seed=i)


def assert_rows_are_the_stores(b, eps) -> None:
    """Every row of the batch is its episode's row at (episode_id, step); relabelled goals come from the same
    episode at or after the step (future), and every relabelled reward is recomputed for its new goal."""
    ids, t = b.episode_ids.numpy(), b.steps.numpy()

    def at(key, d=0):
        return np.stack([eps[e][key][k + d] for e, k in zip(ids, t)])

    for k in ("observation", "achieved_goal"):
        np.testing.assert_array_equal(b.observations[k].numpy(), at(k))
        np.testing.assert_array_equal(b.next_observations[k].numpy(), at(k, 1))
    np.testing.assert_array_equal(b.actions.numpy(), at("action"))
    her = b.is_relabeled.numpy()
    goal = b.observations["desired_goal"].numpy()
    next_goal = b.next_observations["desired_goal"].numpy()
    np.testing.assert_array_equal(goal[her], next_goal[her])
    np.testing.assert_array_equal(goal[~her], at("desired_goal")[~her])
    np.testing.assert_array_equal(next_goal[~her], at("desired_goal", 1)[~her])
    assert (goal[her, 0] == ids[her]).all() and (goal[her, 1] >= t[her] + 1).all()  # future: j in [t, L-1]
    lengths = np.array([len(eps[e]["action"]) for e in ids])
    assert (goal[her, 1] <= lengths[her]).all()
    want = at("reward")
    want[her] = sparse_reward(b.next_observations["achieved_goal"].numpy()[her], goal[her], None)
    np.testing.assert_array_equal(b.rewards.numpy()[:, 0], want)
    np.testing.assert_array_equal(b.terminated.numpy()[:, 0], at("terminated").astype(np.float32))


@pytest.fixture
def coded_store(tmp_path):
    eps = {i: coded(i) for i in range(120)}
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=64) as store:
        for i in range(120):
            store.append_episode(eps[i])
    store = EpisodeStore.open(tmp_path / "s")
    yield store, eps
    store.close()


def test_every_sampled_row_is_its_episodes_row_with_relabelled_rewards(coded_store):
    store, eps = coded_store
    budget = 300 * 86  # 300 rows: about a quarter of the store's 1,081
    with WorkingSetSampler(store, budget, 128, reward_fn=sparse_reward, seed=1, background=False,
                           refill_fraction=0.25) as s:
        assert s.row_bytes == 86 and s.capacity_rows == 300
        seen: set[int] = set()
        for _ in range(50):
            b = s.sample()
            assert_rows_are_the_stores(b, eps)
            assert set(b.episode_ids.tolist()) <= set(s.episode_ids.tolist())  # drawn from the set only
            seen |= set(s.episode_ids.tolist())
            s.refill()
        assert s.num_transitions < store.num_transitions / 2 and len(seen) > 100  # the set rotated over the store
    with WorkingSetSampler(store, budget, 64, reward_fn=sparse_reward, seed=1, background=False,
                           goal_selection_strategy="random") as s:
        b = s.sample()
        her = b.is_relabeled.numpy()
        goal_ids = b.observations["desired_goal"].numpy()[her, 0].astype(np.int64)
        assert set(goal_ids.tolist()) <= set(s.episode_ids.tolist())  # random goals: from the set's transitions


def test_each_episodes_long_run_share_of_samples_is_its_share_of_transitions(tmp_path):
    """Over 1,200 refills, each episode's expected share of samples (its ``episode_shares`` summed over the sets it
    was in) is within 30 % of its share of the store's transitions ``L_e / N``, and the spread of that ratio over the
    60 episodes is under 13 %; samples drawn every 5th refill agree with those expectations (chi-square, p > 1e-4).

    Why these bounds: the set holds two arcs of A = 37 transitions of the store's N = 481, one replaced at each
    refill, so over 1,200 refills the arcs cover each transition about 92 times and its share has a relative spread
    of about sqrt(N / (1200 A)) = 10 % (7-9 % measured over seeds, the largest deviation 22 %). An arc that does not
    wrap around the store's ends, which gives the first episodes almost no share, fails both bounds (ratio 0.05,
    spread 0.25)."""
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=64) as store:
        for i in range(60):
            store.append_episode(coded(i))
    with EpisodeStore.open(tmp_path / "s") as store:
        view = store.snapshot()
        share = view.lengths / view.num_transitions
        refills, B = 1200, 256
        with WorkingSetSampler(store, 150 * 86, B, reward_fn=sparse_reward, seed=3, background=False,
                               refill_fraction=0.5) as s:
            in_set, expected, drawn = np.zeros(len(share)), np.zeros(len(share)), np.zeros(len(share))
            s.sample()
            for k in range(refills):
                s.refill()
                pos, p = s.episode_ids - view.first, s.episode_shares
                np.add.at(in_set, pos, p)  # an episode two arcs reached is in the set twice
                if k % 5 == 0:
                    np.add.at(expected, pos, B * p)
                    drawn += np.bincount(s.sample().episode_ids.numpy() - view.first, minlength=len(share))
    ratio = in_set / (refills * share)
    assert 0.7 < ratio.min() and ratio.max() < 1.3 and ratio.std() < 0.13, (ratio.min(), ratio.max(), ratio.std())
    chisquare = pytest.importorskip("scipy.stats", reason="the chi-square test is scipy's: pip install scipy").chisquare
    assert chisquare(drawn, expected).pvalue > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("long_T, n_long, rows", [(300, 10, 700), (100, 30, 1000)])
def test_each_length_class_gets_its_share_of_the_transitions_in_the_long_run(tmp_path, long_T, n_long, rows):
    """Episodes of 1 and of 300 steps in a set of 700 rows (just over two of the longest), and of 1 and 100 steps in
    1,000 rows, half the store's transitions in each class, in a shuffled order: over 20,000 refills driven by hand,
    each followed by a batch of 256, each class's share of the sampled transitions is within 3 % of its share of the
    store's, and within 4 standard errors of it (from the means of 100 runs of 200 refills: a set shares arcs with
    the sets before it, so single batches are not independent). Before each batch, the set's own law
    (``episode_shares``) gives the class the share that its sampled rows have over all refills, within 4 standard
    errors as well. A set that loads and evicts whole episodes by arcs of rows and draws uniformly over the transitions
    it holds fails both: the 1-step class gets +29 % (z = 42) and +4.2 % (z = 7), for a set holding short episodes
    holds fewer transitions, each then drawn more often."""
    order = np.random.default_rng(0).permutation(np.r_[np.full(n_long, long_T), np.ones(n_long * long_T, np.int64)])
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=256) as store:
        for i, T in enumerate(order):
            store.append_episode(coded_episode(OBS, ACT, i, T=int(T), seed=i))
    refills = 20_000
    short, law = np.zeros(refills), np.zeros(refills)
    with EpisodeStore.open(tmp_path / "s") as store, WorkingSetSampler(store, rows * 86, 256, n_sampled_goal=0,
                                                                        seed=0, background=False) as s:
        for k in range(refills):
            s.refill()
            law[k] = s.episode_shares[order[s.episode_ids] == 1].sum()
            short[k] = np.mean(order[s.sample().episode_ids.numpy()] == 1)
    for got in (short, law):
        share = got.mean()
        se = got.reshape(100, -1).mean(axis=1).std(ddof=1) / np.sqrt(100)
        assert abs(share / 0.5 - 1) < 0.03 and abs(share - 0.5) < 4 * se, (share, (share - 0.5) / se)


def test_the_set_never_holds_more_than_its_budget_while_a_writer_appends(tmp_path):
    eps = {i: coded(i) for i in range(200)}
    budget = 10_000
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=64, commit_interval=0) as writer:
        for i in range(40):
            writer.append_episode(eps[i])
        with WorkingSetSampler(
            writer, budget, 64, reward_fn=sparse_reward, seed=0, refill_fraction=0.25, refill_interval=0.0
        ) as s:
            assert s.nbytes == s.capacity_rows * s.row_bytes <= budget
            assert s.nbytes == sum(b.element_size() * b.nelement() for b in s.set_rows.buffers.values())
            newest = 0
            for i in range(40, 200):
                writer.append_episode(eps[i])
                b = s.sample()
                assert s.resident_bytes <= s.nbytes <= budget
                assert_rows_are_the_stores(b, eps)
                newest = max(newest, int(b.episode_ids.max()))
            deadline = time.monotonic() + 300  # the background refills run at their own pace (300 s: a hang)
            while (s.refills <= 10 or newest < 150) and time.monotonic() < deadline:
                b = s.sample()
                assert_rows_are_the_stores(b, eps)
                newest = max(newest, int(b.episode_ids.max()))
            assert s.refills > 10 and newest >= 150  # new commits joined the set
    with EpisodeStore.open(tmp_path / "s") as store:
        with pytest.raises(ValueError, match="holds 1 row"):
            WorkingSetSampler(store, 100, reward_fn=sparse_reward)
        s = WorkingSetSampler(store, 20 * 86, 8, reward_fn=sparse_reward, background=False)
        with s, pytest.raises(StoreError, match="two of the longest episode"):
            s.sample()


@pytest.mark.slow
def test_over_s3_a_refill_reads_whole_chunks(s3_url):
    url, opts = s3_url
    eps = {i: coded(i) for i in range(60)}
    with EpisodeStore.create(url, OBS, ACT, storage_options=opts, chunk_rows=32) as store:
        for i in range(60):
            store.append_episode(eps[i])
    with EpisodeStore.open(url, storage_options=opts) as store:
        with WorkingSetSampler(store, 200 * 86, 64, reward_fn=sparse_reward, seed=2, background=False) as s:
            arrays = s.reader.arrays.values()
            assert_rows_are_the_stores(s.sample(), eps)
            gather, asked = s.reader.gather, []

            def recording(path, rows, out=None):  # the rows a refill asks the reader for
                asked.append(np.array(rows))
                return gather(path, rows, out=out)

            s.reader.gather = recording
            for _ in range(5):
                before = {id(a): a.misses for a in arrays}
                asked.clear()
                assert s.refill() > 0  # every refill reads the episodes its arc reaches
                chunks = len(np.unique(np.concatenate(asked) // 32))
                for a in arrays:  # one GET per chunk those episodes reach (the last chunk read may still be cached)
                    assert a.chunk_rows == 32 and chunks - 1 <= a.misses - before[id(a)] <= chunks
                assert_rows_are_the_stores(s.sample(), eps)
        with WorkingSetSampler(store, 200 * 86, 64, reward_fn=sparse_reward, seed=2) as s:  # background refills
            for _ in range(5):
                assert_rows_are_the_stores(s.sample(), eps)


def test_a_ring_writer_evicting_during_a_refill_read_leaves_no_evicted_episode_in_the_set(tmp_path):
    eps = {i: coded(i) for i in range(30)}
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, capacity=200, chunk_rows=32, commit_interval=0) as writer:
        for i in range(30):
            writer.append_episode(eps[i])
        store = EpisodeStore.open(tmp_path / "s")
        s = WorkingSetSampler(store, 120 * 86, 64, reward_fn=sparse_reward, seed=0, background=False,
                              refresh_interval=0)
        with store, s:
            gather, appended, torn, calls = s.reader.gather, itertools.count(30), [], itertools.count()

            def overwriting(path, rows, out=None):  # the writer evicts while a refill reads: every 3rd read, until
                view = writer.snapshot()  # the oldest episode being read is gone
                reading = view.first + np.flatnonzero(np.isin(view.start_rows, rows))
                while next(calls) % 3 == 0 and writer.first_episode <= reading.min():
                    i = next(appended)
                    eps[i] = coded(i)
                    writer.append_episode(eps[i])
                torn.append(int((reading < writer.first_episode).sum()))
                return gather(path, rows, out=out)

            s.reader.gather = overwriting
            for _ in range(10):
                s.refill()
                first = writer.first_episode
                assert len(s.episode_ids) and s.episode_ids.min() >= first  # read while evicted: never kept
                assert_rows_are_the_stores(s.sample(), eps)
            assert sum(torn) > 0  # refills did read episodes the writer was evicting
        # and a writer appending in its own thread while the background refills run
        store = EpisodeStore.open(tmp_path / "s")
        with store, WorkingSetSampler(store, 120 * 86, 64, reward_fn=sparse_reward, seed=0, refresh_interval=0) as s:
            import threading

            def write() -> None:
                for i in range(writer.end_episode, writer.end_episode + 100):
                    eps[i] = coded(i)
                    writer.append_episode(eps[i])

            t = threading.Thread(target=write)
            t.start()
            while t.is_alive():
                assert_rows_are_the_stores(s.sample(), eps)
            t.join()
            s.refill()
            assert s.episode_ids.min() >= writer.first_episode
            assert_rows_are_the_stores(s.sample(), eps)


def test_the_set_lives_on_the_samplers_device_and_batches_stay_there(coded_store):
    store, _ = coded_store
    with WorkingSetSampler(store, 300 * 86, 32, reward_fn=sparse_reward, seed=0, background=False) as s:
        b = s.sample()
        assert all(buf.device == torch.device("cpu") for buf in s.set_rows.buffers.values())
        assert b.observations["observation"].device == s.device and b.rewards.dtype == torch.float32
    with pytest.raises(ValueError, match="refill_fraction"):
        WorkingSetSampler(store, 300 * 86, reward_fn=sparse_reward, refill_fraction=0.9)


def test_the_device_gather_gives_the_rows_the_host_gather_gives(coded_store):
    """The path a CUDA set takes (index_select on the device, goals and rewards brought to the host), run on CPU
    tensors: the same batches, row for row, as the host's numpy gather."""
    store, eps = coded_store
    kw = dict(reward_fn=sparse_reward, seed=5, background=False, refill_fraction=0.25)
    with WorkingSetSampler(store, 300 * 86, 64, **kw) as host, WorkingSetSampler(store, 300 * 86, 64, **kw) as dev:
        dev.set_rows.numpy_gather = False
        for _ in range(5):
            a, b = host.sample(), dev.sample()
            assert_rows_are_the_stores(b, eps)
            for key in ("observation", "achieved_goal", "desired_goal"):
                assert isinstance(b.observations[key], torch.Tensor)
                torch.testing.assert_close(a.observations[key], b.observations[key], rtol=0, atol=0)
                torch.testing.assert_close(a.next_observations[key], b.next_observations[key], rtol=0, atol=0)
            for x, y in ((a.actions, b.actions), (a.rewards, b.rewards), (a.episode_ids, b.episode_ids)):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
            host.refill()
            dev.refill()


@pytest.mark.parametrize("numpy_gather", [True, False])
def test_a_callable_strategy_reads_achieved_goals_from_the_set(coded_store, numpy_gather):
    """ctx.achieved_goals reads through the set's own gather (the host's numpy.take, or a device's index_select run
    on CPU tensors): each goal is its episode's achieved goal at the step asked for."""
    store, _ = coded_store

    def two_ahead(ctx) -> np.ndarray:
        return ctx.achieved_goals(ctx.episode_ids, np.minimum(ctx.steps + 2, ctx.lengths - 1))

    with WorkingSetSampler(store, 300 * 86, 256, goal_selection_strategy=two_ahead, reward_fn=sparse_reward, seed=3,
                           background=False) as s:
        s.set_rows.numpy_gather = numpy_gather
        for _ in range(3):
            b = s.sample()
            n = int(b.is_relabeled.sum())
            ids, t = b.episode_ids[:n].numpy(), b.steps[:n].numpy()
            lengths = np.array([3 + (int(i) * 7) % 11 for i in ids])  # coded(i)'s length
            goal = b.observations["desired_goal"][:n].numpy()
            assert n > 0 and (goal[:, 0] == ids).all()  # achieved_goal row r of episode i is (i, r, 0)
            np.testing.assert_array_equal(goal[:, 1] - 1, np.minimum(t + 2, lengths - 1))
            s.refill()
        with pytest.raises(IndexError, match="in the working set"):
            ctx_ids = np.array([10_000])
            s._achieved_goals_at(s._published[0])(ctx_ids, np.zeros(1, np.int64))


@pytest.fixture
def long_episodes(tmp_path):
    """Six episodes of 50 steps (51 rows each, 306 in all): an arc of a few rows would miss every first row."""
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, chunk_rows=64) as store:
        for i in range(6):
            store.append_episode(coded_episode(OBS, ACT, i, T=50, seed=i))
    with EpisodeStore.open(tmp_path / "s") as store:
        yield store


def test_every_refill_loads_the_whole_episodes_its_arc_reaches_however_small_refill_fraction(long_episodes):
    """A set of 130 rows holds one arc (a slot of at least four of the longest episode does not fit twice), of
    2 + (130 - 2 * 51) * 50 // 51 = 29 transitions: a refill loads the one or two whole episodes those reach, next
    to each other on the circle of episodes, and the set is that arc, at every seed."""
    for seed in range(20):
        with WorkingSetSampler(long_episodes, 130 * 86, 8, reward_fn=sparse_reward, seed=seed, background=False,
                               refill_fraction=1e-4) as s:
            for _ in range(3):
                loaded, ids = s.refill(), s.episode_ids
                assert loaded == 50 * len(ids) and len(ids) in (1, 2) and (len(ids) == 1 or (ids[1] - ids[0]) % 6 == 1)
                assert s.episode_shares.sum() == pytest.approx(1.0) and s.resident_bytes <= s.nbytes


def test_the_first_batch_fills_the_set(tmp_path, long_episodes):
    """The first batch fills the set with its arcs, one refill each (four of 37 transitions in 300 rows of 14-row
    episodes at refill_fraction=0.25), or with the whole store at once when it fits."""
    with EpisodeStore.create(tmp_path / "coded", OBS, ACT, chunk_rows=64) as store:
        for i in range(120):
            store.append_episode(coded(i))
    store = EpisodeStore.open(tmp_path / "coded")
    for seed in range(5):
        with WorkingSetSampler(store, 300 * 86, 8, reward_fn=sparse_reward, seed=seed, background=False,
                               refill_fraction=0.25) as s:
            s.sample()
            assert s.refills == 4 and s.resident_bytes <= s.nbytes
            assert s.episode_shares.sum() == pytest.approx(1.0)
            assert np.isclose(s.episode_shares * 4 * 37, np.rint(s.episode_shares * 4 * 37)).all()  # covered steps
        with WorkingSetSampler(long_episodes, 400 * 86, 8, reward_fn=sparse_reward, seed=seed, background=False,
                               refill_fraction=0.1) as s:
            s.sample()
            assert sorted(s.episode_ids.tolist()) == list(range(6)) and s.refills == 1
            np.testing.assert_allclose(s.episode_shares, 1 / 6)
            assert s.refill() == 0  # the whole store is in the set: nothing to load
    store.close()


def test_a_closed_sampler_says_so(long_episodes):
    s = WorkingSetSampler(long_episodes, 130 * 86, 8, reward_fn=sparse_reward, seed=0, refill_interval=0.0)
    s.sample()
    s.close()
    assert s._refiller is None and s.nbytes == 0 and not len(s.episode_ids)
    with pytest.raises(StoreError, match="sampler is closed"):
        s.sample()
    with pytest.raises(StoreError, match="sampler is closed"):
        s.refill()


def test_budget_bytes_must_be_a_whole_number_of_bytes_the_machine_can_give(long_episodes):
    for bad in ("1000000", 1e6, True, None):
        with pytest.raises(TypeError, match="budget_bytes must be an int"):
            WorkingSetSampler(long_episodes, bad, reward_fn=sparse_reward)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="budget_bytes must be >= 1"):
            WorkingSetSampler(long_episodes, bad, reward_fn=sparse_reward)
    budget = 1 << 60
    with pytest.raises(MemoryError, match=f"budget_bytes={budget}.* {budget // 86 * 86} bytes"):
        WorkingSetSampler(long_episodes, budget, reward_fn=sparse_reward)
    assert WorkingSetSampler(long_episodes, np.int64(130 * 86), reward_fn=sparse_reward).capacity_rows == 130


def test_its_own_options_and_the_samplers_shared_ones_are_checked_naming_them(long_episodes):
    budget = 130 * 86
    for kw, message in [
        ({"refill_fraction": 0.6}, "refill_fraction must be a real number in (0, 0.5]: got 0.6"),
        ({"refill_fraction": 0}, "refill_fraction must be a real number in (0, 0.5]: got 0"),
        ({"refill_fraction": True}, "refill_fraction must be a real number in (0, 0.5], not a bool: got True"),
        ({"refill_interval": -1}, "refill_interval must be a finite real number >= 0: got -1"),
        ({"refill_interval": float("inf")}, "refill_interval must be a finite real number >= 0: got inf"),
        ({"background": 1}, "background must be True or False, not an int: got 1"),
        ({"batch_size": True}, "batch_size must be an int >= 1, not a bool: got True"),
        ({"n_sampled_goal": 2.5}, "n_sampled_goal must be an int >= 0, not a float: got 2.5"),
        ({"io_threads": -4}, "io_threads must be an int >= 0 or None: got -4"),
    ]:
        with pytest.raises(ValueError) as e:
            WorkingSetSampler(long_episodes, budget, reward_fn=sparse_reward, **kw)
        assert str(e.value) == message
    with WorkingSetSampler(long_episodes, np.int64(budget), np.int32(8), reward_fn=sparse_reward, background=False,
                           refill_fraction=np.float32(0.25), refill_interval=np.int64(0)) as s:
        assert s.batch_size == 8 and s.refill_fraction == 0.25 and s.sample().actions.shape == (8, 4)
        with pytest.raises(ValueError, match=r"^batch_size must be an int >= 1, not a float: got 2.5$"):
            s.sample(2.5)


def test_a_ring_that_evicts_everything_a_refill_reads_is_named_as_the_cause(tmp_path):
    """The set stays empty only when a ring writer evicts each episode a refill reads before the read ends: here
    the sampler's view is older than the ring's whole content."""
    with EpisodeStore.create(tmp_path / "s", OBS, ACT, capacity=60, chunk_rows=16, commit_interval=0) as writer:
        for i in range(8):
            writer.append_episode(coded(i % 2))
        store = EpisodeStore.open(tmp_path / "s")
        s = WorkingSetSampler(store, 40 * 86, 8, reward_fn=sparse_reward, background=False, refresh_interval=1e9)
        with store, s:
            s.refresh()
            for i in range(8):
                writer.append_episode(coded(i % 2))
            with pytest.raises(StoreError, match="kept no episode: the ring writer evicted"):
                s.sample()


def test_a_forked_child_samples_a_set_whose_refill_thread_held_its_locks_at_the_fork(coded_store):
    """The background refill thread (or a batch) of the parent holds the set's locks at the fork: in the child that
    thread is gone and its locks stayed held, so the child's sample() and close() waited forever. The child loads
    the set anew, samples the store's rows and closes; the parent goes on."""
    import threading

    from tests.conftest import in_forked_child

    store, eps = coded_store
    with WorkingSetSampler(store, 300 * 86, 64, reward_fn=sparse_reward, seed=1, refill_interval=0) as s:
        assert_rows_are_the_stores(s.sample(), eps)  # the refill thread runs
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with s._refill_lock, s._lock:
                held.set()
                release.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(60)

        def child() -> bool:
            for _ in range(5):
                assert_rows_are_the_stores(s.sample(), eps)
            s.close()
            return True

        try:
            assert in_forked_child(child) == 0
        finally:
            release.set()
            holder.join()
        assert_rows_are_the_stores(s.sample(), eps)
