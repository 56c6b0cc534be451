"""her-store verify: each kind of damage is found and named with its episodes; --repair drops it with a new commit."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore, open_store
from her_store.cli.main import main
from her_store.errors import CorruptStoreError
from her_store.ops.repair import repair
from her_store.ops.verify import verify
from her_store.sampling.sampler import HerSampler
from tests.conftest import ROOT, assert_episode_equal, fetch_spaces, make_episode

N = 24  # episodes per store


def _tagged(obs_space, action_space, i: int) -> dict[str, np.ndarray]:
    """Episode ``i`` (10 + i % 7 steps), its observations' first value ``100 + i``, so rows name their episode."""
    ep = make_episode(obs_space, action_space, 10 + i % 7, seed=i)
    ep["observation"] = ep["observation"].copy()
    ep["observation"].reshape(len(ep["observation"]), -1)[:, 0] = 100 + i
    return ep


def _image_spaces() -> tuple[spaces.Dict, spaces.Box]:
    obs = spaces.Dict(
        {
            "observation": spaces.Box(0, 255, (3, 8, 8), np.uint8),
            "achieved_goal": spaces.Box(-1, 1, (2,), np.float32),
            "desired_goal": spaces.Box(-1, 1, (2,), np.float32),
        }
    )
    return obs, spaces.Box(-1, 1, (2,), np.float32)


def _build(path: str, kind: str = "lowdim", capacity: int | None = None, n: int = N) -> dict[int, dict]:
    """A store of ``n`` tagged episodes in chunks (shards) of 64 rows, so that damage hits a few episodes."""
    obs, act = fetch_spaces() if kind == "lowdim" else _image_spaces()
    eps = {i: _tagged(obs, act, i) for i in range(n)}
    with EpisodeStore.create(path, obs, act, chunk_rows=64, capacity=capacity, commit_interval=0) as store:
        for i in range(n):
            store.append_episode(eps[i])
    return eps


def _tag(ep) -> int:
    return int(np.asarray(ep["observation"]).reshape(len(ep["observation"]), -1)[0, 0]) - 100


def _rows_of(path: str, episode_id: int) -> tuple[int, int]:
    with EpisodeStore.open(path) as store:
        t = store.episodes
        k = episode_id - store.first_episode
        return int(t["start_row"][k]), int(t["length"][k])


