"""Every write the store makes, failing every way (short write, ENOSPC, EIO, kill -9): nothing committed is lost.

After each fault the failed call raised (or the process died); reopening shows every committed episode bit-exact
and in id order; appending the rest again stores each episode exactly once (a call that raised left no trace).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import warnings
from typing import Any

import numpy as np
import pytest

from her_store import EpisodeStore, HerSampler, StoreError, open_store
from tests.conftest import assert_episode_equal
from tests.faults import ACT, CONFIGS, WriteFaults, episode_for, store_options, workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = 3  # episodes committed before the faults begin
MORE = 4  # episodes the faulty run tries to append (two commits)


def _check_and_retry(config: str, path: str, opts: dict | None, at_least: int) -> int:
    """Reopen after a fault: committed episodes intact and in order; appending the missing ones stores each once."""
    total = BASELINE + MORE
    with open_store(path, CONFIGS[config]["obs"], ACT, **store_options(config, opts)) as store:
        first, end = store.first_episode, store.end_episode
        assert end >= at_least, f"committed episodes lost: end {end} < {at_least}"
        for i in range(first, end):
            assert_episode_equal(store.episode(i), episode_for(config, i))
        for i in range(end, total):
            assert store.append_episode(episode_for(config, i)) == i
    with EpisodeStore.open(path, storage_options=opts) as store:
        assert store.end_episode == total
        for i in range(store.first_episode, total):
            assert_episode_equal(store.episode(i), episode_for(config, i))
    return end


def _faulty_run(config: str, path: str, root: str, at: int, mode: str, opts: dict | None = None, **where: Any) -> None:
    with warnings.catch_warnings(record=True) as caught, WriteFaults(root, at, mode, **where):
        warnings.simplefilter("always")
        try:
            workload(config, path, BASELINE, MORE, opts)
        except (OSError, StoreError):
            return
    # only a failure after the commit record was in place (an fsync of its directory) or of the lease's release
    # at close may pass, and it says so
    assert any(isinstance(w.message, RuntimeWarning) for w in caught), f"write {at} failing ({mode}) went unnoticed"


def _count_writes(config: str, path: str, root: str, opts: dict | None = None, **where: Any) -> list[str]:
    """The kinds of the writes a fault-free run makes, in order (write ``at`` is ``kinds[at - 1]``)."""
    with WriteFaults(root, **where) as counter:
        workload(config, path, BASELINE, MORE, opts)
    return counter.kinds


def _baseline(tmp_path, config: str, **where: Any) -> tuple[str, list[str]]:
    """A store holding the baseline episodes, and the kinds of the writes the faulty run makes on a copy of it."""
    base = str(tmp_path / "base")
    workload(config, base, 0, BASELINE)
    probe = str(tmp_path / "probe")
    shutil.copytree(base, probe)
    return base, _count_writes(config, probe, probe, **where)


def _modes(kind: str) -> tuple[str, ...]:
    """A whole-object write (a rename's temp file through zarr, fsync, a PUT) cannot be short: that is ENOSPC."""
    return ("short", "enospc", "eio") if kind == "bytes" else ("enospc", "eio")


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_local_write_failing_every_way(tmp_path, config):
    base, kinds = _baseline(tmp_path, config)
    assert len(kinds) > 10
    # real fsyncs are slow: the fsync'ed variant fails every third write, one mode each, in turn
    fsync = "fsync" in config
    for at, kind in enumerate(kinds, 1):
        modes = _modes(kind)
        if fsync and at % 3:
            continue
        for mode in modes[at // 3 % len(modes) :][:1] if fsync else modes:
            path = str(tmp_path / f"{at}-{mode}")
            shutil.copytree(base, path)
            _faulty_run(config, path, path, at, mode)
            _check_and_retry(config, path, None, BASELINE)
            shutil.rmtree(path)


def _sampled_frames_equal(config: str, path: str, opts: dict | None = None) -> None:
    """Every frame the sampler (LZ4 rows decoded in C) returns is the committed episode's frame at its step."""
    with EpisodeStore.open(path, storage_options=opts) as store, HerSampler(store, 256, n_sampled_goal=0, seed=0) as sampler:
        assert {a.path for a in store.layout.arrays if a.sharded} == {"steps/pixels"}
        _assert_frames(config, sampler)


def _assert_frames(config: str, sampler: HerSampler) -> None:
    b = sampler.sample()
    ids, t = b.episode_ids.numpy(), b.steps.numpy()
    eps = {int(i): episode_for(config, int(i))["pixels"] for i in np.unique(ids)}
    want = np.stack([eps[int(i)][s] for i, s in zip(ids, t)])
    after = np.stack([eps[int(i)][s + 1] for i, s in zip(ids, t)])
    np.testing.assert_array_equal(b.observations["pixels"].numpy(), want)
    np.testing.assert_array_equal(b.next_observations["pixels"].numpy(), after)


SHARDS = {"under": "steps/pixels/", "renames": True}  # the writes and renames that replace an image shard


def test_every_shard_write_failing_every_way(tmp_path):
    """Each write of a shard's temp file failing and each rename putting it in place failing, one mode each in turn
    (write: short, ENOSPC, EIO; rename: ENOSPC, EIO): the last commit stays whole (through episode() and the
    sampler) and a retry commits."""
    config = "ring-compressed"
    base, kinds = _baseline(tmp_path, config, **SHARDS)
    assert len(kinds) >= 12 and kinds == ["bytes", "object"] * (len(kinds) // 2), kinds  # each shard: written, renamed
    for at, kind in enumerate(kinds, 1):
        modes = _modes(kind)
        for mode in modes[(at // 2) % len(modes) :][:1]:
            path = str(tmp_path / f"{at}-{mode}")
            shutil.copytree(base, path)
            _faulty_run(config, path, path, at, mode, **SHARDS)
            assert not [f for _, _, files in os.walk(path) for f in files if f.endswith(".tmp")], "a temp file left"
            _sampled_frames_equal(config, path)
            _check_and_retry(config, path, None, BASELINE)
            _sampled_frames_equal(config, path)
            shutil.rmtree(path)


def test_a_handle_whose_shard_write_failed_appends_again(tmp_path):
    """The append whose shard write or rename failed raised and left no trace: the same handle appends that episode
    again, and its sampler, sampling between, returns only committed frames."""
    config = "ring-compressed"
    path = str(tmp_path / "store")
    workload(config, path, 0, BASELINE)
    with open_store(path, CONFIGS[config]["obs"], ACT, **store_options(config, None)) as store:
        sampler = HerSampler(store, 256, n_sampled_goal=0, seed=0)
        for at, mode in [(1, "short"), (1, "eio"), (2, "enospc"), (2, "eio")]:  # the temp file; the rename
            i = store.end_episode
            with WriteFaults(path, at, mode, **SHARDS), pytest.raises(OSError):
                store.append_episode(episode_for(config, i))
            assert store.end_episode == i
            _assert_frames(config, sampler)
            assert store.append_episode(episode_for(config, i)) == i
            _assert_frames(config, sampler)
        sampler.close()
    with EpisodeStore.open(path) as store:
        assert store.end_episode == BASELINE + 4
        for i in range(store.first_episode, store.end_episode):
            assert_episode_equal(store.episode(i), episode_for(config, i))


@pytest.mark.parametrize("config", ["raw", "ring-compressed"])
def test_every_write_of_a_create_failing(tmp_path, config):
    """A create that fails (or dies) at any write leaves nothing or a store that open_store resumes."""
    probe = str(tmp_path / "probe")
    with WriteFaults(probe) as counter:
        workload(config, probe, 0, 1)
    for at in range(1, counter.calls + 1):
        for mode in ("enospc", "eio"):
            path = str(tmp_path / f"{at}-{mode}")
            with WriteFaults(path, at, mode), pytest.raises((OSError, StoreError)):
                workload(config, path, 0, 1)
            with open_store(path, CONFIGS[config]["obs"], ACT, **store_options(config, None)) as store:
                assert store.end_episode in (0, 1)
                for i in range(store.first_episode, store.end_episode):
                    assert_episode_equal(store.episode(i), episode_for(config, i))


def _kill_at(config: str, path: str, at: int, opts: dict | None = None, first: int = BASELINE) -> int:
    args = [sys.executable, os.path.join(ROOT, "tests", "faults.py"), config, path, str(at), "kill", str(first)]
    if opts is not None:
        args.append(json.dumps(opts))
    proc = subprocess.run(args, check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc.returncode


@pytest.mark.parametrize("config", list(CONFIGS))
def test_kill_9_at_writes(tmp_path, config):
    base, kinds = _baseline(tmp_path, config)
    n = len(kinds)
    for at in sorted({1, n // 3, n // 2, (2 * n) // 3, n}):
        path = str(tmp_path / f"kill-{at}")
        shutil.copytree(base, path)
        assert _kill_at(config, path, at) == -9
        _check_and_retry(config, path, None, BASELINE)
    # and during the create itself
    for at in (1, 3, 9):
        path = str(tmp_path / f"create-kill-{at}")
        args = [sys.executable, "-c", (
            "import sys; sys.path.insert(0, sys.argv[1])\n"
            "from tests.faults import WriteFaults, workload\n"
            "with WriteFaults(sys.argv[3], int(sys.argv[4]), 'kill'):\n    workload(sys.argv[2], sys.argv[3], 0, 1)\n"
        ), ROOT, config, path, str(at)]
        assert subprocess.run(args, check=False, capture_output=True, cwd=ROOT, timeout=120).returncode in (-9, 0)
        with open_store(path, CONFIGS[config]["obs"], ACT, **store_options(config, None)) as store:
            assert store.end_episode in (0, 1)


def test_s3_writes_failing_every_way(s3_url):
    url, opts = s3_url
    bucket_root = url.split("://", 1)[1].rsplit("/", 1)[0]
    config = "raw"

    workload(config, url, 0, BASELINE, opts)
    fs = __import__("fsspec").filesystem("s3", **opts)

    def fresh() -> tuple[str, str]:
        name = f"{bucket_root}/s{uuid.uuid4().hex[:8]}"
        fs.copy(url.split("://", 1)[1], name, recursive=True)
        return f"s3://{name}", name

    path, root = fresh()
    kinds = _count_writes(config, path, root, opts)
    n = len(kinds)
    assert n > 10
    firsts = {kinds.index(kind) + 1 for kind in set(kinds)}  # each kind of write at least once
    for j, at in enumerate(sorted(firsts | set(range(1, n + 1, 10)))):  # and every tenth (each write fails locally above)
        mode = _modes(kinds[at - 1])[j % 2]
        path, root = fresh()
        _faulty_run(config, path, root, at, mode, opts)
        _check_and_retry(config, path, opts, BASELINE)
    for at in (n // 2, n):
        path, root = fresh()
        assert _kill_at(config, path, at, opts) == -9
        _check_and_retry(config, path, opts, BASELINE)


def test_s3_shard_puts_failing(s3_url):
    """A PUT replacing an image shard on object storage failing: the last commit stays whole, through episode() and
    the sampler, and a retry commits (the local tests above fail every shard write in every way)."""
    url, opts = s3_url
    config = "ring-compressed"
    workload(config, url, 0, BASELINE, opts)
    fs = __import__("fsspec").filesystem("s3", **opts)
    src = url.split("://", 1)[1]
    root = f"{src.rsplit('/', 1)[0]}/s{uuid.uuid4().hex[:8]}"
    fs.copy(src, root, recursive=True)
    # the second shard PUT fails, and every later one (a full store)
    _faulty_run(config, f"s3://{root}", root, 2, "enospc", opts, under="steps/pixels/")
    _sampled_frames_equal(config, f"s3://{root}", opts)
    _check_and_retry(config, f"s3://{root}", opts, BASELINE)
