"""Packed stores: her-store pack, the archive's layout, opening and sampling it in place, and hostile archives."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import zarr
from gymnasium import spaces

from her_store import EpisodeStore, HerSampler, open_store
from her_store.cli.main import main
from her_store.errors import CorruptStoreError, NotAStoreError, ReadOnlyStoreError, StoreError
from her_store.format.layout import INDEX_COLUMNS
from her_store.ops.pack import ALIGNMENT, pack_store
from her_store.ops.verify import verify
from her_store.storage.archive import PackedArchive
from her_store.storage.archive_backend import ArchiveBackend
from her_store.storage.files import data_runs
from her_store.store.cached_rows import RangedArray
from her_store.store.frame_rows import FrameArray
from tests.conftest import ROOT, assert_episode_equal, fetch_spaces, make_episode
from tests.http_server import RangeHandler, serving

IMG_OBS = spaces.Dict(
    {
        "observation": spaces.Box(0, 255, (3, 8, 8), np.uint8),  # an image: LZ4 in shards by default
        "achieved_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
        "desired_goal": spaces.Box(-np.inf, np.inf, (3,), np.float32),
    }
)
ACT = spaces.Box(-1.0, 1.0, (2,), np.float32)
EPISODES = 40


def reward_fn(achieved, desired, info):
    return -(np.linalg.norm(achieved - desired, axis=-1) > 0.05).astype(np.float32)


def _build(path: Path, obs: spaces.Dict = IMG_OBS, act: spaces.Space = ACT, **kw) -> Path:
    with EpisodeStore.create(path, obs, act, chunk_rows=256, metadata={"env_id": "Pack-v0"}, **kw) as store:
        for i in range(EPISODES):
            store.append_episode(make_episode(obs, act, 3 + i % 11, i))
    return path


@pytest.fixture(scope="module")
def packed_once(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    src = _build(d / "store")
    pack_store(src, d / "store.zip")
    return d


@pytest.fixture
def packed(packed_once, tmp_path):
    """(a store with an LZ4 image field and a raw pack, its archive), a copy of its own for each test."""
    shutil.copytree(packed_once / "store", tmp_path / "store")
    shutil.copy(packed_once / "store.zip", tmp_path / "store.zip")
    return tmp_path / "store", tmp_path / "store.zip"


def _batches(store: EpisodeStore, n: int = 3):
    with HerSampler(store, 256, reward_fn=reward_fn, seed=7) as sampler:
        return [sampler.sample() for _ in range(n)]


def test_every_episode_and_every_batch_from_the_archive_equal_the_directory(packed):
    src, zpath = packed
    with EpisodeStore.open(src) as d, EpisodeStore.open(zpath) as z:
        assert z.metadata == d.metadata == {"env_id": "Pack-v0"}
        assert z.commit_record == d.commit_record and z.num_episodes == EPISODES
        assert [spec.sharded for spec in z.layout.arrays] == [spec.sharded for spec in d.layout.arrays]
        assert any(spec.sharded for spec in z.layout.arrays)  # the image field is read by byte ranges
        for i in range(EPISODES):
            got = z.episode(i, verify=True)
            assert_episode_equal(got, d.episode(i))
            assert_episode_equal(got, make_episode(IMG_OBS, ACT, 3 + i % 11, i))
        for a, b in zip(_batches(z), _batches(d)):
            for name in ("actions", "rewards", "terminated", "episode_ids", "steps", "is_relabeled"):
                assert getattr(a, name).equal(getattr(b, name)), name
            for k in a.observations:
                assert a.observations[k].equal(b.observations[k]) and a.next_observations[k].equal(
                    b.next_observations[k]
                ), k
        assert z.refresh() == 0  # an archive never changes


def test_the_archive_is_stored_aligned_and_holds_the_store_without_its_lock(packed):
    src, zpath = packed
    with zipfile.ZipFile(zpath) as zf:
        infos = zf.infolist()
        assert zf.testzip() is None  # every member's CRC-32 is right
    names = {i.filename for i in infos}
    assert {"zarr.json", "commit.json"} <= names and "writer.lock" not in names and (src / "writer.lock").exists()
    assert all(i.compress_type == zipfile.ZIP_STORED for i in infos)
    on_disk = {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()} - {"writer.lock"}
    assert names == on_disk
    archive = PackedArchive(str(zpath))
    data = [key for key in archive.members if key.startswith(("packs/", "steps/")) and "zarr.json" not in key]
    assert data and all(archive.members[key][0] % ALIGNMENT == 0 for key in data)  # data chunks start on a page
    raw = zpath.read_bytes()
    with EpisodeStore.open(src) as store:
        index_rows = {f"episodes/{name}/zarr.json": col.chunk_rows for name, col in store._index_io.items()}
    for key, (offset, size) in archive.members.items():
        member, source = raw[offset : offset + size], (src / key).read_bytes()
        if not key.endswith("zarr.json"):  # chunks: the source's bytes (a pack's chunks hold fewer index rows)
            assert member == source[:size], key
            continue
        doc, want = json.loads(member), json.loads(source)
        if key in index_rows:  # an index column's chunks hold the rows its positions need
            assert want["chunk_grid"]["configuration"]["chunk_shape"] == [index_rows[key]] > doc["chunk_grid"][
                "configuration"]["chunk_shape"]
            want["chunk_grid"] = doc["chunk_grid"]
        assert doc == want, key


def test_zarr_reads_the_archive_with_its_own_zip_store(packed):
    src, zpath = packed
    mine, theirs = zarr.open_group(src, mode="r"), zarr.open_group(zarr.storage.ZipStore(zpath, mode="r"), mode="r")
    for path in ("packs/float32", "steps/observation", "episodes/start_row"):
        np.testing.assert_array_equal(theirs[path][:500], mine[path][:500], err_msg=path)
    assert theirs.attrs["her_store"] == mine.attrs["her_store"]


def test_an_archive_opens_read_only(packed):
    _, zpath = packed
    before = zpath.read_bytes()
    for call in (lambda: EpisodeStore.open(zpath, "a"), lambda: open_store(zpath, IMG_OBS, ACT)):
        with pytest.raises(ReadOnlyStoreError, match="packed store .* never written: extract it"):
            call()
    with EpisodeStore.open(zpath) as z, pytest.raises(ReadOnlyStoreError):
        z.append_episode(make_episode(IMG_OBS, ACT, 3, 0))
    assert zpath.read_bytes() == before


def test_a_zip_of_the_store_made_by_other_tools_opens_if_stored(packed, tmp_path):
    """Members at any offset (no alignment) and directory entries, as `zip -0 -r` writes: mapped from the page below."""
    src, _ = packed
    plain = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(src.rglob("*")):
            if p.name != "writer.lock":
                zf.write(p, str(p.relative_to(src)))  # directories too
    assert any(o % ALIGNMENT for o, _ in PackedArchive(str(plain)).members.values())
    with EpisodeStore.open(src) as d, EpisodeStore.open(plain) as z:
        for a, b in zip(_batches(z, 2), _batches(d, 2)):
            assert all(a.observations[k].equal(b.observations[k]) for k in a.observations)


# -- hostile archives: each a clear CorruptStoreError naming the member, never a crash or a read outside the file ------


def _rezip(src: Path, dest: Path, extra=(), compress: str | None = None) -> None:
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zf:
        for p in sorted(src.rglob("*")):
            if p.is_file() and p.name != "writer.lock":
                key = str(p.relative_to(src))
                zf.write(p, key, zipfile.ZIP_DEFLATED if key == compress else zipfile.ZIP_STORED)
        for info, data in extra:
            zf.writestr(info, data)


def _patch_central(path: Path, name: bytes, field_at: int, value: int) -> None:
    """Overwrite a 4-byte field of the central directory entry of member ``name``."""
    raw = bytearray(path.read_bytes())
    at = raw.index(b"PK\x01\x02")
    while raw[at + 46 : at + 46 + len(name)] != name:
        at = raw.index(b"PK\x01\x02", at + 4)
    struct.pack_into("<L", raw, at + field_at, value)
    path.write_bytes(bytes(raw))


def _symlink_entry() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo("packs/evil")
    info.create_system = 3
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


HOSTILE = {
    "dotdot": (
        lambda s, d: _rezip(s, d, [(zipfile.ZipInfo("../outside"), b"x")]),
        r"'\.\./outside' is not a relative path",
    ),
    "absolute": (lambda s, d: _rezip(s, d, [(zipfile.ZipInfo("/etc/passwd"), b"x")]), "is not a relative path"),
    "deflated": (lambda s, d: _rezip(s, d, compress="commit.json"), r"'commit.json' is compressed \(method 8"),
    "duplicate": (lambda s, d: _rezip(s, d, [(zipfile.ZipInfo("commit.json"), b"{}")]), "'commit.json' appears twice"),
    "symlink": (lambda s, d: _rezip(s, d, [(_symlink_entry(), b"/etc/passwd")]), "'packs/evil' is a symbolic link"),
    "offset past the end": (
        lambda s, d: (_rezip(s, d), _patch_central(d, b"zarr.json", 42, 0x7FFF0000)),
        "'zarr.json': no local header at byte 2,147,418,112",
    ),
    "size past the end": (
        lambda s, d: (
            _rezip(s, d),
            _patch_central(d, b"zarr.json", 20, 1 << 30),
            _patch_central(d, b"zarr.json", 24, 1 << 30),
        ),
        "'zarr.json': bytes .* run past the members' end",
    ),
    "truncated": (
        lambda s, d: (_rezip(s, d), d.write_bytes(d.read_bytes()[: d.stat().st_size // 2])),
        "no end of central directory record",
    ),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_archive_is_refused_naming_what_is_wrong(packed, tmp_path, kind):
    src, _ = packed
    make, message = HOSTILE[kind]
    bad = tmp_path / "bad.zip"
    with pytest.warns(UserWarning, match="Duplicate name") if kind == "duplicate" else contextlib.nullcontext():
        make(src, bad)
    with pytest.raises(CorruptStoreError, match=message):
        EpisodeStore.open(bad)


def test_an_archive_cut_short_after_it_was_opened_fails_the_gathers_of_the_members_it_lost(packed):
    """The zip is cut short in place, inside a raw chunk's member, after the store was opened (its directory read):
    mapping that member raised Python's bare ValueError ("mmap length is greater than file size"); now the gather
    raises CorruptStoreError naming the member, and a member before the cut still reads."""
    from her_store.store.rows import ChunkReader

    _, zpath = packed
    with zipfile.ZipFile(zpath) as zf:
        chunks = [i for i in zf.infolist() if i.filename.startswith("packs/") and "/c/" in i.filename]
    members = sorted((i.header_offset, i.filename) for i in chunks)
    (_, kept), (cut_at, lost) = members[0], members[-1]
    with EpisodeStore.open(zpath) as store:
        reader = ChunkReader(store)
        reader.observe(store.snapshot())

        def rows_of(member: str) -> tuple[str, np.ndarray]:  # the array of a chunk's member, and its first rows
            spec = next(a for a in store.layout.arrays if member.startswith(a.path + "/"))
            chunk = next(c for c in range(64) if spec.chunk_key(c) == member)
            return spec.path, np.arange(chunk * spec.chunk_rows, chunk * spec.chunk_rows + 2)

        os.truncate(zpath, cut_at + 100)
        with pytest.raises(CorruptStoreError, match=rf"{lost}: the file ends before the chunk's rows do"):
            reader.gather(*rows_of(lost))
        assert reader.gather(*rows_of(kept)).shape[0] == 2
        reader.close()


def test_a_zip_that_holds_no_store_and_a_file_that_is_no_zip(tmp_path):
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("hello.txt", "hi")
    with pytest.raises(NotAStoreError, match="not a her_store store"):
        EpisodeStore.open(other)
    text = tmp_path / "notes.zip"
    text.write_text("not a zip")
    with pytest.raises(NotAStoreError, match="is a file, not a store directory"):
        EpisodeStore.open(text)


# -- packing: one commit, consistent while a writer appends; nothing left behind on failure -------------------------

WRITER = """
import os, sys, time
sys.path.insert(0, {root!r})
from tests.conftest import fetch_spaces, make_episode
from her_store import EpisodeStore
obs, act = fetch_spaces()
store = EpisodeStore.open(sys.argv[1], "a", commit_interval=0)
i = store.end_episode
while not os.path.exists(sys.argv[2]) and os.getppid() == int(sys.argv[5]):  # until told, or the test is gone
    with open(sys.argv[4]) as f:
        target = int(f.read())  # the episodes to commit before waiting for more
    if i >= target:
        time.sleep(0.005)
        continue
    store.append_episode(make_episode(obs, act, 3 + i % 11, i))
    i += 1
    time.sleep(float(sys.argv[3]))
