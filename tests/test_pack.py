"""Packed stores: her-store pack, the archive's layout, opening and sampling it in place, and hostile archives."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from gymnasium import spaces

from her_store import CorruptStoreError, EpisodeStore, HerSampler, NotAStoreError, ReadOnlyStoreError, open_store
from her_store.cli import main
from her_store.pack import ALIGNMENT, PackedArchive, pack_store
from her_store.storage import data_runs
from tests.conftest import assert_episode_equal, fetch_spaces, make_episode

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
    assert all(offset % ALIGNMENT == 0 for offset, _ in archive.members.values())
    raw = zpath.read_bytes()
    for key, (offset, size) in archive.members.items():
        assert raw[offset : offset + size] == (src / key).read_bytes(), key


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
    from her_store.reader import ChunkReader

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
    root = str(Path(__file__).resolve().parents[1])
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
    from her_store.verify import verify

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
    from her_store.inspection import summary

    src = _build(tmp_path / "s")
    pack_store(src, tmp_path / "s.zip")
    with EpisodeStore.open(src) as d, EpisodeStore.open(tmp_path / "s.zip") as z:
        unpacked, packed = summary(d), summary(z)
    assert packed["bytes_on_disk"] == unpacked["bytes_on_disk"] > 0
    assert [f["bytes_on_disk"] for f in packed["fields"]] == [f["bytes_on_disk"] for f in unpacked["fields"]]


# -- sparse files: an uncompressed array's chunk files hold holes where no row was written yet --------------------------


def _disk(path: Path) -> tuple[int, int]:
    """(size, bytes on disk) of a file, or of the files under a directory."""
    found = [p.stat() for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file()]
    return sum(st.st_size for st in found), sum(st.st_blocks * 512 for st in found)


def test_an_archive_is_as_sparse_as_its_store_and_reads_bit_exact(tmp_path):
    """A store whose uncompressed chunks of 65,536 rows hold about 300 rows: the archive leaves the rest holes, as the
    store does, with every member's CRC-32 (zeros included) right for zipfile and zarr's ZipStore."""
    obs, act = fetch_spaces()
    src = tmp_path / "store"
    with EpisodeStore.create(src, obs, act, chunk_rows=1 << 16) as store:
        for i in range(EPISODES):
            store.append_episode(make_episode(obs, act, 3 + i % 11, i))
    size, disk = _disk(src)
    if disk * 4 > size:
        pytest.skip("this file system keeps no holes")
    zpath = tmp_path / "store.zip"
    assert main(["pack", str(src), str(zpath), "--quiet"]) == 0
    zsize, zdisk = _disk(zpath)
    assert zsize > size - 4096 and zdisk < disk + 64 * 1024  # the holes counted in its size, not stored
    with zipfile.ZipFile(zpath) as zf:
        assert zf.testzip() is None
    theirs = zarr.open_group(zarr.storage.ZipStore(zpath, mode="r"), mode="r")
    mine = zarr.open_group(src, mode="r")
    np.testing.assert_array_equal(theirs["packs/float32"][:], mine["packs/float32"][:])
    with EpisodeStore.open(zpath) as z:
        for i in range(EPISODES):
            assert_episode_equal(z.episode(i, verify=True), make_episode(obs, act, 3 + i % 11, i))


def test_data_runs_leave_out_holes_and_are_the_whole_file_where_the_file_system_cannot_tell(tmp_path):
    path = tmp_path / "sparse"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 1 << 22)
        os.pwrite(fd, b"rows", 1 << 21)
        runs = data_runs(fd, 1 << 22)
        if sum(b - a for a, b in runs) == 1 << 22:
            pytest.skip("this file system keeps no holes")
        assert len(runs) == 1 and runs[0][0] <= 1 << 21 and runs[0][1] >= (1 << 21) + 4 and runs[0][1] - runs[0][0] <= 1 << 16
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
