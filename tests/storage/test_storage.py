"""her_store.storage: the writer lock and lease (lease_ttl checks, fenced take-over, the no-If-Match fallback),
atomic and staged writes, chunk names, and files shared by readers."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from her_store import EpisodeStore, open_store
from her_store.errors import StoreLockedError
from her_store.storage import open_backend
from tests.conftest import ROOT, assert_episode_equal, fetch_spaces, make_episode


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "60", True, None])
def test_lease_ttl_must_be_a_positive_number(store_path, fetch, bad):
    obs, act = fetch
    shown = repr(float(bad)) if isinstance(bad, float) else repr(bad)
    with pytest.raises(
        ValueError, match=rf"lease_ttl must be a finite real number > 0(, not (a \w+|None))?: got {re.escape(shown)}$"
    ):
        EpisodeStore.create(store_path, obs, act, lease_ttl=bad)
    EpisodeStore.create(store_path, obs, act, lease_ttl=0.5).close()
    with pytest.raises(ValueError, match="lease_ttl must be"):
        EpisodeStore.open(store_path, mode="a", lease_ttl=bad)
    with pytest.raises(ValueError, match="lease_ttl must be"):
        open_store(store_path, obs, act, lease_ttl=bad)
    with open_store(store_path, obs, act, lease_ttl=10) as store:  # the failed opens left the lock free
        assert store.num_episodes == 0


def _lease_record(host: str, expires: float) -> bytes:
    record = {"pid": 1, "host": host, "token": uuid.uuid4().hex, "since": time.time(), "expires": expires}
    return json.dumps(record).encode()


def test_a_lost_lease_is_refused_where_if_match_is_ignored(fetch):
    """fsspec's memory filesystem ignores If-Match: the lease falls back to comparing its token before each write."""
    obs, act = fetch
    url = f"memory://her-store-lease-{uuid.uuid4().hex}"
    with EpisodeStore.create(url, obs, act, lease_ttl=600, commit_interval=0) as store:
        kept = make_episode(obs, act, 4, seed=0)
        store.append_episode(kept)
    a = EpisodeStore.open(url, mode="a", lease_ttl=600, commit_interval=3600)
    a.append_episode(make_episode(obs, act, 6, seed=1))
    loc = open_backend(url)
    other = _lease_record("elsewhere", time.time() + 600)  # another writer broke the lease and holds it
    loc.put("writer.lock", other)
    with pytest.raises(StoreLockedError, match="lost its writer lease writer.lock to pid 1 on host elsewhere"):
        a.flush()
    with pytest.raises(StoreLockedError):
        a.close()
    assert loc.read_bytes("writer.lock") == other  # closing left the other writer's lease alone
    with EpisodeStore.open(url) as store:
        assert store.num_episodes == 1
        assert_episode_equal(store.episode(0), kept)
    loc.remove("writer.lock")
    EpisodeStore.open(url, mode="a").close()
    assert not loc.exists("writer.lock")  # a writer that still holds its lease removes it on close


def test_two_writers_taking_over_one_stale_lease_on_s3(s3_url, monkeypatch):
    """B takes the stale lease over between A's read of it and A's write: A's write, conditioned on the ETag it
    read, fails, and A is refused instead of overwriting (or deleting) B's fresh lease."""
    url, opts = s3_url
    loc = open_backend(url, opts)
    loc.make_root()
    loc.put("writer.lock", _lease_record("elsewhere", time.time() - 1))
    a = open_backend(url, opts).writer_lock("writer.lock", lease_ttl=60)
    b = open_backend(url, opts).writer_lock("writer.lock", lease_ttl=60)
    read, taken = a.backend.read_bytes, []

    def read_then_b_takes_over(key: str) -> bytes | None:
        raw = read(key)
        if not taken:
            b.acquire()
            taken.append(b)
        return raw

    monkeypatch.setattr(a.backend, "read_bytes", read_then_b_takes_over)
    with pytest.raises(StoreLockedError, match=rf"pid {os.getpid()}"):
        a.acquire()
    b.ensure_held()  # B still holds it: its lease is as B last wrote it
    b.release()
    a.release()


_FSIZE_WRITER = """
import resource, signal, sys
sys.path.insert(0, sys.argv[1])
from her_store import open_store
from tests.conftest import fetch_spaces, make_episode
obs, act = fetch_spaces(2, 1, 1)
store = open_store(sys.argv[2], obs, act, commit_interval=0)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the kernel then cuts writes short and fails them with EFBIG
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
try:
    store.append_episode(make_episode(obs, act, 3, seed=99))
except OSError as e:
    print("refused", e.errno)
"""