store.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 100], ids=["unbounded", "ring"])
def test_pack_while_a_writer_appends_gives_a_committed_prefix(tmp_path, capacity):
    """Each archive holds one commit's episodes, bit-exact and passing their crc32. A ring of 100 transitions is lapped
    by its writer while it is packed, so the packed record leaves out the episodes evicted during the copy."""
    obs, act = fetch_spaces()
    src = tmp_path / "store"
    with EpisodeStore.create(src, obs, act, capacity=capacity, chunk_rows=512) as store:
        store.append_episode(make_episode(obs, act, 3, 0))
    stop, target = tmp_path / "stop", tmp_path / "target"

    def write_up_to(end: int) -> None:  # the writer appends up to episode end - 1, then waits for a new target
        (tmp_path / "target.tmp").write_text(str(end))
        os.replace(tmp_path / "target.tmp", target)

    write_up_to(60)
    root = str(Path(ROOT))
    pause = "0" if capacity else "0.001"
    args = [str(src), str(stop), pause, str(target), str(os.getpid())]
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(root=root), *args])
    commits = []
    try:
        with EpisodeStore.open(src) as reader:
            deadline = time.monotonic() + 300  # only a hang takes this long
            for k in range(3):
                while reader.end_episode < (commits[-1].end_episode + 1 if commits else 60):  # the writer went on
                    assert writer.poll() is None and time.monotonic() < deadline, reader.end_episode
                    time.sleep(0.02)
                    reader.refresh()
                write_up_to(reader.end_episode + 200)  # appending while the store is packed: the ring laps
                commits.append(pack_store(src, tmp_path / f"p{k}.zip"))
    finally:
        stop.touch()
        writer.wait(120)
    assert writer.returncode == 0
    assert commits[-1].end_episode > commits[0].end_episode  # the writer went on while packing
    for k, commit in enumerate(commits):
        with EpisodeStore.open(tmp_path / f"p{k}.zip") as z:
            assert z.commit_record == commit and z.end_episode == commit.end_episode
            if capacity is None:
                assert z.first_episode == 0
            for i in range(z.first_episode, z.end_episode):
                assert_episode_equal(
                    z.episode(i, verify=True),
                    make_episode(obs, act, 3 + i % 11, i) if i else make_episode(obs, act, 3, 0),
                )


