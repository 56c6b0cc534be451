"""``her-store copy``: local <-> S3 bit-exact, consistent while the source is written, resumable after kill -9, and
never over another store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from her_store import EpisodeStore, open_store
from her_store.cli.main import main
from her_store.errors import CorruptStoreError, StoreExistsError
from her_store.ops import copy as transfer
from her_store.ops.copy import MANIFEST_KEY, copy_store
from her_store.ops.verify import verify
from tests.conftest import ROOT, assert_episode_equal, until_stopped
from tests.crash_writer import ACT, OBS, episode_for

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


def _make(path: str, n: int, capacity: int | None = None, chunk_rows: int = 64) -> None:
    """``n`` episodes ``episode_for(i)`` (low-dimensional fields and LZ4-sharded frames), 64-row chunks: many files."""
    opts = {"capacity": capacity, "info_keys": ["is_success"], "chunk_rows": chunk_rows, "metadata": CARD}
    with open_store(path, OBS, ACT, **opts) as s:
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


def _packs_bytes(path: str) -> tuple[int, int]:
    """(size, bytes on disk) of the chunk files of the uncompressed arrays (``packs/``) under ``path``."""
    found = [os.stat(os.path.join(d, f)) for d, _, names in os.walk(os.path.join(path, "packs")) for f in names]
    return sum(st.st_size for st in found), sum(st.st_blocks * 512 for st in found)


def _sparse_source(path: str) -> tuple[int, int]:
    """A store of 20 episodes in chunks of 16,384 rows (about 500 of them written): the (size, bytes on disk) of its
    uncompressed chunk files, which are full-size with holes where no row was written."""
    _make(path, 20, chunk_rows=1 << 14)
    size, disk = _packs_bytes(path)
    if disk * 4 > size:
        pytest.skip("this file system keeps no holes")
    return size, disk


@pytest.mark.slow
def test_local_to_s3_to_local_is_bit_exact(tmp_path, s3_url):
    """Uncompressed chunks travel to object storage whole (it has no holes, and Zarr reads such a chunk only whole),
    the rows not yet written as zeros, which the result and the command's line count; back on local disk they are
    holes again."""
    import s3fs

    url, opts = s3_url
    src = str(tmp_path / "src")
    _, disk = _sparse_source(src)
    r = copy_store(src, url, storage_options=opts)
    assert (r.episodes, r.files_skipped, r.passes) == (20, 0, 1)
    prefix = url[len("s3://") :] + "/"
    objects = {k[len(prefix) :]: int(i["size"]) for k, i in s3fs.S3FileSystem(**opts).find(prefix, detail=True).items()}
    with EpisodeStore.open(src) as s:
        whole = {f"{a.path}/c/0/0": a.chunk_rows * a.row_nbytes for a in s.layout.arrays if not a.compressed}
    assert {k: n for k, n in objects.items() if k.startswith("packs/") and "/c/" in k} == whole  # chunk 0 only, whole
    assert r.bytes_copied == sum(objects.values()) - objects["commit.json"]  # the record is written last, not counted
    assert r.bytes_zero > 0.95 * sum(whole.values())  # and the index chunks' zeros
    line = transfer._summary(r)
    assert f" {r.bytes_copied / 1e6:.1f} MB sent ({r.bytes_zero / 1e6:.1f} MB of zeros: rows not yet" in line, line
    back = str(tmp_path / "back")
    copy_store(url, back, storage_options=opts)
    _check(back, end=20)
    assert _packs_bytes(back)[1] <= disk
    with EpisodeStore.open(src) as a, EpisodeStore.open(back) as b:
        assert a.commit_record == b.commit_record and a.layout.to_json() == b.layout.to_json()
        np.testing.assert_array_equal(a.episodes["crc32"], b.episodes["crc32"])
    assert not any(name.endswith(".copy-partial") for name in os.listdir(tmp_path))
    assert not os.path.exists(os.path.join(back, MANIFEST_KEY))
    assert not os.path.exists(os.path.join(back, "writer.lock"))


@pytest.mark.slow
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
        results = [copy_store(src, str(tmp_path / "copy0"))]
        with EpisodeStore.open(str(tmp_path / "copy0")) as copied:
            end = copied.end_episode
        while (line := writer.stdout.readline()).startswith("committed ") and int(line.split()[1]) <= end:
            pass  # until the writer has committed past the first copy
        assert line.startswith("committed "), f"the writer ended: {line!r}"
        results.append(copy_store(src, str(tmp_path / "copy1")))  # of a later commit
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


def _copy_stopped_half_way(args: str, files: int = 30) -> subprocess.Popen:
    """copy_store(args) in a process that stops itself (SIGSTOP) once its manifest lists ``files`` files, before the
    copy ends: returned stopped, for the test to kill half-way, never after the end."""
    code = (
        "import os, signal, her_store.ops.copy as t\n"
        "write = t._Dest.write\n"
        "def write_then_stop(self, items, identity, files):\n"
        "    done = write(self, items, identity, files)\n"
        f"    if len(files) >= {files}:\n"
        "        os.kill(os.getpid(), signal.SIGSTOP)\n"
        "    return done\n"
        "t._Dest.write = write_then_stop\n"
        f"t.copy_store({args})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    until_stopped(proc)
    return proc


@pytest.mark.slow
def test_a_copy_killed_half_way_resumes(tmp_path, s3_url, s3_endpoint):
    import s3fs

    url, opts = s3_url
    src = str(tmp_path / "src")
    _make(src, 60)
    proc = _copy_stopped_half_way(f"{src!r}, {url!r}, storage_options={opts!r}")
    fs = s3fs.S3FileSystem(**opts)
    manifest = url[len("s3://") :] + "/" + MANIFEST_KEY
    assert len(json.loads(fs.cat_file(manifest))["files"]) >= 30
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert not fs.exists(url[len("s3://") :] + "/commit.json")  # not a store until the copy ends
    with pytest.raises(CorruptStoreError, match="no commit record"):
        EpisodeStore.open(url, storage_options=opts)
    whole = copy_store(src, str(tmp_path / "whole"))
    total = whole.bytes_copied + whole.bytes_zero  # every byte of every file, as object storage takes them
    r = copy_store(src, url, storage_options=opts)
    assert r.files_skipped >= 30 and r.bytes_copied < total
    copy_store(url, str(tmp_path / "back"), storage_options=opts)
    _check(str(tmp_path / "back"), end=60)
    fs.invalidate_cache()
    assert not fs.exists(manifest)


def test_a_local_copy_killed_half_way_resumes_from_its_partial_directory(tmp_path):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    _make(src, 60)
    proc = _copy_stopped_half_way(f"{src!r}, {dest!r}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(dest)
    r = copy_store(src, dest)
    assert r.files_skipped >= 30
    _check(dest, end=60)
    assert not os.path.exists(os.path.join(str(tmp_path), ".dest.copy-partial"))


def _killed_copy(src: str, dest: str) -> Path:
    """A store of 60 episodes at ``src``, and a local copy of it to ``dest`` killed half-way: its partial directory."""
    _make(src, 60)
    proc = _copy_stopped_half_way(f"{src!r}, {dest!r}")
    partial = Path(os.path.dirname(dest), f".{os.path.basename(dest)}.copy-partial")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return partial


def test_a_resumed_copy_copies_again_what_changed_in_its_partial_directory(tmp_path):
    """A resumed copy took the files an earlier run wrote for copied if their sizes matched: a shard whose bytes were
    lost (zeroed, as a power loss leaves a file written without fsync) then failed every rerun naming the source, and
    metadata changed in place gave a destination that did not open, reported as copied. Each file is now checked
    against the crc32 its manifest recorded, and copied again if it differs."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    partial = _killed_copy(src, dest)
    listed = json.loads((partial / MANIFEST_KEY).read_bytes())["files"]
    shard = next(k for k in listed if k.startswith(("steps/", "packs/")) and not k.endswith("zarr.json"))
    meta = next(k for k in listed if k.endswith("zarr.json"))
    for key in (shard, meta):
        size = (partial / key).stat().st_size
        (partial / key).write_bytes(bytes(size))  # same size, other bytes
    r = copy_store(src, dest)
    assert r.files_skipped >= 20
    _check(dest, end=60)
    assert verify(dest).clean


