"""``her-store copy``: local <-> S3 bit-exact, consistent while the source is written, resumable after kill -9, and
never over another store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from her_store import EpisodeStore, open_store
from her_store.cli import main
from her_store.errors import CorruptStoreError, StoreExistsError
from her_store.transfer import MANIFEST_KEY, copy_store
from her_store.verify import verify
from tests.conftest import assert_episode_equal
from tests.crash_writer import ACT, OBS, episode_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# commits every episode, about 100 a second: a ring of 1,000 transitions turns over in half a second, a copy takes
# a few tenths, so the ring evicts episodes while they are copied
WRITER_CODE = """
import sys, time
from her_store import open_store
from tests.crash_writer import ACT, OBS, episode_for
store = open_store(sys.argv[1], OBS, ACT, capacity=int(sys.argv[2]) or None, info_keys=["is_success"], chunk_rows=64,
                   commit_interval=0)
print("start", flush=True)
for i in range(100_000):
    store.append_episode(episode_for(i))
    print("committed", i + 1, flush=True)
    time.sleep(0.005)
"""
CARD = {"dataset_id": "her/copy-v0", "author": "lab", "description": "copied"}


def _make(path: str, n: int, capacity: int | None = None, **kw) -> None:
    """``n`` episodes ``episode_for(i)`` (low-dimensional fields and LZ4-sharded frames), 64-row chunks: many files."""
    with open_store(path, OBS, ACT, capacity=capacity, info_keys=["is_success"], chunk_rows=64, metadata=CARD, **kw) as s:
        for i in range(n):
            s.append_episode(episode_for(i))


def _check(path: str, storage_options=None, end: int | None = None, card=CARD) -> int:
    """Every episode of the store at ``path`` verifies its crc32 and is ``episode_for(i)``; returns its end."""
    with EpisodeStore.open(path, storage_options=storage_options) as s:
        assert end is None or s.end_episode == end
        assert s.metadata == card
        for i in range(s.first_episode, s.end_episode):
            assert_episode_equal(s.episode(i, verify=True), episode_for(i))
        return s.end_episode


def test_local_to_s3_to_local_is_bit_exact(tmp_path, s3_url):
    url, opts = s3_url
    src = str(tmp_path / "src")
    _make(src, 30)
    r = copy_store(src, url, storage_options=opts)
    assert (r.episodes, r.files_skipped, r.passes) == (30, 0, 1) and r.bytes_copied > 0
    back = str(tmp_path / "back")
    copy_store(url, back, storage_options=opts)
    _check(back, end=30)
    with EpisodeStore.open(src) as a, EpisodeStore.open(back) as b:
        assert a.commit_record == b.commit_record and a.layout.to_json() == b.layout.to_json()
        np.testing.assert_array_equal(a.episodes["crc32"], b.episodes["crc32"])
    assert not any(name.endswith(".copy-partial") for name in os.listdir(tmp_path))
    assert not os.path.exists(os.path.join(back, MANIFEST_KEY)) and not os.path.exists(os.path.join(back, "writer.lock"))


@pytest.mark.parametrize("capacity", [0, 1000])
def test_a_copy_while_a_writer_appends_is_a_committed_prefix(tmp_path, capacity):
    src = str(tmp_path / "src")
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER_CODE, src, str(capacity)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        assert writer.stdout.readline().startswith("start")
        for _ in range(60):  # a ring of 1,000 transitions is full after about 50 episodes
            writer.stdout.readline()
        results = [copy_store(src, str(tmp_path / f"copy{k}")) for k in range(2)]
    finally:
        writer.kill()
        writer.communicate()
    ends = [_check(str(tmp_path / f"copy{k}"), card={}) for k in range(2)]
    for k in range(2):  # rows the writer added past the copied commit are not carried along
        report = verify(str(tmp_path / f"copy{k}"))
        assert report.clean and not report.notes, report.summary()
    assert ends[0] >= 60 and ends[1] > ends[0]  # each a later commit, every episode of it whole
    if capacity:
        assert all(r.transitions <= capacity and r.episodes < r.generation for r in results)


def _slow_copy(args: str) -> subprocess.Popen:
    """copy_store(args) in a process that pauses 0.5 s after each batch of files it writes: killed half-way, not
    after the end."""
    code = (
        "import time, her_store.transfer as t\n"
        "write = t._Dest.write\n"
        "t._Dest.write = lambda self, *a: (write(self, *a), time.sleep(0.5))\n"
        f"t.copy_store({args})\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


def test_a_copy_killed_half_way_resumes(tmp_path, s3_url, s3_endpoint):
    import s3fs

    url, opts = s3_url
    src = str(tmp_path / "src")
    _make(src, 60)
    proc = _slow_copy(f"{src!r}, {url!r}, storage_options={opts!r}")
    fs = s3fs.S3FileSystem(**opts)
    manifest = url[len("s3://") :] + "/" + MANIFEST_KEY
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if len(json.loads(fs.cat_file(manifest))["files"]) >= 30:
                break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert not fs.exists(url[len("s3://") :] + "/commit.json")  # not a store until the copy ends
    with pytest.raises(CorruptStoreError, match="no commit record"):
        EpisodeStore.open(url, storage_options=opts)
    total = copy_store(src, str(tmp_path / "whole")).bytes_copied
    r = copy_store(src, url, storage_options=opts)
    assert r.files_skipped >= 30 and r.bytes_copied < total
    copy_store(url, str(tmp_path / "back"), storage_options=opts)
    _check(str(tmp_path / "back"), end=60)
    fs.invalidate_cache()
    assert not fs.exists(manifest)


def test_a_local_copy_killed_half_way_resumes_from_its_partial_directory(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    _make(src, 60)
    proc = _slow_copy(f"{src!r}, {dest!r}")
    manifest = os.path.join(str(tmp_path), ".dest.copy-partial", MANIFEST_KEY)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with open(manifest) as f:
                if len(json.loads(f.read())["files"]) >= 30:
                    break
        except (FileNotFoundError, ValueError):
            pass
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(dest)
    r = copy_store(src, dest)
    assert r.files_skipped >= 30
    _check(dest, end=60)
    assert not os.path.exists(os.path.join(str(tmp_path), ".dest.copy-partial"))


def test_a_destination_holding_another_store_or_files_is_refused(tmp_path, s3_url):
    url, opts = s3_url
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _make(a, 3)
    _make(b, 4)
    before = sorted(os.listdir(b))
    with pytest.raises(StoreExistsError, match="nothing was overwritten"):
        copy_store(a, b)
    assert sorted(os.listdir(b)) == before
    copy_store(b, url, storage_options=opts)
    with pytest.raises(StoreExistsError, match="already holds a store"):
        copy_store(a, url, storage_options=opts)
    _check(url, opts, end=4)
    # an interrupted copy of another store is not resumed by this one
    partial = tmp_path / ".c.copy-partial"
    partial.mkdir()
    (partial / MANIFEST_KEY).write_text(json.dumps({"source": "another store", "files": {}}))
    with pytest.raises(StoreExistsError, match="another store"):
        copy_store(a, str(tmp_path / "c"))


def test_the_copy_command(tmp_path, capsys):
    src = str(tmp_path / "src")
    _make(src, 5)
    assert main(["copy", src, str(tmp_path / "dest"), "--quiet"]) == 0
    assert "copied 5 episodes" in capsys.readouterr().out
    _check(str(tmp_path / "dest"), end=5)
    assert main(["copy", src, str(tmp_path / "dest"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("her-store copy:") and err.count("\n") == 1


def test_a_copy_to_s3_stopped_right_after_its_first_objects_resumes(tmp_path, s3_url, monkeypatch):
    """The process dies between the first PUTs and the manifest recording them: the next run still resumes."""
    from her_store import transfer

    url, opts = s3_url
    src = str(tmp_path / "src")
    _make(src, 12)
    write = transfer._Dest.write

    def dies_after_the_objects(self, items, identity, files):
        if items:
            self.loc.fs.pipe({self.loc.key_path(k): v for k, v in items.items()})  # the objects, not the manifest
            raise KeyboardInterrupt("killed")
        write(self, items, identity, files)

    monkeypatch.setattr(transfer._Dest, "write", dies_after_the_objects)
    with pytest.raises(KeyboardInterrupt):
        copy_store(src, url, storage_options=opts)
    monkeypatch.setattr(transfer._Dest, "write", write)
    copy_store(src, url, storage_options=opts)
    _check(url, storage_options=opts, end=12)
