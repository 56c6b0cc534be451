"""Sharded datasets: many writer processes, one shard each, under one root; the read view over every shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore, GoalMixture, MixtureSampler, open_dataset, open_store
from her_store.datasets.view import ShardedView
from her_store.errors import (
    CorruptStoreError,
    EpisodeNotFoundError,
    FormatVersionError,
    NotAStoreError,
    ReadOnlyStoreError,
    SchemaMismatchError,
    StoreError,
    StoreExistsError,
    StoreLockedError,
)
from her_store.format.keys import MARKER_KEY
from her_store.format.layout import INDEX_COLUMNS
from her_store.format.schema import Schema
from her_store.storage import open_backend
from her_store.store.following import CommitFollower
from tests.conftest import ROOT, assert_episode_equal, fetch_spaces, make_episode
from tests.crash_writer import ACT, OBS, episode_for
from tests.http_server import serving
from tests.sampling.test_sampler import _chi2, _chi2_crit, coded_episode, sparse_reward

INFO = ["is_success"]


def shard_episode(shard: str, i: int) -> dict:
    """Episode ``i`` of shard ``actor-<k>``: seed-determined, so any process can check it bit for bit."""
    return episode_for(1000 * int(shard.rsplit("-", 1)[1]) + i)


def writer_main(root: str, shard: str, count: int, options: str) -> None:
    """A writer process: appends episodes to its shard, committing every second one, until ``count`` (0: until
    killed); prints ``committed N`` after each commit."""
    store = open_store(
        root,
        OBS,
        ACT,
        shard=shard,
        info_keys=INFO,
        chunk_rows=64,
        commit_interval=3600,
        storage_options=json.loads(options) or None,
    )
    i = store.end_episode
    while count == 0 or i < count:
        assert store.append_episode(shard_episode(shard, i)) == i
        i += 1
        if i % 2 == 0 or i == count:
            store.flush()
            print("committed", i, flush=True)
    store.close()


def _spawn(root: str, shard: str, count: int, options: dict | None) -> subprocess.Popen:
    code = (
        "import sys; from tests.datasets.test_sharded import writer_main; "
        "writer_main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, root, shard, str(count), json.dumps(options or {})],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _check_shard(view: ShardedView, shard: str) -> int:
    """Every committed episode of one shard reads back bit for bit; returns its end id."""
    store = view.stores[view.shards.index(shard)]
    for i in range(store.first_episode, store.end_episode):
        assert_episode_equal(view.episode(shard, i), shard_episode(shard, i))
    return store.end_episode


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    """A dataset root on local disk or on the loopback S3 server: (url, storage_options)."""
    if request.param == "local":
        return str(tmp_path / "dataset"), None
    url, opts = request.getfixturevalue("s3_url")
    return url.rsplit("/", 1)[0] + "/dataset", opts


@pytest.mark.slow
def test_writer_processes_append_to_their_shards_and_a_kill_9_loses_only_its_own(tmp_path):
    """Three writer processes append to three shards of one root at once while a view reads them; one is killed by
    SIGKILL. The others finish untouched, every committed episode of every shard reads back bit for bit, and the
    killed shard resumes after its last commit. (tests/test_many_writers.py does the same on S3 with four writers and
    a sampling learner; tests/test_s3.py takes over a dead process's lease.)"""
    url, opts = str(tmp_path / "dataset"), None
    procs = {name: _spawn(url, name, count, opts) for name, count in (("actor-0", 3), ("actor-1", 3), ("actor-2", 0))}
    killed = procs["actor-2"]
    view, checks = None, 0
    try:
        lines = iter(killed.stdout.readline, "")
        committed = next(int(ln.split()[1]) for ln in lines if ln.startswith("committed"))
        killed.kill()  # as soon as it has committed once: the others are still starting or writing
        out, err = killed.communicate(timeout=120)
        assert killed.returncode == -9, err
        committed = max([committed] + [int(ln.split()[1]) for ln in out.split("\n")[:-1] if ln.startswith("committed")])
        while procs["actor-0"].poll() is None or procs["actor-1"].poll() is None or view is None:
            if view is None:
                view = open_dataset(url, storage_options=opts)
            if opts:  # the S3 server shares this process: read once the writers are done
                time.sleep(0.1)
                continue
            view.refresh()
            for shard, store in zip(view.shards, view.stores):  # while they write: never a torn episode
                if store.num_episodes:
                    last = store.end_episode - 1
                    assert_episode_equal(view.episode(shard, last), shard_episode(shard, last))
                    checks += 1
        for name in ("actor-0", "actor-1"):
            out, err = procs[name].communicate(timeout=120)
            assert procs[name].returncode == 0, err  # the kill of another writer went unnoticed
            assert out.split()[-1] == "3", out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert view is not None and (checks > 0 or opts)
    view.refresh()
    assert sorted(view.shards) == ["actor-0", "actor-1", "actor-2"]
    assert _check_shard(view, "actor-0") == _check_shard(view, "actor-1") == 3
    end = _check_shard(view, "actor-2")
    assert end >= committed >= 1
    assert view.num_episodes == 6 + end
    assert view.num_transitions == sum(
        len(shard_episode(s, i)["action"])
        for s, n in (("actor-0", 3), ("actor-1", 3), ("actor-2", end))
        for i in range(n)
    )
    with open_store(url, shard="actor-2", storage_options=opts, commit_interval=0) as store:  # spaces from the root
        assert store.end_episode == end
        assert store.append_episode(shard_episode("actor-2", end)) == end
    assert view.refresh() == 1
    assert _check_shard(view, "actor-2") == end + 1
    view.close()


@pytest.mark.slow
def test_the_root_marker_is_created_once(root):
    """Create-if-absent, locally and on S3: the first write stays, a second one writes nothing."""
    url, opts = root
    loc = open_backend(url, opts)
    assert loc.create_once(MARKER_KEY, b"first") is True
    assert loc.create_once(MARKER_KEY, b"second") is False
    assert loc.read_bytes(MARKER_KEY) == b"first"
    if "://" not in url:
        assert os.listdir(url) == [MARKER_KEY]  # no temp file left beside it


def test_where_a_sharded_dataset_cannot_be_written_or_listed(tmp_path):
    root = str(tmp_path / "dataset")
    with open_store(root, OBS, ACT, shard="actor-0", info_keys=INFO) as store:
        store.append_episode(shard_episode("actor-0", 0))
    with pytest.raises(NotAStoreError, match="pass observation_space and action_space"):
        open_store(str(tmp_path / "nothing"), shard="actor-0")  # no dataset to take spaces from
    assert not os.path.exists(tmp_path / "nothing")
    with pytest.raises(StoreError, match="open_dataset"):  # a sharded root is written through a shard only
        open_store(root, commit_interval=0)
    with pytest.raises(
        NotAStoreError, match=r"sharded dataset's root: her_store.open_dataset\(root\) reads every shard"
    ):
        EpisodeStore.open(root)  # the root of a dataset is not itself a store: say what it is
    packed = tmp_path / "packed.zip"
    packed.write_bytes(b"PK\x05\x06" + bytes(18))  # an empty zip archive
    with pytest.raises(ReadOnlyStoreError, match="packed"):
        open_store(str(packed), OBS, ACT, shard="actor-0")
    with serving(str(tmp_path)) as base:
        with pytest.raises(ReadOnlyStoreError, match="HTTP"):
            open_store(f"{base}/dataset", OBS, ACT, shard="actor-0", info_keys=INFO)
        with pytest.raises(StoreError, match="listing"):
            open_dataset(f"{base}/dataset")
        with EpisodeStore.open(f"{base}/dataset/shards/actor-0") as shard:  # one shard reads as any store
            assert_episode_equal(shard.episode(0), shard_episode("actor-0", 0))


def _make_unfinished_create(path: str) -> None:
    """What a shard's creator killed before its first commit record leaves."""
    EpisodeStore.create(path, OBS, ACT, info_keys=INFO).close()
    os.unlink(os.path.join(path, "commit.json"))


def test_refresh_finds_new_episodes_and_new_shards(tmp_path):
    root = str(tmp_path / "dataset")
    a = open_store(root, OBS, ACT, shard="actor-0", info_keys=INFO, commit_interval=0)
    with open_dataset(root) as empty:  # a shard with no episode yet: in the view, with nothing in it
        assert empty.shards == ("actor-0",) and empty.num_episodes == 0 and len(empty) == 0
        assert {k: (len(v), v.dtype) for k, v in empty.episodes.items()} == {
            **{k: (0, dt) for k, dt in INDEX_COLUMNS.items()},
            "shard": (0, np.int32),
        }
    a.append_episode(shard_episode("actor-0", 0))
    view = open_dataset(root)
    assert isinstance(view, ShardedView) and view.shards == ("actor-0",) and view.num_episodes == 1
    assert view.observation_space == OBS and view.info_keys == ("is_success",)

    _make_unfinished_create(os.path.join(root, "shards", "actor-9"))
    b = open_store(root, shard="actor-1", commit_interval=0)  # spaces and info keys from the dataset
    a.append_episode(shard_episode("actor-0", 1))
    b.append_episode(shard_episode("actor-1", 0))
    assert view.refresh() == 2
    assert view.shards == ("actor-0", "actor-1")  # actor-9 has no commit record yet: left out
    with open_store(root, OBS, ACT, shard="actor-9") as late:  # the unfinished create is made anew
        late.append_episode(shard_episode("actor-9", 0))
    assert view.refresh() == 1
    assert view.shards == ("actor-0", "actor-1", "actor-9")
    earlier = open_store(root, shard="actor-5", commit_interval=0)  # sorts before actor-9, found after it
    assert view.refresh() == 0
    assert view.shards == ("actor-0", "actor-1", "actor-9", "actor-5")  # found later, listed later
    assert view.num_episodes == 4 and view.stores[3].num_episodes == 0

    table = view.episodes
    assert table["shard"].tolist() == [0, 0, 1, 2] and table["episode_id"].tolist() == [0, 1, 0, 0]
    assert table["length"].tolist() == [
        len(shard_episode(view.shards[s], i)["action"]) for s, i in zip(table["shard"], table["episode_id"])
    ]
    assert int(table["length"].sum()) == len(view)
    assert_episode_equal(view.episode("actor-1", 0), shard_episode("actor-1", 0))
    assert_episode_equal(view.episode(2, 0), shard_episode("actor-9", 0))  # a shard's position, as in the table
    for shard, i in (("actor-7", 0), (4, 0), (True, 0), ("actor-0", 2)):
        with pytest.raises(EpisodeNotFoundError):
            view.episode(shard, i)
    with pytest.raises(StoreLockedError):  # one writer per shard, as per store
        open_store(root, shard="actor-0")
    for store in (a, b, earlier):
        store.close()
    view.close()
    with pytest.raises(StoreError, match="closed"):
        _ = view.num_episodes


def test_spaces_must_match_the_dataset(tmp_path):
    root = str(tmp_path / "dataset")
    open_store(root, OBS, ACT, shard="actor-0", info_keys=INFO).close()
    other_obs, other_act = fetch_spaces(obs_dim=11)
    for obs, act, info in ((other_obs, ACT, INFO), (OBS, spaces.Box(-1, 1, (5,), np.float32), INFO), (OBS, ACT, [])):
        with pytest.raises(SchemaMismatchError, match=MARKER_KEY):
            open_store(root, obs, act, shard="actor-1", info_keys=info)
    assert os.listdir(os.path.join(root, "shards")) == ["actor-0"]  # nothing made for the refused writers
    with pytest.raises(StoreError, match="shard="):  # a sharded root is written through shards only
        open_store(root, OBS, ACT, info_keys=INFO)
    assert sorted(os.listdir(root)) == [MARKER_KEY, "shards"]

    EpisodeStore.create(os.path.join(root, "shards", "actor-2"), other_obs, other_act).close()  # not by her_store
    with pytest.raises(SchemaMismatchError):
        open_store(root, shard="actor-2")
    with pytest.raises(CorruptStoreError, match="shard 'actor-2' does not hold the dataset's spaces"):
        open_dataset(root)


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", "a\\b", ".hidden", "a.b", "-a", "a b", "é", "a\0", "x" * 129, 7, b"a"]
)
def test_bad_shard_names_are_refused(tmp_path, name):
    root = str(tmp_path / "dataset")
    with pytest.raises(ValueError, match="shard name .* is not allowed"):
        open_store(root, OBS, ACT, shard=name)
    assert not os.path.exists(root)


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            full = os.path.join(d, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def test_a_plain_store_is_unchanged(tmp_path):
    path = str(tmp_path / "plain")
    with open_store(path, OBS, ACT, info_keys=INFO) as store:
        store.append_episode(shard_episode("actor-0", 0))
    before = _files(path)
    with open_store(path) as store:
        assert type(store) is EpisodeStore and store.mode == "a" and store.num_episodes == 1
    with pytest.raises(StoreExistsError, match="plain store"):
        open_store(path, OBS, ACT, shard="actor-0", info_keys=INFO)
    after = _files(path)
    assert after.keys() == before.keys()
    assert {k: v for k, v in after.items() if k != "writer.lock"} == {
        k: v for k, v in before.items() if k != "writer.lock"
    }
    with pytest.raises(NotAStoreError, match="pass observation_space"):
        open_store(str(tmp_path / "nothing"))


def _marker(**change) -> bytes:
    doc = {"format": "her_store.sharded", "version": 1, "schema": Schema(OBS, ACT, INFO).to_json(), "created_at": 1.0}
    doc.update(change)
    return json.dumps({k: v for k, v in doc.items() if v != "drop"}).encode()


HOSTILE = {
    "not json": (b"{format", CorruptStoreError, "not JSON"),
    "not utf-8": (b"\xff\xfe\x00", CorruptStoreError, "not JSON"),
    "nested past the parser": (b"[" * 200_000 + b"]" * 200_000, CorruptStoreError, "not JSON"),
    "a list": (b"[1, 2]", CorruptStoreError, "expected an object with keys"),
    "a key missing": (_marker(created_at="drop"), CorruptStoreError, "expected an object with keys"),
    "a key more": (_marker(extra=1), CorruptStoreError, "expected an object with keys"),
    "another format": (_marker(format="her_store.npz"), CorruptStoreError, "format is"),
    "version as text": (_marker(version="1"), CorruptStoreError, "version is '1'"),
    "version a bool": (_marker(version=True), CorruptStoreError, "version is True"),
    "a newer version": (_marker(version=2), FormatVersionError, "upgrade"),
    "created_at text": (_marker(created_at="now"), CorruptStoreError, "created_at"),
    "created_at infinite": (_marker(created_at=float("inf")), CorruptStoreError, "created_at"),
    "schema of wrong types": (_marker(schema={"observation_space": 5, "info_spaces": []}), CorruptStoreError, "schema"),
    "a space naming code": (
        _marker(schema={**Schema(OBS, ACT, INFO).to_json(), "action_space": {"type": "her_store_evil:Space"}}),
        CorruptStoreError,
        "schema is invalid",
    ),
}


@pytest.mark.parametrize("case", [*HOSTILE, "huge", "a directory", "a symbolic link"])
def test_a_hostile_root_marker_is_refused(tmp_path, case):
    """A damaged or crafted root marker is a clear error, for the view and for writers; nothing is written, nothing
    it names is imported."""
    root = tmp_path / "dataset"
    root.mkdir()
    marker = root / MARKER_KEY
    expected, match = (
        CorruptStoreError,
        {"huge": "more than", "a directory": "not a regular file"}.get(case, "symbolic"),
    )
    if case in HOSTILE:
        raw, expected, match = HOSTILE[case]
        marker.write_bytes(raw)
    elif case == "huge":
        with open(marker, "wb") as f:
            f.truncate((64 << 20) + 1)  # sparse: never read
    elif case == "a directory":
        marker.mkdir()
    else:
        (tmp_path / "elsewhere.json").write_bytes(_marker())
        marker.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(expected, match=match):
        open_dataset(str(root))
    with pytest.raises(expected, match=match):
        open_store(str(root), OBS, ACT, shard="actor-0", info_keys=INFO)
    assert sorted(p.name for p in root.iterdir()) == [MARKER_KEY]
    assert "her_store_evil" not in sys.modules


def test_view_sampler_draws_uniformly_over_every_shard(tmp_path):
    """The view's sampler is a MixtureSampler over the shards weighted by transitions: each shard's share of a batch
    is its share of the committed transitions, every transition is drawn, a row's source and episode id name the
    episode it was read from, and shards created later join at refresh."""
    obs, act = fetch_spaces()
    root = str(tmp_path / "dataset")
    lengths = {"actor-0": 3, "actor-1": 9}  # episodes of 10 steps: a quarter and three quarters of the transitions
    for shard, n in lengths.items():
        with open_store(root, obs, act, shard=shard) as store:
            for i in range(n):
                store.append_episode(make_episode(obs, act, 10, seed=100 * int(shard[-1]) + i))
    view = open_dataset(root)
    sampler = MixtureSampler(
        view,
        weights="transitions",
        batch_size=4000,
        n_sampled_goal=0,
        seed=0,
        reward_fn=lambda a, d, info: -np.ones(len(a)),
    )
    batch = sampler.sample()
    source, ids, steps = (batch.source.numpy(), batch.episode_ids.numpy(), batch.steps.numpy())
    share = np.bincount(source, minlength=2) / len(source)
    assert abs(share[0] - 0.25) < 5 * np.sqrt(0.25 * 0.75 / len(source)), share
    assert len(set(zip(source.tolist(), ids.tolist(), steps.tolist()))) == 120  # every transition is drawn
    for k in range(0, len(source), 97):
        want = make_episode(obs, act, 10, seed=100 * source[k] + ids[k])
        np.testing.assert_array_equal(batch.observations["observation"][k].numpy(), want["observation"][steps[k]])
        np.testing.assert_array_equal(batch.actions[k].numpy(), want["action"][steps[k]])

    with open_store(root, obs, act, shard="actor-2") as store:
        for i in range(12):
            store.append_episode(make_episode(obs, act, 10, seed=200 + i))
    sampler.refresh()
    share = np.bincount(sampler.sample().source.numpy(), minlength=3) / 4000
    assert abs(share[2] - 0.5) < 5 * np.sqrt(0.25 / 4000), share
    sampler.close()
    view.close()


def _coded_shards(root: str, counts: tuple[int, ...], **kw) -> list[np.ndarray]:
    """Shard ``actor-k`` holds ``counts[k]`` episodes; episode i of shard k has ``3 + (i * (k + 2)) % 9`` steps and
    achieved goal (1000 k + i, r, 0) at row r. Returns each shard's episode lengths."""
    obs, act = fetch_spaces()
    lengths = []
    for k, n in enumerate(counts):
        lengths.append(3 + (np.arange(n) * (k + 2)) % 9)
        with open_store(root, obs, act, shard=f"actor-{k}", **kw) as store:
            for i, T in enumerate(lengths[k]):
                store.append_episode(coded_episode(obs, act, 1000 * k + i, T=int(T), seed=i))
    return lengths


@pytest.mark.slow
@pytest.mark.parametrize("counts", [(40, 40), (50, 10)], ids=["equal", "unequal"])
@pytest.mark.parametrize("strategy", ["random", GoalMixture(0.2, 0.3, 0.5)], ids=["random", "mixture"])
def test_random_goals_of_a_view_come_from_every_shard_by_its_share_of_transitions(tmp_path, counts, strategy):
    """A sharded dataset is one dataset: a random goal (``random``, a GoalMixture's random share) is the next achieved
    goal of a transition drawn uniformly from every shard's committed transitions, whichever shard the row came from.
    Over 204,800 rows, the goals from the row's other shard number ``sum p_random * (1 - share of the row's shard)``
    within 5 standard deviations, and those goals fall on the other shard's episodes in proportion to their lengths
    (chi-square, p = 0.001); every goal is the achieved goal of a real (shard, episode, step), and every relabelled
    reward is recomputed for it."""
    root = str(tmp_path / "dataset")
    lengths = _coded_shards(root, counts)
    share = np.array([ls.sum() for ls in lengths]) / sum(ls.sum() for ls in lengths)
    p_random = 1.0 if strategy == "random" else strategy.p_random
    foreign, expected, variance = 0, 0.0, 0.0
    cells = [np.zeros(n, np.int64) for n in counts]  # goals each shard's episodes gave to rows of the other shard
    with open_dataset(root) as view, MixtureSampler(
        view, weights="transitions", batch_size=4096, goal_selection_strategy=strategy, reward_fn=sparse_reward, seed=11
    ) as sampler:
        for _ in range(50):
            b = sampler.sample()
            her = b.is_relabeled.numpy()
            goal = b.observations["desired_goal"].numpy()[her]
            reached = b.next_observations["achieved_goal"].numpy()[her]
            np.testing.assert_array_equal(b.rewards.numpy()[her, 0], sparse_reward(reached, goal, None))
            np.testing.assert_array_equal(b.next_observations["desired_goal"].numpy()[her], goal)
            shard, i, r = goal[:, 0].astype(np.int64) // 1000, goal[:, 0].astype(np.int64) % 1000, goal[:, 1]
            assert (goal[:, 0] == 1000 * shard + i).all() and (goal[:, 2] == 0).all()
            assert np.isin(shard, [0, 1]).all() and (i < np.array(counts)[shard]).all()
            T = np.array([lengths[s][e] for s, e in zip(shard, i)])
            assert ((1 <= r) & (r <= T)).all() and (r == np.round(r)).all()  # row j + 1 of a step j of the episode
            own = b.source.numpy()[her]
            other = shard != own
            q = p_random * (1 - share[own])
            foreign += int(other.sum())
            expected += float(q.sum())
            variance += float((q * (1 - q)).sum())
            for s in (0, 1):
                cells[s] += np.bincount(i[other & (shard == s)], minlength=counts[s])
    assert abs(foreign - expected) < 5 * np.sqrt(variance), (foreign, expected)
    for s in (0, 1):
        want = cells[s].sum() * lengths[s] / lengths[s].sum()
        assert _chi2(cells[s], want) < _chi2_crit(counts[s] - 1)


def test_random_goals_from_a_ring_shard_are_never_of_an_episode_its_writer_evicted(tmp_path):
    """A ring shard's writer evicts while another shard's rows read random goals from it: goals of episodes evicted
    by the time the read ends (whose rows may have been overwritten under it) are drawn again among the live ones,
    from a fresh view of the shard when the writer evicted all of the one sampled."""
    obs, act = fetch_spaces()
    root = str(tmp_path / "dataset")
    _coded_shards(root, (10,))
    with open_store(root, obs, act, shard="actor-1", capacity=120, chunk_rows=16, commit_interval=0) as writer:

        def append() -> None:  # episode i of the ring shard: achieved goal (1000 + i, r, 0)
            i = writer.end_episode
            writer.append_episode(coded_episode(obs, act, 1000 + i, T=5, seed=i))

        for _ in range(30):  # 20 episodes of 6 rows fill the ring: it has wrapped
            append()
        with open_dataset(root) as view, MixtureSampler(
            view,
            weights="transitions",
            batch_size=512,
            goal_selection_strategy="random",
            reward_fn=sparse_reward,
            seed=3,
            refresh_interval=1e9,
        ) as sampler:
            ring = sampler.samplers[1]
            gather, evict_to = ring.reader.gather, []

            def evicting(path, rows, out=None):  # after the first read of a batch, the writer evicts episodes it read
                got = gather(path, rows, out=out)
                if evict_to:
                    v = ring.view
                    hit = (rows[:, None] >= v.start_rows) & (rows[:, None] <= v.start_rows + v.lengths)
                    read = v.first + np.flatnonzero(hit.any(axis=0))
                    last = int(np.median(read)) if evict_to.pop() == "some" else v.end - 1
                    while writer.first_episode <= last:
                        append()
                return got

            ring.reader.gather = evicting
            for how in ("some", "all") * 3:
                sampler.refresh()
                evict_to.append(how)
                b = sampler.sample()
                assert not evict_to  # the ring shard was read, first for the random goals of shard 0's rows
                her = b.is_relabeled.numpy()
                goal, source = b.observations["desired_goal"].numpy()[her], b.source.numpy()[her]
                from_ring = goal[:, 0] >= 1000
                assert (from_ring & (source == 0)).any()
                assert (goal[from_ring, 0] - 1000 >= writer.first_episode).all()
                assert (goal[from_ring, 1] >= 1).all() and (goal[from_ring, 1] <= 5).all()


def test_a_view_samplers_refresh_reads_each_shards_commit_record_once(tmp_path, monkeypatch):
    """The view's refresh refreshes every shard; the sampler over it then takes each shard's new view without reading
    its commit record again (one read per shard per refresh: on object storage, one GET each)."""
    root = str(tmp_path / "dataset")
    for k in range(3):
        with open_store(root, OBS, ACT, shard=f"actor-{k}", info_keys=INFO) as store:
            store.append_episode(shard_episode(f"actor-{k}", 0))
    reads: list[str] = []
    real = CommitFollower.read_commit

    def counted(self):
        reads.append(self.backend.url)
        return real(self)

    with open_dataset(root) as view, MixtureSampler(
        view, weights="transitions", batch_size=8, n_sampled_goal=0, seed=0
    ) as sampler:
        monkeypatch.setattr(CommitFollower, "read_commit", counted)
        with open_store(root, OBS, ACT, shard="actor-1", info_keys=INFO) as store:
            store.append_episode(shard_episode("actor-1", 1))
        reads.clear()
        assert sampler.refresh().tolist() == [len(shard_episode("actor-0", 0)["action"]),
                                              sum(len(shard_episode("actor-1", i)["action"]) for i in (0, 1)),
                                              len(shard_episode("actor-2", 0)["action"])]
        assert sorted(reads) == sorted(s.url for s in view.stores)  # once each


def test_a_sharded_root_takes_no_plain_store_and_no_links(tmp_path):
    """EpisodeStore.create on a dataset's root is refused (the view would then open an empty plain store); a
    symbolic link in place of ``shards/`` or of a shard's directory is refused to writers and views (a writer would
    write where no view of the dataset reads)."""
    root = str(tmp_path / "dataset")
    with open_store(root, OBS, ACT, shard="actor-0", info_keys=INFO) as store:
        store.append_episode(shard_episode("actor-0", 0))
    with pytest.raises(StoreExistsError, match="sharded dataset's root"):
        EpisodeStore.create(root, OBS, ACT, info_keys=INFO)
    assert isinstance(open_dataset(root), ShardedView)
    other = str(tmp_path / "elsewhere")
    EpisodeStore.create(other, OBS, ACT, info_keys=INFO).close()
    os.symlink(other, os.path.join(root, "shards", "linked"))
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        open_store(root, OBS, ACT, shard="linked", info_keys=INFO)
    os.unlink(os.path.join(root, "shards", "linked"))
    moved = str(tmp_path / "shards-moved")
    os.rename(os.path.join(root, "shards"), moved)
    os.symlink(moved, os.path.join(root, "shards"))
    for opening in (lambda: open_dataset(root), lambda: open_store(root, OBS, ACT, shard="actor-0", info_keys=INFO)):
        with pytest.raises(CorruptStoreError, match="symbolic link"):
            opening()
