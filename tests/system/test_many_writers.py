"""Many writers on object storage: four writer processes, one shard each, and a learner process sampling the read
view, against the S3 server on loopback; one writer is killed by SIGKILL while the others write. And the Ray example
(examples/ray_actors.py), briefly."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from her_store import MixtureSampler, open_dataset, open_store
from her_store.datasets.view import ShardedView
from her_store.interop import read_batches
from tests.conftest import ROOT, assert_episode_equal, fetch_spaces, make_episode

OBS, ACT = fetch_spaces()
SHARDS = ("actor-0", "actor-1", "actor-2", "actor-3")
KILLED = "actor-3"
PATIENCE_S = 300.0  # how long the test waits for what its processes report: only a hang takes this long


def model(shard: str, i: int) -> dict[str, np.ndarray]:
    """Episode ``i`` of shard ``actor-<k>``: a function of (shard, id) only, so any process can check it bit for bit."""
    k = int(shard.rsplit("-", 1)[1])
    return make_episode(OBS, ACT, 3 + (7 * k + i) % 6, seed=1000 * k + i)


def reward(achieved_goal: np.ndarray, desired_goal: np.ndarray, info: object) -> np.ndarray:
    return -(np.linalg.norm(achieved_goal - desired_goal, axis=-1) > 0.05).astype(np.float32)


def _say(fd: int, line: str) -> None:
    os.write(fd, f"{line}\n".encode())  # one write(2): it is in the file once it returns, whatever kills us next


def writer_main(root: str, shard: str, stop: str, options: str, report: str) -> None:
    """A writer process: appends the model's episodes to its shard until the file ``stop`` exists, committing every
    0.5 s. Before each append it reports ``appending <id>``; after each append that committed, ``committed <end>``
    (every id below ``end`` is committed); after its close, ``closed <end>``."""
    fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    store = open_store(root, OBS, ACT, shard=shard, commit_interval=0.5, storage_options=json.loads(options))
    i = committed = store.end_episode
    while not os.path.exists(stop):
        _say(fd, f"appending {i}")
        assert store.append_episode(model(shard, i)) == i
        i += 1
        end = store.snapshot().end
        if end != committed:
            committed = end
            _say(fd, f"committed {end}")
        time.sleep(0.01)  # the time an actor spends stepping its env
    store.close()
    _say(fd, f"closed {i}")


def _read_back(view: ShardedView) -> dict[str, list[int]]:
    """Every committed episode of every shard, checked against its crc32 (none torn) and against the model bit for
    bit; returns each shard's [first, end) ids."""
    ends = {}
    for shard, store in zip(view.shards, view.stores):
        ids, read = np.arange(store.first_episode, store.end_episode), 0
        for batch in read_batches(store, ids, False, "checking"):
            for i, ep in batch.episodes():
                assert_episode_equal(ep, model(shard, i))
                read += 1
        assert read == len(ids), (shard, read, len(ids))
        assert_episode_equal(view.episode(shard, int(ids[-1])), model(shard, int(ids[-1])))  # and one by one
        ends[shard] = [store.first_episode, store.end_episode]
    return ends