def _run(*args: str) -> subprocess.CompletedProcess:
    """``her-store verify`` in a process of its own: its exit status."""
    return subprocess.run(
        [sys.executable, "-m", "her_store.cli", "verify", "--quiet", *args], capture_output=True, text=True, timeout=120
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``her-store verify`` through the same entry point, in this process (a subprocess costs seconds here)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", "--quiet", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def _assert_repaired(path: str, eps: dict[int, dict], dropped: set[int]) -> None:
    """Clean; every kept episode bit-identical to what was appended; a sampler never returns a dropped one's rows."""
    assert verify(path).clean
    with EpisodeStore.open(path) as store:
        kept = {}
        for i in range(store.first_episode, store.end_episode):
            ep = store.episode(i)
            kept[_tag(ep)] = ep
        assert not set(kept) & dropped
        for tag, ep in kept.items():
            assert_episode_equal(dict(ep), eps[tag])
        sampler = HerSampler(store, batch_size=512, n_sampled_goal=0, seed=0)
        seen = set()
        for _ in range(4):
            b = sampler.sample()
            for obs in (b.observations["observation"], b.next_observations["observation"]):
                seen |= set((obs.reshape(len(obs), -1)[:, 0].numpy().astype(np.int64) - 100).tolist())
        sampler.close()
        assert seen <= set(kept) and not seen & dropped


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_clean_store_verifies_clean_and_exits_0(tmp_path):
    for kind in ("lowdim", "image"):
        path = str(tmp_path / kind)
        _build(path, kind)
        report = verify(path)
        assert report.clean, report.summary()
        assert report.episodes == N and report.bytes_read > 0
        done = _run(path)
        assert done.returncode == 0 and "clean" in done.stdout, done


@pytest.mark.slow
def test_a_packed_store_verifies_like_its_directory(tmp_path):
    from her_store.ops.pack import pack_store

    for kind, capacity in (("lowdim", None), ("image", 120)):
        path = str(tmp_path / kind)
        _build(path, kind, capacity=capacity)
        pack_store(path, path + ".zip")
        report, packed = verify(path), verify(path + ".zip")
        assert packed.clean, packed.summary()
        assert (packed.episodes, packed.bytes_read) == (report.episodes, report.bytes_read) and packed.episodes > 0
        assert _run(path + ".zip").returncode == 0


def test_a_path_that_is_not_a_store_exits_2(tmp_path):
    (tmp_path / "file").write_text("x")
    os.makedirs(tmp_path / "empty")
    assert _run(str(tmp_path / "empty")).returncode == 2
    done = _cli(str(tmp_path / "file"))
    assert done.returncode == 2 and "not a store" in done.stderr, done


def test_a_flipped_byte_in_a_packed_array_fails_that_episodes_crc_and_repair_drops_it(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path)
    start, T = _rows_of(path, 5)
    with EpisodeStore.open(path) as store:
        spec = store.layout.arrays[0]
    _flip(os.path.join(path, "packs/float32/c", str(start // 64), "0"), (start % 64 + 1) * spec.row_nbytes + 3)
    report = verify(path)
    assert [p.kind for p in report.problems] == ["checksum"] and report.problems[0].episodes == (5,)
    assert report.bad_episodes.tolist() == [5]
    done = _run(path)
    assert done.returncode == 1 and "crc32" in done.stdout and "episodes 5" in done.stdout, done
    done = _cli(path, "--repair")
    assert done.returncode == 0, done
    assert "dropped episode 5" in done.stdout and "episode 6 is now episode 5" in done.stdout
    _assert_repaired(path, eps, {5})
    with EpisodeStore.open(path) as store:
        assert store.num_episodes == N - 1 and store.first_episode == 0


def test_a_flipped_byte_in_a_sharded_image_array_fails_that_episodes_crc(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path, "image")
    start, _ = _rows_of(path, 7)
    shard = os.path.join(path, "steps", "observation", f"c.{start // 64}.0.0.0")
    raw = open(shard, "rb").read()
    from her_store.format.frames import parse_index

    offsets, nbytes = parse_index(raw, 64, shard)
    r = start % 64 + 2
    _flip(shard, int(offsets[r] + nbytes[r] // 2))
    report = verify(path)
    assert report.bad_episodes.tolist() == [7], report.summary()
    assert _cli(path).returncode == 1
    final = repair(path, log=lambda line: None)
    assert final.clean
    _assert_repaired(path, eps, {7})


def test_a_truncated_chunk_file_is_named_with_the_episodes_past_its_end(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path)
    start, T = _rows_of(path, 8)  # chunk 2 (rows 128..191) holds episodes 7..11 or so
    name = os.path.join(path, "packs/float32/c/2/0")
    with EpisodeStore.open(path) as store:
        rb = store.layout.arrays[0].row_nbytes
        table = store.episodes
    cut = 20
    os.truncate(name, cut * rb)
    report = verify(path)
    ends = table["start_row"] + table["length"] + 1
    past = [int(i) for i, s, e in zip(table["episode_id"], table["start_row"], ends) if e > 128 + cut and s < 192]
    files = [p for p in report.problems if p.kind == "file"]
    assert len(files) == 1 and "holds" in files[0].what and list(files[0].episodes) == past
    assert report.bad_episodes.tolist() == past
    assert _cli(path).returncode == 1
    log: list[str] = []
    assert repair(path, log=log.append).clean
    assert os.path.getsize(name) == 64 * rb
    assert any("dropped episode" in line for line in log)
    _assert_repaired(path, eps, set(past))


def test_a_missing_chunk_file_drops_the_episodes_with_rows_in_it(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path)
    os.unlink(os.path.join(path, "packs/float32/c/1/0"))
    report = verify(path)
    files = [p for p in report.problems if p.kind == "file"]
    assert len(files) == 1 and "is missing" in files[0].what
    assert report.bad_episodes.tolist() == list(files[0].episodes) and len(files[0].episodes) >= 3
    assert _cli(path).returncode == 1
    done = _cli(path, "--repair")
    assert done.returncode == 0, done
    _assert_repaired(path, eps, set(files[0].episodes))


def test_a_directory_in_place_of_a_chunk_file_drops_its_episodes_and_repair_removes_it(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path)
    name = os.path.join(path, "packs/float32/c/1/0")
    os.unlink(name)
    os.makedirs(os.path.join(name, "inside"))
    report = verify(path)
    files = [p for p in report.problems if p.kind == "file"]
    assert len(files) == 1 and "packs/float32/c/1/0" in str(files[0]), report.summary()
    assert report.bad_episodes.tolist() == list(files[0].episodes) and len(files[0].episodes) >= 3
    done = _cli(path, "--repair")
    assert done.returncode == 0 and "removed packs/float32/c/1 (" in done.stdout, done
    assert os.path.isfile(name)  # the episodes moved after the cut were written again into a chunk file of its own
    _assert_repaired(path, eps, set(files[0].episodes))


def test_a_shard_with_a_damaged_index_drops_its_episodes_and_is_removed(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path, "image")
    shard = os.path.join(path, "steps/observation/c.1.0.0.0")
    _flip(shard, os.path.getsize(shard) - 10)
    report = verify(path)
    files = [p for p in report.problems if p.kind == "file"]
    assert len(files) == 1 and "crc32c" in files[0].what
    assert report.bad_episodes.tolist() == list(files[0].episodes)
    assert _cli(path).returncode == 1
    assert repair(path, log=lambda line: None).clean
    _assert_repaired(path, eps, set(files[0].episodes))


@pytest.mark.slow
def test_index_and_rows_past_the_commit_are_reported_and_cleared(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path, "image", n=N)
    record = open(os.path.join(path, "commit.json"), "rb").read()
    with EpisodeStore.open(path, mode="a") as store:  # a commit whose record is then lost: the tail stays on disk
        for i in range(N, N + 3):
            store.append_episode(_tagged(store.observation_space, store.action_space, i))
    open(os.path.join(path, "commit.json"), "wb").write(record)
    holder = subprocess.Popen(  # while a live writer holds the lock, rows past the commit are its work in progress
        [sys.executable, "-c", "import sys; from her_store import EpisodeStore\n"
         "s = EpisodeStore.open(sys.argv[1], mode='a'); print('held', flush=True); sys.stdin.read()", path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        live = verify(path)
        assert live.clean and any("being written by pid" in n for n in live.notes), live.summary()
        assert _cli(path).returncode == 0
    finally:
        holder.kill()
        holder.communicate()
    closed = subprocess.Popen(  # a process that closed its writer (the record still names it) is writing nothing
        [sys.executable, "-c", ("import sys; from her_store import EpisodeStore\n"
         "EpisodeStore.open(sys.argv[1], mode='a').close(); print('closed', flush=True); sys.stdin.read()"), path],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        assert closed.stdout.readline().strip() == "closed"
        assert f'"pid": {closed.pid}' in Path(path, "writer.lock").read_text()
        report = verify(path)
        assert {p.kind for p in report.problems} == {"uncommitted"} and not report.notes, report.summary()
    finally:
        closed.kill()
        closed.communicate()
    report = verify(path)
    assert {p.kind for p in report.problems} == {"uncommitted"} and not report.notes
    assert report.tail_positions == [N, N + 1, N + 2]
    assert set(report.tail_chunks) == {"packs/float32", "packs/bool", "steps/observation"}
    assert f"episodes {N}..{N + 2}" in report.summary()
    from her_store.ops.pack import pack_store

    pack_store(path, path + ".zip")  # the shards listed as the archive's members, not as files
    packed = verify(path + ".zip")  # (an archive's uncompressed chunks hold zeros past the commit: none to report)
    assert packed.tail_chunks == {"steps/observation": report.tail_chunks["steps/observation"]}
    assert not packed.tail_positions
    assert _cli(path).returncode == 1
    done = _cli(path, "--repair")
    assert done.returncode == 0 and "cleared past the commit" in done.stdout, done
    _assert_repaired(path, eps, set())
    with EpisodeStore.open(path) as store:
        assert store.end_episode == N


JUNK = {  # what may be found at a chunk key past the commit, per kind of array
    "image": ["garbage", "directory", "file link", "outside file link", "fifo"],
    "lowdim": [
        "directory", "file link", "outside file link", "outside directory link", "file for its directory", "fifo"
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("capacity", [None, 4096], ids=["unbounded", "ring"])
@pytest.mark.parametrize("kind, what", [(k, w) for k, ws in JUNK.items() for w in ws])
def test_an_unreadable_chunk_past_the_commit_is_reported_and_removed_so_the_store_can_be_appended_to(
    tmp_path, kind, what, capacity
):
    """What a crash, or whoever made the store, can leave at the key of a chunk (a shard, a raw pack chunk) that holds
    no committed row: a writer reads or writes the chunk it appends to, so each would fail it, or write through a link
    to outside the store. verify reports it, repair removes it (a link itself, never what it names), and appends
    reach the chunk's rows; nothing outside the store is touched. A ring not yet full has such chunks too."""
    path = str(tmp_path / "s")
    eps = _build(path, kind, capacity=capacity, n=N)
    with EpisodeStore.open(path) as store:
        spec = next(a for a in store.layout.arrays if a.sharded == (kind == "image") and a.path != "packs/bool")
        w = store.commit_record.write_row
    c = w // spec.chunk_rows + 1  # the chunk after the one the next append writes into
    key, entry = spec.chunk_key(c), spec.chunk_entry(c)
    target = os.path.join(path, key)
    outside = tmp_path / "outside"
    (outside / "dir").mkdir(parents=True)
    (outside / "dir" / "0").write_bytes(b"\x05" * 100)
    (outside / "file").write_bytes(b"\x06" * 100)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    os.makedirs(os.path.dirname(os.path.join(path, entry)), exist_ok=True)
    if entry != key:
        os.makedirs(os.path.dirname(target), exist_ok=True)
    if what == "garbage":
        Path(target).write_bytes(b"\x07" * 100)
    elif what == "directory":
        os.makedirs(os.path.join(target, "x"))
    elif what == "file link":
        os.symlink(os.path.join(path, "commit.json"), target)
    elif what == "outside file link":
        os.symlink(outside / "file", target)
    elif what == "outside directory link":
        os.rmdir(os.path.join(path, entry))
        os.symlink(outside / "dir", os.path.join(path, entry))
    elif what == "file for its directory":
        os.rmdir(os.path.join(path, entry))
        Path(path, entry).write_bytes(b"\x08" * 100)
    else:
        os.mkfifo(target)
    report = verify(path)
    assert [p.kind for p in report.problems] == ["uncommitted"] and key in report.summary(), report.summary()
    assert report.junk_chunks == {spec.path: [c]} and not report.tail_chunks
    with pytest.raises(CorruptStoreError), EpisodeStore.open(path, mode="a") as store:  # refused, not written through
        for i in range(N, N + 12):
            store.append_episode(_tagged(store.observation_space, store.action_space, i))
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before
    done = _cli(path, "--repair")
    assert done.returncode == 0 and "cleared past the commit" in done.stdout, done
    assert not os.path.lexists(os.path.join(path, entry))
    _assert_repaired(path, eps, set())
    with EpisodeStore.open(path, mode="a") as store:  # appends reach the chunk's rows
        for i in range(N, N + 12):
            eps[i] = _tagged(store.observation_space, store.action_space, i)
            store.append_episode(eps[i])
        assert store.commit_record.write_row > (c + 1) * spec.chunk_rows
    _assert_repaired(path, eps, set())
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


def test_a_torn_commit_record_is_reported_and_not_repaired(tmp_path):
    path = str(tmp_path / "s")
    _build(path)
    name = os.path.join(path, "commit.json")
    raw = open(name, "rb").read()
    open(name, "wb").write(raw[: len(raw) // 2])
    report = verify(path)
    assert [p.kind for p in report.problems] == ["open"] and "commit" in report.problems[0].what
    done = _cli(path)
    assert done.returncode == 1 and "cannot be opened" in done.stdout, done
    done = _cli(path, "--repair")
    assert done.returncode == 1 and "cannot be repaired" in done.stdout, done
    assert open(name, "rb").read() == raw[: len(raw) // 2]


def test_repair_of_a_ring_evicts_a_bad_first_episode_and_cuts_at_a_later_one(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path, capacity=200, n=40)  # a ring that has wrapped
    with EpisodeStore.open(path) as store:
        first, end = store.first_episode, store.end_episode
        rb = store.layout.arrays[0].row_nbytes
    assert first > 0
    for i in (first, end - 4):
        start, _ = _rows_of(path, i)
        _flip(os.path.join(path, "packs/float32/c", str(start // 64), "0"), (start % 64) * rb + 1)
    assert verify(path).bad_episodes.tolist() == [first, end - 4]
    log: list[str] = []
    assert repair(path, log=log.append).clean
    assert f"dropped episode {first}" in log and f"dropped episode {end - 4}" in log
    _assert_repaired(path, eps, {first, end - 4})
    with EpisodeStore.open(path) as store:
        assert store.first_episode == first + 1 and store.end_episode == end - 1


def test_repair_refuses_object_storage(s3_url):
    url, opts = s3_url
    with pytest.raises(Exception, match="local disk"):
        repair(url)


def test_a_repair_stopped_half_way_loses_nothing_and_the_next_repair_finishes_it(tmp_path):
    path = str(tmp_path / "s")
    eps = _build(path, n=40)
    start, _ = _rows_of(path, 6)
    with EpisodeStore.open(path) as store:
        spec = store.layout.arrays[0]
    _flip(os.path.join(path, "packs/float32/c", str(start // 64), "0"), (start % 64 + 1) * spec.row_nbytes + 3)
    assert verify(path).bad_episodes.tolist() == [6]
    moved = []

    def stops_after_two(line: str) -> None:  # the process dies once two moved episodes were appended again
        if "is now episode" in line:
            moved.append(line)
            if len(moved) == 2:
                raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        repair(path, log=stops_after_two)
    report = verify(path)
    waiting = [p for p in report.problems if p.kind == "repair"]  # (beside the tail past the cut's commit)
    assert len(waiting) == 1 and "31 good episodes" in str(waiting[0]) and "--repair" in str(waiting[0])
    assert _run(path).returncode == 1
    lines: list[str] = []
    final = repair(path, log=lines.append)
    assert final.clean and not os.path.exists(str(tmp_path / ".s.repair"))
    assert "episode 9 is now episode 8" in lines  # the third moved episode, where the first repair stopped
    with EpisodeStore.open(path) as s:
        tags = [_tag(s.episode(i)) for i in range(s.first_episode, s.end_episode)]
    assert tags == [i for i in range(40) if i != 6]
    for i, t in zip(range(len(tags)), tags):
        with EpisodeStore.open(path) as s:
            assert_episode_equal(s.episode(i), eps[t])


@pytest.mark.parametrize("kind", ["file", "fifo", "link"])
def test_a_chunk_directory_replaced_is_reported_and_repaired_without_reaching_through_it(tmp_path, kind):
    """``packs/float32/c`` (every chunk of the array) replaced by a file, a FIFO, or a link to a copy outside the store:
    verify raised a raw NotADirectoryError, and a repair dropped every episode, then failed removing the chunks
    through the link, leaving a store no append could write to. Now every episode with rows there is reported, a
    repair drops them and removes what is in the directory's place (a link itself), and appends work again."""
    path = str(tmp_path / "s")
    eps = _build(path)
    c = os.path.join(path, "packs", "float32", "c")
    outside = tmp_path / "outside"
    shutil.copytree(c, outside)
    shutil.rmtree(c)
    if kind == "file":
        Path(c).write_bytes(b"junk")
    elif kind == "fifo":
        os.mkfifo(c)
    else:
        os.symlink(outside, c)
    before = {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()}
    report = verify(path)
    assert set(report.bad_episodes.tolist()) == set(range(N)), report.summary()
    done = _cli(path, "--repair")
    assert done.returncode == 0, done
    assert not os.path.lexists(c) or os.path.isdir(c) and not os.path.islink(c)
    with EpisodeStore.open(path, mode="a") as store:
        assert store.num_episodes == 0
        for i in range(N, N + 6):
            eps[i] = _tagged(store.observation_space, store.action_space, i)
            store.append_episode(eps[i])
    _assert_repaired(path, eps, set(range(N)))
    assert {p: p.read_bytes() for p in outside.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("where", ["past the commit", "committed"])
def test_a_raw_chunk_with_another_name_is_reported_and_given_a_copy_of_its_own(tmp_path, where):
    """A raw chunk file with another (hard) link: the writer, which writes rows in place, refuses it. Past the commit
    (all zeros, so neither unreadable nor a tail) verify called the store clean and it could never be appended to
    again; committed, the same. verify reports it; repair removes it (past the commit) or gives the store its own copy
    (committed, its rows kept); appends work and the other name's file is unchanged."""
    path = str(tmp_path / "s")
    eps = _build(path)
    with EpisodeStore.open(path) as store:
        spec, w = store.layout.arrays[0], store.commit_record.write_row
    c = w // spec.chunk_rows + (1 if where == "past the commit" else 0)
    name = os.path.join(path, spec.chunk_key(c))
    os.makedirs(os.path.dirname(name), exist_ok=True)
    if where == "past the commit":
        Path(name).write_bytes(bytes(spec.chunk_rows * spec.row_nbytes))
    other = tmp_path / "other"
    os.link(name, other)
    before = other.read_bytes()
    report = verify(path)
    assert not report.clean and spec.chunk_key(c) in report.summary(), report.summary()
    if where == "past the commit":
        assert report.junk_chunks == {spec.path: [c]}
    else:
        assert report.linked_files == [spec.chunk_key(c)]
    done = _cli(path, "--repair")
    assert done.returncode == 0, done
    _assert_repaired(path, eps, set())
    with EpisodeStore.open(path, mode="a") as store:
        for i in range(N, N + 12):
            eps[i] = _tagged(store.observation_space, store.action_space, i)
            store.append_episode(eps[i])
        assert store.commit_record.write_row > (c + 1) * spec.chunk_rows
    _assert_repaired(path, eps, set())
    assert other.read_bytes() == before and other.stat().st_nlink == 1


def test_a_raw_chunk_is_checksummed_piece_by_piece(tmp_path, monkeypatch):
    """Raw chunks are read and checksummed a piece at a time (PIECE_BYTES of whole rows): episodes spanning pieces
    verify clean, a flipped byte fails its episode alone, and a chunk cut short names the episodes past the cut once,
    whichever piece the cut falls in."""
    import her_store.ops.verify as verify_mod

    path = str(tmp_path / "s")
    _build(path)
    with EpisodeStore.open(path) as store:
        rb = store.layout.arrays[0].row_nbytes
        table = store.episodes
    monkeypatch.setattr(verify_mod, "PIECE_BYTES", 3 * rb + 5)  # 3 rows a piece: every episode spans pieces
    monkeypatch.setattr(verify_mod, "READ_AHEAD", 4 * rb)
    assert verify(path).clean
    start, _ = _rows_of(path, 9)
    _flip(os.path.join(path, "packs/float32/c", str(start // 64), "0"), (start % 64 + 4) * rb + 1)
    assert verify(path).bad_episodes.tolist() == [9]
    _flip(os.path.join(path, "packs/float32/c", str(start // 64), "0"), (start % 64 + 4) * rb + 1)
    cut = 29  # in the tenth piece of chunk 1
    os.truncate(os.path.join(path, "packs/float32/c/1/0"), cut * rb)
    report = verify(path)
    ends = table["start_row"] + table["length"] + 1
    past = [int(i) for i, s, e in zip(table["episode_id"], table["start_row"], ends) if e > 64 + cut and s < 128]
    files = [p for p in report.problems if p.kind == "file"]
    assert len(files) == 1 and "holds" in files[0].what and list(files[0].episodes) == past, report.summary()
    assert report.bad_episodes.tolist() == past


def test_verify_holds_a_few_pieces_of_a_chunk_at_a_time_not_the_chunk(tmp_path, monkeypatch):
    """A raw chunk holds up to 1,048,576 rows (a GiB of rows of 1 KiB): verify read each whole into memory. It now
    holds what it reads ahead (READ_AHEAD) and the piece it checks, whatever the chunk's size."""
    import tracemalloc

    import her_store.ops.verify as verify_mod

    path = str(tmp_path / "s")
    obs, act = fetch_spaces()
    with EpisodeStore.create(path, obs, act, chunk_rows=1 << 16, commit_interval=0) as store:
        for i in range(600):
            store.append_episode(make_episode(obs, act, 100, seed=i))
        chunk_bytes = store.commit_record.write_row * store.layout.arrays[0].row_nbytes
    assert chunk_bytes > 4 << 20  # the committed rows of the float32 pack's one chunk
    monkeypatch.setattr(verify_mod, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(verify_mod, "READ_AHEAD", 256 << 10)
    monkeypatch.setattr(verify_mod, "SPARE_BYTES", 512 << 10)
    with EpisodeStore.open(path):  # imports and zarr's first-use allocations, outside the measure
        pass
    tracemalloc.start()
    try:
        report = verify(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.clean and report.bytes_read >= chunk_bytes
    assert peak < chunk_bytes // 4, f"{peak:,} bytes at the peak, for {chunk_bytes:,} bytes of rows in one chunk"


@pytest.mark.parametrize("where", ["at write_row", "past a hole"])
def test_bytes_past_write_row_are_found_in_a_chunk_s_data_past_its_holes(tmp_path, where):
    """Past write_row, a raw chunk's rows are holes (never written) unless a commit stopped there; verify reads only
    the file's data there (SEEK_DATA, SEEK_HOLE), and still finds a byte written anywhere past write_row."""
    path = str(tmp_path / "s")
    obs, act = fetch_spaces()
    with EpisodeStore.create(path, obs, act, chunk_rows=1 << 14, commit_interval=0) as store:
        for i in range(8):
            store.append_episode(make_episode(obs, act, 12, seed=i))
        spec, w = store.layout.arrays[0], store.commit_record.write_row
    assert verify(path).clean
    name = os.path.join(path, spec.chunk_key(0))
    at = w * spec.row_nbytes if where == "at write_row" else os.path.getsize(name) - 3
    _flip(name, at)
    report = verify(path)
    assert report.tail_chunks == {spec.path: [0]}, report.summary()
    assert repair(path, log=lambda line: None).clean


def test_a_chunk_whose_later_piece_cannot_be_read_is_reported_as_that_alone_and_repaired(tmp_path, monkeypatch):
    """A read error in a piece after the first (a bad sector) of a chunk with another hard link: the chunk was listed as
    linked by its first piece and as unreadable by the later one, and repair removed it, then failed copying it
    (FileNotFoundError) after committing the drop. Its file checks now wait for its last piece: it is reported as
    unreadable alone, as a chunk read whole was, and repair drops its episodes and ends clean."""
    import errno

    import her_store.ops.verify as verify_mod

    path = str(tmp_path / "s")
    eps = _build(path)
    with EpisodeStore.open(path) as store:
        spec, w = store.layout.arrays[0], store.commit_record.write_row
    c = (w - 1) // spec.chunk_rows  # the last chunk: its episodes end the live range
    name = os.path.join(path, spec.chunk_key(c))
    os.link(name, tmp_path / "other")
    rb = spec.row_nbytes
    monkeypatch.setattr(verify_mod, "PIECE_BYTES", 3 * rb)
    st = os.stat(name)
    bad_byte = 7 * rb + 3  # in the third piece
    real_preadv = os.preadv

    def preadv(fd, buffers, offset, *flags):  # the bad sector: any read covering it fails
        s = os.fstat(fd)
        if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino) and offset <= bad_byte < offset + sum(map(len, buffers)):
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", preadv)
    report = verify(path)
    assert [p.kind for p in report.problems] == ["file"], report.summary()
    assert "cannot be read" in report.problems[0].what, report.summary()
    assert report.linked_files == [] and report.short_files == []
    dropped = set(report.bad_episodes.tolist())
    assert dropped and max(dropped) == N - 1
    assert repair(path, log=lambda line: None).clean
    monkeypatch.undo()
    _assert_repaired(path, eps, dropped)


def test_bytes_past_a_chunk_s_rows_are_no_uncommitted_rows(tmp_path):
    """A file longer than its chunk's rows, past write_row: the bytes past its rows belong to no row, so they are
    not reported as rows that were never committed (they were, when the whole file was read for them)."""
    path = str(tmp_path / "s")
    _build(path)
    with EpisodeStore.open(path) as store:
        spec, w = store.layout.arrays[0], store.commit_record.write_row
    chunk_bytes = spec.chunk_rows * spec.row_nbytes
    name = os.path.join(path, spec.chunk_key(w // spec.chunk_rows + 1))
    os.makedirs(os.path.dirname(name), exist_ok=True)
    Path(name).write_bytes(bytes(chunk_bytes) + b"\x01")
    report = verify(path)
    assert not report.tail_chunks, report.summary()


def test_large_read_buffers_are_used_again_and_kept_within_their_bound(tmp_path, monkeypatch):
    """A large buffer (mapped afresh by malloc: a page fault per 4 KiB read into it) is given back after its piece is
    checked and serves the next read it holds; small ones are not kept; no more than SPARE_BYTES are kept."""
    import her_store.ops.verify as verify_mod

    path = str(tmp_path / "s")
    _build(path)
    monkeypatch.setattr(verify_mod, "SPARE_BYTES", 3 << 20)
    with EpisodeStore.open(path) as store:
        check = verify_mod._Check(store, True, False)
    big = check._buffer(1 << 20)
    check._give_back(memoryview(big)[:10])
    assert check._buffer(900 << 10) is big
    check._give_back(memoryview(big))
    assert check._buffer(2 << 20) is not big  # too small for it: a new one
    small = check._buffer(10 << 10)
    check._give_back(memoryview(small))
    assert all(b is not small for b in check._spare)
    for _ in range(5):
        check._give_back(memoryview(np.empty(1 << 20, np.uint8)))
    assert sum(b.nbytes for b in check._spare) <= 3 << 20


def test_repair_keeps_the_priorities_of_the_episodes_it_appends_again_and_drops_the_td_checkpoint(tmp_path):
    path = str(tmp_path / "s")
    obs, act = fetch_spaces()
    with open_store(path, obs, act, chunk_rows=64, priority_fn=lambda ep: 100.0 + float(ep["action"][0, 0] > 9)) as s:
        for i in range(8):
            ep = make_episode(obs, act, 6, i)
            ep["action"][0, 0] = 10.0 + i  # priority 101 for every episode, not what the default energy gives
            s.append_episode(ep)
        s.append_episode(make_episode(obs, act, 6, 8), priority=7.5)  # given: priority_fn not called
    with EpisodeStore.open(path) as store:
        sampler = HerSampler(store, 16, prioritize="td", n_sampled_goal=0)
        sampler.sample()
        sampler.close()
        spec = store.layout.arrays[0]
    assert os.path.exists(os.path.join(path, "priorities", "manifest.json"))
    start, _ = _rows_of(path, 3)
    _flip(os.path.join(path, "packs/float32/c", str(start // 64), "0"), (start % 64 + 1) * spec.row_nbytes + 3)
    done = _cli(path, "--repair")
    assert done.returncode == 0, done
    assert "removed the priorities checkpoint" in done.stdout
    with EpisodeStore.open(path) as store:
        assert store.episodes["priority"].tolist() == [101.0] * 7 + [7.5]
    assert not os.path.exists(os.path.join(path, "priorities", "manifest.json"))