def test_a_write_the_kernel_cuts_short_never_replaces_the_commit_record(store_path):
    """A file size limit makes the kernel write only part of a file that would pass it (a disk filling up does the
    same). Here every chunk file is smaller than the limit and the new commit record larger: the record's write is
    cut short, and the old record must stay in place, whole, with no temp file left behind."""
    obs, act = fetch_spaces(2, 1, 1)
    eps = [make_episode(obs, act, 3, seed=i) for i in range(2)]
    with EpisodeStore.create(store_path, obs, act, capacity=10, chunk_rows=2, commit_interval=0) as store:
        for e in eps:
            store.append_episode(e)
    record = open(os.path.join(store_path, "commit.json"), "rb").read()
    limit = len(record) - 16
    largest = max(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(store_path) for f in fs if "/c/" in d + "/"
    )
    assert largest < limit
    root = ROOT
    out = subprocess.run(
        [sys.executable, "-c", _FSIZE_WRITER, root, store_path, str(limit)], capture_output=True, text=True, timeout=120
    )
    assert "refused 27" in out.stdout, out.stdout + out.stderr  # EFBIG, after the short write was finished
    assert open(os.path.join(store_path, "commit.json"), "rb").read() == record
    assert not [n for n in os.listdir(store_path) if n.endswith(".tmp")]
    with EpisodeStore.open(store_path, mode="a") as store:
        assert store.end_episode == 2
        for i, e in enumerate(eps):
            assert_episode_equal(store.episode(i), e)


def test_write_all_finishes_short_writes_and_refuses_a_full_device(tmp_path, monkeypatch):
    from her_store.storage.files import write_all

    name = str(tmp_path / "f")
    fd = os.open(name, os.O_RDWR | os.O_CREAT)
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda f, b, o: real(f, memoryview(b)[:3], o))  # three bytes at a time
    write_all(fd, b"0123456789", 5)
    monkeypatch.setattr(os, "pwrite", lambda f, b, o: 0)  # the device takes nothing more
    with pytest.raises(OSError, match="wrote 0 of 4 bytes"):
        write_all(fd, b"abcd", 0)
    monkeypatch.undo()
    os.close(fd)
    assert open(name, "rb").read() == b"\0" * 5 + b"0123456789"


def test_a_failed_commit_record_write_leaves_no_temp_file(store_path, fetch, monkeypatch):
    obs, act = fetch
    store = EpisodeStore.create(store_path, obs, act, commit_interval=0)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(5, "Input/output error")))
    with pytest.raises(OSError):
        store.append_episode(make_episode(obs, act, 4, seed=0))
    monkeypatch.undo()
    assert sorted(os.listdir(store_path)) == ["commit.json", "episodes", "packs", "writer.lock", "zarr.json"]
    assert store.append_episode(make_episode(obs, act, 4, seed=1)) == 0  # the failed call left no trace
    store.close()
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == 1
        assert_episode_equal(store.episode(0), make_episode(obs, act, 4, seed=1))


def test_staged_output_renames_on_success_and_leaves_nothing_on_failure(tmp_path):
    from her_store.storage.files import staged_output

    dest = tmp_path / "out"
    with pytest.raises(RuntimeError, match="half-way"):
        with staged_output(dest) as tmp:
            os.makedirs(tmp)
            (open(os.path.join(tmp, "part"), "wb")).close()
            raise RuntimeError("half-way")
    assert os.listdir(tmp_path) == []  # neither dest nor the temporary directory
    with staged_output(dest) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and tmp != str(dest)
        os.makedirs(tmp)
        assert not dest.exists()  # invisible until the block succeeds
    assert os.listdir(tmp_path) == ["out"]
    with pytest.raises(FileExistsError, match="nothing was overwritten"):
        with staged_output(dest):
            pass
    with pytest.raises(FileNotFoundError, match="does not exist"):
        with staged_output(tmp_path / "missing" / "out.npz"):
            pass


def test_staged_output_never_overwrites_a_dest_that_appeared_meanwhile(tmp_path):
    from her_store.storage.files import staged_output

    dest = tmp_path / "out.npz"
    with pytest.raises(FileExistsError, match="appeared while"):
        with staged_output(dest) as tmp:
            open(tmp, "wb").write(b"new")
            dest.write_bytes(b"someone else's")
    assert dest.read_bytes() == b"someone else's"
    assert os.listdir(tmp_path) == ["out.npz"]


def test_staged_output_removes_what_a_killed_run_left_beside_it(tmp_path):
    from her_store.storage.files import staged_output

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    os.makedirs(tmp_path / f".out.npz.{pid}.1a2b3c4d.partial.members")
    (tmp_path / f".out.npz.{pid}.1a2b3c4d.partial").write_bytes(b"half")
    (tmp_path / f".out.npz.{os.getppid()}.00000000.partial").write_bytes(b"a live run's")  # its parent lives
    (tmp_path / ".other.npz.1.0.partial").write_bytes(b"another destination's")
    with staged_output(tmp_path / "out.npz") as tmp:
        open(tmp, "wb").write(b"whole")
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".other.npz.1.0.partial", f".out.npz.{os.getppid()}.00000000.partial", "out.npz"]
    )