@pytest.mark.parametrize("capacity", [None, 4096], ids=["unbounded", "ring"])
def test_what_lies_in_chunks_holding_no_live_row_is_not_packed(tmp_path, capacity):
    """A crash's leftovers past the commit (a shard cut short, a raw chunk of rows never committed) were copied into
    the zip, where verify then found them and no repair could remove them; files no store has were packed too, or
    stopped the pack (a link). Only the store's metadata and the chunks holding live rows (and index positions) are
    packed: the archive verifies clean and holds every episode as the directory does."""
    from her_store.ops.verify import verify

    src = _build(tmp_path / "store", capacity=capacity)
    with EpisodeStore.open(src) as store:
        w, layout = store.commit_record.write_row, store.layout
        episodes = [store.episode(i) for i in range(store.first_episode, store.end_episode)]
    past = {spec.path: spec.chunk_key(w // spec.chunk_rows + 2) for spec in layout.arrays}
    for key in past.values():
        Path(src, key).parent.mkdir(parents=True, exist_ok=True)
        Path(src, key).write_bytes(b"\x07" * 100)
    # and files no store has: someone's notes, metadata where no Zarr node is, a link past the index's positions
    for key in ("notes/zarr.json", "packs/float32/c/0/zarr.json", "steps/zarr.json.4242.tmp"):
        Path(src, key).parent.mkdir(parents=True, exist_ok=True)
        Path(src, key).write_bytes(b"{}")
    os.symlink(Path(src, "commit.json"), Path(src, "episodes/length/c/7"))
    assert {p.kind for p in verify(src).problems} == {"uncommitted"}
    pack_store(src, tmp_path / "store.zip")
    members = set(zipfile.ZipFile(tmp_path / "store.zip").namelist())
    assert not {*past.values(), "notes/zarr.json", "packs/float32/c/0/zarr.json", "episodes/length/c/7"} & members
    assert not any(m.endswith(".tmp") for m in members)
    packed = verify(tmp_path / "store.zip")
    assert packed.clean, packed.summary()
    with EpisodeStore.open(tmp_path / "store.zip") as store:
        for i, ep in enumerate(episodes):
            assert_episode_equal(store.episode(store.first_episode + i), ep)


def test_a_failed_pack_leaves_nothing(packed, tmp_path):
    src, zpath = packed
    before = zpath.read_bytes()
    with pytest.raises(FileExistsError, match="exists"):
        pack_store(src, zpath)
    assert zpath.read_bytes() == before
    # the last file copied is a link: the pack fails after writing every other member, and removes what it wrote
    last = max(p for p in src.rglob("*") if "c" in p.parts and p.is_file())
    target = tmp_path / "elsewhere"
    shutil.move(last, target)
    os.symlink(target, last)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CorruptStoreError, match="symbolic link"):
        pack_store(src, out / "x.zip")
    assert os.listdir(out) == []


def test_the_pack_command(packed, tmp_path, capsys):
    src, _ = packed
    dest = tmp_path / "cli.zip"
    assert main(["pack", str(src), str(dest), "--quiet"]) == 0
    assert f"packed {EPISODES} episodes" in capsys.readouterr().out
    assert main(["info", str(dest)]) == 0
    assert main(["pack", str(src), str(dest), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("her-store pack: ") and "exists" in err and err.count("\n") == 1


def test_inspect_gives_a_packed_stores_bytes_from_its_members(tmp_path):
    from her_store.ops.inspect import summary

    src = _build(tmp_path / "s")
    pack_store(src, tmp_path / "s.zip")
    with EpisodeStore.open(src) as d, EpisodeStore.open(tmp_path / "s.zip") as z:
        unpacked, packed = summary(d), summary(z)
    images = [(a, b) for a, b in zip(packed["fields"], unpacked["fields"]) if b["array"].startswith("steps/")]
    assert images and all(a["apparent_bytes"] == b["apparent_bytes"] > 0 for a, b in images)  # shards as they are
    assert 0 < packed["bytes_on_disk"] <= packed["apparent_bytes"] < unpacked["apparent_bytes"]
    assert packed["index_apparent_bytes"] < unpacked["index_apparent_bytes"]  # the index rows of 40 episodes, no more


# -- holes: an uncompressed array's chunk files hold holes where no row was written yet; an archive holds none ------


def _disk(path: Path) -> tuple[int, int]:
    """(size, bytes on disk) of a file, or of the files under a directory."""
    found = [p.stat() for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file()]
    return sum(st.st_size for st in found), sum(st.st_blocks * 512 for st in found)


def test_an_archive_holds_the_data_not_the_holes_of_its_chunk_files(tmp_path):
    """A store of the default local layout with five episodes: its uncompressed chunk files are 1,048,576 rows each,
    nearly all holes (88 MB for 22 KB of rows), and the archive was their size: 90 MB to upload or copy. The archive's
    uncompressed arrays now have chunks of the rows they hold (their zarr.json and the layout say so), so it holds
    about the data; it reads bit-exact (episodes, sampled batches, plain zarr-python through its ZipStore, every
    member's CRC-32) and verifies clean."""
    from her_store.ops.verify import verify

    obs, act = fetch_spaces()
    src = tmp_path / "store"
    with EpisodeStore.create(src, obs, act) as store:
        for i in range(5):
            store.append_episode(make_episode(obs, act, 50, i))
        layout, commit = store.layout, store.commit_record
    assert layout.arrays[0].chunk_rows == 1 << 20
    zpath = tmp_path / "store.zip"
    assert main(["pack", str(src), str(zpath), "--quiet"]) == 0
    rows = commit.num_transitions + 5  # every episode's T + 1 rows
    data = rows * sum(spec.row_nbytes for spec in layout.arrays) + 5 * sum(dt.itemsize for dt in INDEX_COLUMNS.values())
    archive = PackedArchive(str(zpath))
    metadata = sum(size for key, (_, size) in archive.members.items() if key.endswith(".json"))
    aligned = sum(1 for key in archive.members if key.startswith("packs/") and "/c/" in key)
    overhead = 256 * len(archive.members) + ALIGNMENT * aligned  # headers, names, a page of padding per data chunk
    assert zpath.stat().st_size < 2 * data + metadata + overhead, (zpath.stat().st_size, data, metadata, overhead)
    assert _disk(src)[0] > 1000 * zpath.stat().st_size  # (the store's chunk files' apparent size)
    with zipfile.ZipFile(zpath) as zf:
        assert zf.testzip() is None
    with EpisodeStore.open(src) as d, EpisodeStore.open(zpath) as z:
        assert z.commit_record == d.commit_record and z.layout.arrays[0].chunk_rows < d.layout.arrays[0].chunk_rows
        for i in range(5):
            assert_episode_equal(z.episode(i, verify=True), d.episode(i))
        for a, b in zip(_batches(z), _batches(d)):
            for name in ("actions", "rewards", "terminated", "episode_ids", "steps"):
                assert getattr(a, name).equal(getattr(b, name)), name
            assert all(a.observations[k].equal(b.observations[k]) for k in a.observations)
    theirs = zarr.open_group(zarr.storage.ZipStore(zpath, mode="r"), mode="r")
    mine = zarr.open_group(src, mode="r")
    for path in ("packs/float32", "packs/bool", "episodes/start_row", "episodes/crc32"):
        np.testing.assert_array_equal(theirs[path][: rows + 64], mine[path][: rows + 64], err_msg=path)
    report = verify(zpath)
    assert report.clean and report.episodes == 5, report.summary()


def test_data_runs_leave_out_holes_and_are_the_whole_file_where_the_file_system_cannot_tell(tmp_path):
    path = tmp_path / "sparse"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 1 << 22)
        os.pwrite(fd, b"rows", 1 << 21)
        runs = data_runs(fd, 1 << 22)
        if sum(b - a for a, b in runs) == 1 << 22:
            pytest.skip("this file system keeps no holes")
        assert len(runs) == 1
        assert runs[0][0] <= 1 << 21 and runs[0][1] >= (1 << 21) + 4 and runs[0][1] - runs[0][0] <= 1 << 16
        assert data_runs(fd, 1 << 20) == [] and data_runs(fd, 0) == []
    finally:
        os.close(fd)
    if not os.path.exists("/proc/self/status"):
        return
    fd = os.open("/proc/self/status", os.O_RDONLY)  # procfs has no SEEK_DATA: every byte is data
    try:
        assert data_runs(fd, 100) == [(0, 100)]
    finally:
        os.close(fd)


def test_a_linked_directory_on_the_way_to_a_member_stops_the_pack(tmp_path):
    """os.walk does not enter a linked directory: the chunks behind one were left out without a word, and the archive
    (whose own check reads no chunk) failed its episodes' crc32 when read. A pack now stops, naming the link."""
    src = _build(tmp_path / "store")
    c = src / "packs" / "float32" / "c"
    shutil.copytree(c, tmp_path / "outside")
    shutil.rmtree(c)
    c.symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(CorruptStoreError, match="packs/float32/c is a symbolic link"):
        pack_store(src, tmp_path / "store.zip")
    assert not (tmp_path / "store.zip").exists()


# -- a packed store read in place over HTTP and S3: the zip's directory, then each member as a byte range of it -------


class RecordingHandler(RangeHandler):
    """Static files with Range and If-Match, recording each GET's Range header."""

    ranges: ClassVar[list[str | None]] = []

    def do_GET(self, body: bool = True) -> None:
        if body:
            type(self).ranges.append(self.headers.get("Range"))
        super().do_GET(body)


class NoRangeHandler(http.server.SimpleHTTPRequestHandler):
    """python's own file server: every GET answered with the whole file (no Range, no ETag)."""

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A directory holding two stores and their archives: ``low`` of the default local layout (chunks of 1,048,576
    rows) and ``img``, with an LZ4 image field in shards."""
    d = tmp_path_factory.mktemp("published")
    obs, act = fetch_spaces()
    with EpisodeStore.create(d / "low", obs, act, info_keys=["is_success"]) as store:
        for i in range(30):
            store.append_episode(make_episode(obs, act, 5 + i % 17, i, ("is_success",)))
    _build(d / "img")
    for name in ("low", "img"):
        pack_store(d / name, d / f"{name}.zip")
    return d


def _same_as_local(remote: EpisodeStore, local: EpisodeStore) -> None:
    """Every episode (crc32 checked) and every sampled batch of ``remote`` is ``local``'s, bit for bit."""
    assert remote.commit_record == local.commit_record and remote.metadata == local.metadata
    for i in range(local.num_episodes):
        assert_episode_equal(remote.episode(i, verify=True), local.episode(i))
    for a, b in zip(_batches(remote), _batches(local)):
        for name in ("actions", "rewards", "terminated", "episode_ids", "steps", "is_relabeled"):
            assert getattr(a, name).equal(getattr(b, name)), name
        for k in a.observations:
            assert a.observations[k].equal(b.observations[k]) and a.next_observations[k].equal(b.next_observations[k])


@pytest.mark.parametrize("name", ["low", "img"])
def test_a_packed_store_opens_in_place_over_http(published, name, capsys):
    """`EpisodeStore.open("http://.../point.zip")` said "is not a her_store store (no Zarr group there)": a packed
    store could be published only to be downloaded. It now opens in place: the zip's end records, central directory and
    local headers are read by ranged GETs, then every member (metadata, index and pack chunks, shards, image frames)
    as a byte range of the zip, through the readers of directory stores over HTTP. Every GET names a range."""
    pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')
    from her_store.ops.inspect import summary
    from her_store.ops.verify import verify

    RecordingHandler.ranges.clear()
    with serving(str(published), RecordingHandler) as base:
        url = f"{base}/{name}.zip"
        with EpisodeStore.open(url) as remote, EpisodeStore.open(published / name) as local:
            assert isinstance(remote.backend, ArchiveBackend) and remote.backend.ranged
            _same_as_local(remote, local)
            with HerSampler(remote, 256, reward_fn=reward_fn, seed=3) as sampler:
                sampler.sample()
                kinds = {type(a) for a in sampler.reader.arrays.values()}
                assert RangedArray in kinds and (FrameArray in kinds) == (name == "img")
                if name == "img":  # frames read by ranges of their shard's member, conditioned on the zip's ETag
                    frames = sampler.reader.arrays["steps/observation"]
                    assert frames._ranged is True and frames.gets > 0
            with pytest.raises(ReadOnlyStoreError):
                remote.append_episode(make_episode(*fetch_spaces(), 3, 0, ("is_success",)))
        with EpisodeStore.open(published / f"{name}.zip") as z, EpisodeStore.open(url) as remote:
            here, there = summary(z), summary(remote)
        for key in ("episodes", "transitions", "apparent_bytes", "index_apparent_bytes", "fields", "card"):
            if key != "fields":
                assert here[key] == there[key], key
        assert [f["apparent_bytes"] for f in here["fields"]] == [f["apparent_bytes"] for f in there["fields"]]
        assert main(["inspect", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["episodes"] == here["episodes"]
        report = verify(url)
        assert report.clean and report.episodes == here["episodes"], report.summary()
    assert RecordingHandler.ranges and None not in RecordingHandler.ranges  # nothing fetched whole


@pytest.mark.slow
def test_a_packed_store_on_s3_opens_in_place(published, s3_url):
    """The same over S3 (moto's server on loopback): the zip object's bytes by ranged GETs conditioned on its ETag."""
    import s3fs

    from her_store.ops.inspect import summary

    url, opts = s3_url
    fs = s3fs.S3FileSystem(**opts)
    bucket = url[len("s3://") :].split("/")[0]
    for name in ("low", "img"):
        fs.put_file(str(published / f"{name}.zip"), f"{bucket}/published/{name}.zip")
        zurl = f"s3://{bucket}/published/{name}.zip"
        with EpisodeStore.open(zurl, storage_options=opts) as remote, EpisodeStore.open(published / name) as local:
            assert isinstance(remote.backend, ArchiveBackend)
            _same_as_local(remote, local)
            with HerSampler(remote, 256, reward_fn=reward_fn, seed=3) as sampler:
                sampler.sample()
                if name == "img":  # frames read by ranges of their shard's member
                    assert sampler.reader.arrays["steps/observation"]._ranged is True
            there, episodes = summary(remote), local.num_episodes
        with EpisodeStore.open(published / f"{name}.zip") as z:
            assert there["apparent_bytes"] == summary(z)["apparent_bytes"] > 0
        with pytest.raises(ReadOnlyStoreError, match="packed store"):
            EpisodeStore.open(zurl, "a", storage_options=opts)
        report = verify(zurl, storage_options=opts)
        assert report.clean and report.episodes == episodes, report.summary()


def test_a_packed_store_over_http_that_is_no_zip_or_whose_server_ignores_range(published, tmp_path):
    """A server without Range would have each member's read fetch the zip up to its end: opening says so at once,
    having read no more than the first bytes. A .zip URL that holds no zip is no store; one where nothing is, is
    looked for as a store directory (a directory may end in .zip), and is none."""
    pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')
    (tmp_path / "notes.zip").write_text("not a zip")
    shutil.copy(published / "low.zip", tmp_path / "low.zip")
    with serving(str(tmp_path), NoRangeHandler) as base, pytest.raises(StoreError, match="Range request with the"):
        EpisodeStore.open(f"{base}/low.zip")
    with serving(str(tmp_path)) as base:
        with pytest.raises(NotAStoreError, match="is not a zip archive"):
            EpisodeStore.open(f"{base}/notes.zip")
        with pytest.raises(NotAStoreError):
            EpisodeStore.open(f"{base}/missing.zip")


@pytest.mark.parametrize("kind", ["offset past the end", "size past the end", "truncated", "deflated", "dotdot"])
def test_a_hostile_archive_over_http_is_refused_as_on_disk(packed, tmp_path, kind):
    """The same checks as a local archive's, each read bounded: no GET asks for more than a record or a header
    (the tail, the central directory, the local headers) before the archive is refused."""
    pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')
    src, _ = packed
    make, message = HOSTILE[kind]
    (tmp_path / "pub").mkdir()
    bad = tmp_path / "pub" / "bad.zip"
    make(src, bad)
    RecordingHandler.ranges.clear()
    with serving(str(tmp_path / "pub"), RecordingHandler) as base, pytest.raises(CorruptStoreError, match=message):
        EpisodeStore.open(f"{base}/bad.zip")
    asked = [re.fullmatch(r"bytes=(\d+)-(\d+)", r) for r in RecordingHandler.ranges]
    assert all(asked), RecordingHandler.ranges
    sizes = [int(m[2]) - int(m[1]) + 1 for m in asked]
    # the first bytes, the end records with the longest comment a zip may have (the directory is smaller), the
    # local headers: one GET each
    members = 0 if kind == "truncated" else len(zipfile.ZipFile(bad).infolist())
    assert max(sizes) <= 22 + 0xFFFF and len(sizes) <= 3 + members, sizes


def test_an_archive_replaced_under_its_reader_over_http_is_refused(published, tmp_path):
    """Every ranged GET of a packed store is conditioned on the zip's ETag when it was opened: a zip replaced at its
    URL (another pack published) under an open reader is a CorruptStoreError, never its new bytes read at the old
    offsets."""
    pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')
    shutil.copy(published / "img.zip", tmp_path / "point.zip")
    with serving(str(tmp_path)) as base, EpisodeStore.open(f"{base}/point.zip") as remote:
        remote.episode(0)
        shutil.copy(published / "low.zip", tmp_path / "new.zip")
        os.replace(tmp_path / "new.zip", tmp_path / "point.zip")
        with pytest.raises(CorruptStoreError, match="replaced since it was opened"):
            remote.episode(1)
