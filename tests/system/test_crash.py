"""Crash safety: kill -9 of a writer at any moment loses at most uncommitted episodes; readers never see torn ones."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from her_store import EpisodeStore
from her_store.errors import EpisodeNotFoundError, StoreError
from tests.conftest import ROOT, assert_episode_equal
from tests.crash_writer import episode_for

WRITER = os.path.join(ROOT, "tests", "crash_writer.py")


def _spawn(path: str, capacity: int, *kill: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, WRITER, path, str(capacity), *kill],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _check_recovered(path: str, committed: int) -> int:
    """Reopen for append after a kill: every live episode is intact and everything reported committed is there."""
    with EpisodeStore.open(path, mode="a") as store:
        first, end = store.first_episode, store.end_episode
        assert end >= committed, f"lost committed episodes: end {end} < committed {committed}"
        for i in range(first, end):
            assert_episode_equal(store.episode(i), episode_for(i))
        table = store.episodes
        assert store.num_transitions == int(table["length"].sum())
        if store.capacity:
            assert store.num_transitions <= store.capacity
        # appending continues after a crash
        assert store.append_episode(episode_for(end)) == end
    return end + 1


def _last_committed(out: str) -> int:
    """The last complete "committed N" line (a killed writer may leave its last line half printed)."""
    complete = out.split("\n")[:-1]
    lines = [ln.split() for ln in complete if ln.startswith("committed ")]
    return int(lines[-1][1]) if lines else 0


# A reader checks CHECKED distinct committed episodes while the writer process commits past WRITTEN (a ring of 300
# rows, about 20 rows an episode, wraps many times over meanwhile); a sampler checks BATCHES batches.
CHECKED, WRITTEN, BATCHES = 60, 200, 20
# Only a writer that hangs keeps a test waiting this long for what it counts: a slow machine never does.
PATIENCE_S = 300.0


def _beside(proc: subprocess.Popen) -> Iterator[None]:
    """Rounds of a loop beside the writer process, which must still run in each; after PATIENCE_S the test fails."""
    deadline = time.monotonic() + PATIENCE_S
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the writer process ended ({proc.returncode}): {proc.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, f"the writer made too little progress in {PATIENCE_S:g} s"
        yield


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [0, 400])
def test_kill_9_at_random_moments(tmp_path, capacity):
    path = str(tmp_path / "store")
    rng = np.random.default_rng(capacity)
    committed = 0
    for _ in range(6):
        proc = _spawn(path, capacity)
        assert proc.stdout.readline().startswith("start")
        time.sleep(float(rng.uniform(0.02, 0.4)))
        proc.kill()
        out, err = proc.communicate()
        assert proc.returncode == -9, err
        committed = max(committed, _last_committed(out))
        committed = _check_recovered(path, committed)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [0, 400])
@pytest.mark.parametrize("kill_on", ["data", "index", "commit"])
def test_kill_9_inside_the_commit_protocol(tmp_path, capacity, kill_on):
    """Die at chosen points: half-way through data rows, during index rows, before a commit record is replaced."""
    path = str(tmp_path / "store")
    committed = 0
    for at in (2, 9, 23, 40, 61):
        proc = _spawn(path, capacity, kill_on, str(at))
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == -9, err
        committed = max(committed, _last_committed(out))
        committed = _check_recovered(path, committed)


@pytest.mark.slow
@pytest.mark.parametrize("kill_on", ["shard", "rename"])
def test_kill_9_while_an_image_shard_is_replaced(tmp_path, kill_on):
    """Die half-way through a shard's temp file, or with it whole but not renamed: the shard keeps every committed
    row, and the resumed writer appends into the partly filled tail shard."""
    path = str(tmp_path / "store")
    EpisodeStore.create(path, *episode_space(), info_keys=["is_success"], chunk_rows=64).close()
    committed, tails = 0, []
    for at in (2, 7):
        proc = _spawn(path, 0, kill_on, str(at))
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == -9, err
        with EpisodeStore.open(path) as store:
            spec = next(a for a in store.layout.arrays if a.sharded)
            tails.append(store.commit_record.write_row % spec.chunk_rows)
        committed = max(committed, _last_committed(out))
        committed = _check_recovered(path, committed)
    assert any(tails), f"no resume appended into a partly filled shard: rows in the tail shard {tails}"
    with EpisodeStore.open(path) as store:
        assert store.end_episode == committed
        for i in range(committed):
            assert_episode_equal(store.episode(i), episode_for(i))


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [0, 300])
def test_concurrent_reader_never_sees_a_torn_or_uncommitted_episode(tmp_path, capacity):
    path = str(tmp_path / "store")
    EpisodeStore.create(
        path, *episode_space(), capacity=capacity or None, info_keys=["is_success"], chunk_rows=64
    ).close()
    proc = _spawn(path, capacity)
    assert proc.stdout.readline().startswith("start")
    checked: set[int] = set()
    evicted = seen_end = 0
    try:
        with EpisodeStore.open(path) as reader:
            for _ in _beside(proc):
                if len(checked) >= CHECKED and seen_end >= WRITTEN:
                    break
                reader.refresh()
                assert reader.end_episode >= seen_end
                seen_end = reader.end_episode
                for i in range(max(reader.first_episode, seen_end - 5), seen_end):
                    try:
                        assert_episode_equal(reader.episode(i), episode_for(i))
                        checked.add(i)
                    except EpisodeNotFoundError:
                        evicted += 1  # overwritten by the ring while we read: refused, never returned torn
            if capacity:  # the ring evicted episodes this reader had checked
                reader.refresh()
                assert reader.first_episode > min(checked), (reader.first_episode, min(checked), evicted)
    finally:
        proc.kill()
        proc.communicate()


def episode_space():
    from tests.crash_writer import ACT, OBS

    return OBS, ACT


def test_sampler_in_a_reader_process_never_returns_overwritten_rows(tmp_path):
    """A ring writer in another process evicts and overwrites episodes while this process samples them."""
    from her_store import HerSampler

    path = str(tmp_path / "store")
    EpisodeStore.create(path, *episode_space(), capacity=300, info_keys=["is_success"], chunk_rows=64).close()
    proc = _spawn(path, 300)
    assert proc.stdout.readline().startswith("start")
    batches, first_ids = 0, None
    try:
        with EpisodeStore.open(path) as reader:
            sampler = HerSampler(reader, 256, n_sampled_goal=0, seed=0, refresh_interval=0)
            for _ in _beside(proc):
                if batches >= BATCHES and first_ids.max() < reader.first_episode:  # (refreshed by each sample)
                    break  # the ring has evicted every episode of the first batch since
                try:
                    b = sampler.sample()
                except StoreError as e:  # only "nothing committed yet" is acceptable
                    assert "no committed episode" in str(e)
                    continue
                ids, t = b.episode_ids.numpy(), b.steps.numpy()
                for i in range(0, 256, 8):
                    ep = episode_for(int(ids[i]))
                    np.testing.assert_array_equal(b.observations["observation"][i].numpy(), ep["observation"][t[i]])
                    np.testing.assert_array_equal(
                        b.next_observations["observation"][i].numpy(), ep["observation"][t[i] + 1]
                    )
                    np.testing.assert_array_equal(b.actions[i].numpy(), ep["action"][t[i]])
                batches += 1
                first_ids = ids if first_ids is None else first_ids
    finally:
        proc.kill()
        proc.communicate()