def test_staged_output_removes_only_its_own_names_partials_and_never_a_running_jobs(tmp_path):
    """``.st.300.<pid>.<hex>.partial`` is the partial of ``st.300``: a job writing ``st`` took "300" for a dead
    process's id and removed another job's staged store. A job's partial is also alive while its lock file is held,
    whatever its process id says here (another PID namespace sharing the volume); one whose lock nobody holds is
    a killed job's, and goes."""
    import fcntl

    from her_store.storage.files import staged_output

    code = "import os; print(os.getpid())"
    dead = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    clash = tmp_path / f".st.300.{dead}.1a2b3c4d.partial"  # a partial of "st.300" (its job's lock held below)
    clash.mkdir()
    foreign = tmp_path / f".st.{dead}.0badc0de.partial"  # "st"'s, of a job whose pid means nothing here, running
    foreign.mkdir()
    killed = tmp_path / f".st.{dead}.deadbeef.partial"  # "st"'s, of a killed job: its lock file held by nobody
    killed.write_bytes(b"half")
    Path(f"{killed}.alive").touch()
    held = []
    for partial in (clash, foreign):
        Path(f"{partial}.alive").touch()
        fd = os.open(f"{partial}.alive", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    try:
        with staged_output(tmp_path / "st") as tmp:
            Path(tmp).write_bytes(b"whole")
        left = sorted(os.listdir(tmp_path))
        assert left == sorted(["st", clash.name, f"{clash.name}.alive", foreign.name, f"{foreign.name}.alive"]), left
    finally:
        for fd in held:
            os.close(fd)
    with staged_output(tmp_path / "st.300") as tmp:  # its job gone now (lock released): removed
        Path(tmp).write_bytes(b"whole")
    assert not clash.exists() and not Path(f"{clash}.alive").exists()


def test_chunk_names_are_exactly_what_zarr_writes():
    """A chunk's index is read from a name only when it is the key zarr writes: ASCII digits without a leading zero,
    and for "." keys one ".0" per axis after the first; other names (temp files, look-alikes) are no chunk."""
    from her_store.format.keys import chunk_key, chunk_of, is_chunk_key

    for i in (0, 7, 1234):
        assert chunk_of(chunk_key("steps/x", i, 4, ".").rpartition("/")[2], ".", 4) == i
        assert chunk_of(chunk_key("packs/f", i, 2, "/").split("/")[3], "/") == i
    for name in ("c.05.0.0.0", "c.\u00b2.0.0.0", "c.\u0665.0.0.0", "c.-1.0.0.0", "c.5.0.0", "c.5.0.0.0.0", "c.5.0.1.0",
                 "c.5.0.0.0.17.tmp", "c..0.0.0", "d.5.0.0.0", "c"):
        assert chunk_of(name, ".", 4) is None, name
    assert chunk_of("c.5", ".") == 5 and chunk_of("c.5.0.0.0", ".") == 5  # any number of axes when not given
    for name in ("05", "\u00b2", "-1", "", "5.17.tmp", "+5"):
        assert chunk_of(name, "/") is None, name
    for key in ("packs/float32/c/3/0", "episodes/length/c/0", "steps/pixels/c/12/0/0/0", "steps/pixels/c.12.0.0.0"):
        assert is_chunk_key(key), key
    for key in ("c.5.0.0.0", "notes/c/5", "notes/x/c.5", "steps/pixels/zarr.json", "steps/pixels/c/05/0/0/0",
                "steps/pixels/c.05.0.0.0", "packs/float32/c", "steps/pixels/c.5.0.0.0.17.tmp", "steps/pixels/c.5",
                "packs/float32/c.0.0", "packs/notes/c/1", "packs/float32/c/1/0/0", "episodes/length/c/1/0",
                "steps/pixels/c/1", "steps/pixels/c/1/0/1", "packs/float32/c/1/0.17.tmp"):
        assert not is_chunk_key(key), key


@pytest.mark.parametrize("packed", [False, True], ids=["directory", "zip"])
def test_a_chunk_file_its_readers_let_go_closes_without_a_resource_warning(store_path, fetch, packed):
    """A chunk's file (open_range's) is shared by a mapping and the gathers in flight, and closes when the last of them
    lets go: closing it that way is no leak, so it says nothing (a tool's one-line error stays one line)."""
    import gc
    import warnings

    from her_store.ops.pack import pack_store

    obs, act = fetch
    with EpisodeStore.create(store_path, obs, act) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0))
    path = store_path
    if packed:
        path = store_path + ".zip"
        pack_store(store_path, path)
    backend = open_backend(path)
    key = "packs/float32/c/0/0"
    f, _, size = backend.open_range(key)
    fd = f.fileno()
    target = os.readlink(f"/proc/self/fd/{fd}")
    assert size > 0 and target == os.path.realpath(path if packed else os.path.join(path, key))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del f
        gc.collect()
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}") != target
    backend.close()