def learner_main(root: str, options: str, stop: str, result: str) -> None:
    """A learner process: samples HER batches from the read view (refreshed every second) until ``stop`` exists,
    checking every row against the model and reporting ``<shards seen> <transitions>`` after each batch to
    ``result``.txt (the transitions of the view as of its last refresh);
    then reads back every committed episode of every shard. Writes what it saw to ``result``."""
    fd = os.open(result + ".txt", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    view = open_dataset(root, storage_options=json.loads(options))
    sampler = MixtureSampler(view, weights="transitions", batch_size=64, reward_fn=reward, seed=0)
    while not sampler.refresh().sum():  # until a writer has committed an episode
        time.sleep(0.1)
    seen, rows = set(), 0
    while not os.path.exists(stop):
        b = sampler.sample()
        relabeled = b.is_relabeled.numpy()
        for k, (src, i, t) in enumerate(zip(b.source.tolist(), b.episode_ids.tolist(), b.steps.tolist())):
            shard = view.shards[src]
            ep = model(shard, i)
            seen.add(shard)
            for key in ("observation", "achieved_goal"):
                np.testing.assert_array_equal(b.observations[key][k].numpy(), ep[key][t])
                np.testing.assert_array_equal(b.next_observations[key][k].numpy(), ep[key][t + 1])
            np.testing.assert_array_equal(b.actions[k].numpy(), ep["action"][t])
            goal = b.observations["desired_goal"][k].numpy()
            if relabeled[k]:  # "future": an achieved goal of a later state of the same episode
                assert (ep["achieved_goal"][t + 1 :] == goal).all(axis=1).any(), (shard, i, t)
                assert b.rewards[k].item() == reward(ep["achieved_goal"][t + 1], goal, None)
            else:
                np.testing.assert_array_equal(goal, ep["desired_goal"][t])
                assert b.rewards[k].item() == ep["reward"][t]
        rows += len(b.actions)
        _say(fd, f"{len(seen)} {view.num_transitions}")
        time.sleep(0.05)  # the learner's gradient step
    sampler.close()
    view.refresh()
    ends = _read_back(view)
    view.close()
    with open(result, "w") as f:
        json.dump({"rows": rows, "shards": sorted(seen), "ends": ends}, f)


def _spawn(main: str, errors: str, *args: str) -> subprocess.Popen:
    """A process running ``main(*args)`` of this module, its stderr into the file ``errors``."""
    code = f"import sys; from tests.system.test_many_writers import {main}; {main}(*sys.argv[1:])"
    with open(errors, "w") as err:
        return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def _report(path: str) -> list[tuple[str, int]]:
    """The lines of a writer's or the learner's report, each a word or number and a number."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(w, int(n)) for w, n in (line.split() for line in f)]


def _seed(root: str, opts: dict, tmp_path) -> None:
    """The dataset with its shards created and empty, made once on local disk and uploaded: the writers resume their
    shards (creating shards on S3 at once is test_sharded's; here it would cost most of the test's time)."""
    import s3fs

    local = str(tmp_path / "seed")
    open_store(local, OBS, ACT, shard=SHARDS[0]).close()
    shard = os.path.join(local, "shards", SHARDS[0])
    files = [os.path.join(d, n) for d, _, names in os.walk(shard) for n in names if n != "writer.lock"]
    rel = [os.path.relpath(p, shard) for p in files]
    bucket_root = root.removeprefix("s3://")
    s3fs.S3FileSystem(**opts).put(
        [os.path.join(local, "sharded.json"), *(files * len(SHARDS))],
        [f"{bucket_root}/sharded.json", *(f"{bucket_root}/shards/{s}/{r}" for s in SHARDS for r in rel)],
    )


@pytest.mark.slow
def test_four_writers_and_a_learner_on_s3_and_a_writer_killed(s3_url, tmp_path):
    """Four writer processes append to four shards of one dataset on S3 while a learner process samples the view;
    one writer is killed by SIGKILL once it has committed. The others finish unaware of it (exit 0, every episode
    they appended committed), the killed shard keeps every episode it reported committed and nothing it had not
    begun to append, every committed episode of every shard reads back bit for bit (none torn), and every row
    the learner sampled is the model's row, drawn from every shard."""
    url, opts = s3_url
    root = url.rsplit("/", 1)[0] + "/dataset"
    _seed(root, opts, tmp_path)
    options = json.dumps(opts)
    reports = {s: str(tmp_path / f"{s}.txt") for s in SHARDS}
    stop, done, result = str(tmp_path / "stop"), str(tmp_path / "done"), str(tmp_path / "learner.json")
    errors = {s: str(tmp_path / f"{s}.err") for s in (*SHARDS, "learner")}
    procs = {
        s: _spawn("writer_main", errors[s], root, s, stop + ("-never" if s == KILLED else ""), options, reports[s])
        for s in SHARDS
    }
    procs["learner"] = _spawn("learner_main", errors["learner"], root, options, done, result)

    def learner() -> list[tuple[int, int]]:  # shards drawn from and transitions in view, as of each batch
        return [(int(n), t) for n, t in _report(result + ".txt")]

    def wait_for(what: str, ready) -> None:
        while not ready():
            for name, p in procs.items():
                assert p.returncode is not None or p.poll() is None, f"{what}: {name} exited: {_text(errors[name])}"
            assert time.monotonic() < deadline, f"{what}: not in {PATIENCE_S:g} s"
            time.sleep(0.25)  # this process serves S3: it polls lightly

    try:
        deadline = time.monotonic() + PATIENCE_S
        wait_for("a commit", lambda: any(w == "committed" for w, _ in _report(reports[KILLED])))
        os.kill(procs[KILLED].pid, signal.SIGKILL)
        assert procs[KILLED].wait(PATIENCE_S) == -signal.SIGKILL
        before = len(learner())
        wait_for(  # the learner samples every shard after the kill, and its refreshes follow the others' commits
            "the learner's batches of every shard after the kill, from a view that grew",
            lambda: len(b := learner()) > before and b[-1][0] == len(SHARDS) and b[-1][1] > b[before][1],
        )
        open(stop, "w").close()
        for s in SHARDS[:3]:
            assert procs[s].wait(PATIENCE_S) == 0, _text(errors[s])  # the kill of another writer went unnoticed
        open(done, "w").close()
        assert procs["learner"].wait(PATIENCE_S) == 0, _text(errors["learner"])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    with open(result) as f:
        learned = json.load(f)
    assert learned["shards"] == sorted(SHARDS) and learned["rows"] > 0
    assert sorted(learned["ends"]) == sorted(SHARDS)
    for shard, (first, end) in learned["ends"].items():
        said = _report(reports[shard])
        assert first == 0 and end > 0
        if shard == KILLED:
            committed = max(n for w, n in said if w == "committed")
            began = max(n for w, n in said if w == "appending")
            assert committed <= end <= began + 1  # it lost only episodes not committed
        else:
            assert said[-1] == ("closed", end)  # every episode it appended is committed


@pytest.mark.slow
def test_the_ray_actors_example_runs():
    """examples/ray_actors.py, briefly: two Ray actors on a local cluster each fill a shard while the learner
    samples both; every episode an actor wrote is in the dataset (the example checks it), and the learner's batches
    came from both shards."""
    pytest.importorskip("ray", reason="pip install her_store[ray]")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ray_actors.py"), "--actors", "2", "--seconds", "1",
         "--batch-size", "32"],
        check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    wrote = re.search(r"2 actors wrote ([\d,]+) episodes .*: (\{.*\})", run.stdout)
    sampled = re.search(r"sampled ([\d,]+) batches .* rows per shard (\{.*\})", run.stdout)
    assert wrote and sampled, run.stdout
    per_shard = ast.literal_eval(wrote.group(2))
    assert sorted(per_shard) == ["actor-0", "actor-1"] and min(per_shard.values()) > 0
    assert sum(per_shard.values()) == int(wrote.group(1).replace(",", ""))
    rows = ast.literal_eval(sampled.group(2))
    assert sorted(rows) == ["actor-0", "actor-1"] and min(rows.values()) > 0