@pytest.mark.slow
@pytest.mark.parametrize("entry", [7, {"2": 1}, [1, 2], [], [-1, 0, "x"], [1, "crc", "x"]])
def test_a_manifest_whose_entries_are_not_a_copys_is_refused(tmp_path, entry):
    """Entries edited by hand gave raw TypeError, KeyError and IndexError from deep in the copy."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    partial = _killed_copy(src, dest)
    doc = json.loads((partial / MANIFEST_KEY).read_bytes())
    doc["files"][next(iter(doc["files"]))] = entry
    (partial / MANIFEST_KEY).write_text(json.dumps(doc))
    with pytest.raises(CorruptStoreError, match=r"is not a copy manifest \(its entry for .* not \[size, crc32"):
        copy_store(src, dest)
    assert not os.path.exists(dest)


def test_a_resumed_copy_writes_over_junk_in_its_partial_directory(tmp_path):
    """What lies in a killed copy's partial directory is the copy's own to replace: a dangling link made the resumed
    copy fail with a raw FileNotFoundError, a directory where a file goes with a raw IsADirectoryError. Both are now
    written over, and the copy completes."""
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    partial = _killed_copy(src, dest)
    (partial / "junk").symlink_to(tmp_path / "nowhere")
    planted = 0
    for d, _, names in os.walk(src):
        for name in names:
            key = os.path.relpath(os.path.join(d, name), src)
            if name != "writer.lock" and not (partial / key).exists() and not (partial / key).is_symlink():
                (partial / key / "inside").mkdir(parents=True)
                planted += 1
    assert planted > 0
    copy_store(src, dest)
    _check(dest, end=60)
    assert not partial.exists()


@pytest.mark.parametrize("target", ["nowhere", "another chunk"])
def test_a_link_at_a_committed_chunk_of_the_source_is_named(tmp_path, target):
    """A committed chunk that is a link, dangling or to another of the store's chunks, is refused by name. A dangling
    one was taken for a missing file, and the copy failed saying only that episodes did not match their crc32."""
    src, dest = tmp_path / "src", str(tmp_path / "dest")
    _make(str(src), 10)
    chunk = src / "steps" / "pixels" / "c.0.0.0.0"
    other = src / "steps" / "pixels" / "c.1.0.0.0"
    assert chunk.is_file() and other.is_file()
    chunk.unlink()
    chunk.symlink_to(tmp_path / "nowhere" if target == "nowhere" else other)
    with pytest.raises(CorruptStoreError, match=f"{chunk}.*symbolic link"):
        copy_store(str(src), dest)
    assert not os.path.exists(dest)


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


@pytest.mark.slow
def test_a_copy_to_s3_stopped_right_after_its_first_objects_resumes(tmp_path, s3_url, monkeypatch):
    """The process dies between the first PUTs and the manifest recording them: the next run still resumes."""
    from her_store.ops import copy as transfer

    url, opts = s3_url
    src = str(tmp_path / "src")
    _make(src, 12)
    write = transfer._Dest.write

    def dies_after_the_objects(self, items, identity, files):
        if items:
            self.loc.fs.pipe({self.loc.key_path(k): v for k, v in items.items()})  # the objects, not the manifest
            raise KeyboardInterrupt("killed")
        return write(self, items, identity, files)

    monkeypatch.setattr(transfer._Dest, "write", dies_after_the_objects)
    with pytest.raises(KeyboardInterrupt):
        copy_store(src, url, storage_options=opts)
    monkeypatch.setattr(transfer._Dest, "write", write)
    copy_store(src, url, storage_options=opts)
    _check(url, storage_options=opts, end=12)


def test_a_local_copy_keeps_the_holes_of_uncompressed_chunk_files(tmp_path, capsys):
    src, dest = str(tmp_path / "src"), str(tmp_path / "dest")
    size, disk = _sparse_source(src)
    assert main(["copy", src, dest, "--quiet"]) == 0
    line = capsys.readouterr().out
    assert " MB written (" in line and " MB of zeros: left as holes)" in line, line
    assert _packs_bytes(dest)[0] == size and _packs_bytes(dest)[1] <= disk
    _check(dest, end=20)
