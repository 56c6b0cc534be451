"""Files on local disk, opened so that nothing in a store leads outside it: safe opening beneath a root, sparse writes,
fsync, staged outputs.

A store's files are regular files of its own: each is opened one directory at a time without following a symbolic
link, a FIFO or a device in a file's place is refused by name, and a file written in place may have no other (hard)
link. Pages of zeros are written as holes (:func:`write_sparse`), and readers skip holes (:func:`data_runs`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import re
import resource
import shutil
import stat
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from her_store.errors import CorruptStoreError
from her_store.forks import reset_in_child

__all__ = [
    "FileShares",
    "SharedFile",
    "create_new",
    "dir_beneath",
    "open_bounded",
    "remove_in",
    "remove_temps",
    "blocks_directory",
    "data_between",
    "data_runs",
    "drop_page_cache",
    "fsync_file",
    "nonzero_runs",
    "open_beneath",
    "open_regular",
    "pid_alive",
    "pread_into",
    "remove_beneath",
    "staged_output",
    "write_all",
    "write_sparse",
]


class SharedFile(io.FileIO):
    """A file that readers share (a chunk's mapping, a shard's gathers in flight): it closes when its last holder
    lets go of it, which is how such a file is meant to close, so without the unclosed-file ResourceWarning."""

    def __del__(self) -> None:
        self.close()

HOLE_PAGE = 4096  # the unit of a hole: a page of zeros written nowhere


@contextlib.contextmanager
def staged_output(dest: str | os.PathLike[str]) -> Iterator[str]:
    """A temporary path beside ``dest`` (a file or a directory) that becomes ``dest`` only if the block succeeds.

    The block writes to the yielded path; on success it is renamed to ``dest`` (one ``rename``, so ``dest`` is
    absent or whole), on any exception it is removed. ``dest`` must not exist.

    Raises
    ------
    FileExistsError
        ``dest`` exists (nothing is overwritten).

    Examples
    --------
    >>> import tempfile; d = tempfile.mkdtemp()
    >>> with staged_output(d + "/out.npz") as tmp:
    ...     open(tmp, "wb").write(b"x")
    1
    >>> os.listdir(d)
    ['out.npz']
    """
    dest = os.path.abspath(os.fspath(dest))
    if os.path.lexists(dest):
        raise FileExistsError(f"{dest} exists; choose a new destination (nothing was overwritten)")
    parent, name = os.path.split(dest)
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the directory of {dest} does not exist")
    _remove_dead_partials(parent, name)
    tmp = os.path.join(parent, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.partial")
    # held (flock) while the block runs: another job tells this partial is alive whatever its process id means there
    # (another PID namespace, a container sharing the volume)
    try:
        lock = os.open(tmp + _ALIVE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:  # the first file written beside dest: say which destination cannot be written, and why
        raise OSError(e.errno, f"{dest} cannot be written: {e.strerror} in {parent}") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield tmp
        if os.path.lexists(dest):
            raise FileExistsError(f"{dest} appeared while it was being written; it was not overwritten")
        os.rename(tmp, dest)
    except BaseException:
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    finally:
        with contextlib.suppress(OSError):  # one left behind, held by nobody, is removed by the next job
            os.unlink(tmp + _ALIVE)
        os.close(lock)


_ALIVE = ".alive"  # beside a staged_output's partial: flocked while its job runs


def _remove_dead_partials(parent: str, name: str) -> None:
    """Remove what a :func:`staged_output` of ``name`` killed before it ended left beside it
    (``.<name>.<pid>.<8 hex>.partial``, what its writer kept beside that, and its ``.alive`` lock file), when its job
    is gone: its lock file is not held (flock), or, for a partial without one, no process has its id. The name must
    match exactly: ``.st.300.<pid>...`` is a partial of ``st.300``, not of ``st``."""
    pattern = re.compile(re.escape(f".{name}.") + r"(\d+)\.[0-9a-f]{8}\.partial")
    for entry in os.listdir(parent):
        m = pattern.match(entry)
        if m is None:
            continue
        base = os.path.join(parent, m[0])
        if not _partial_dead(base, int(m[1])):
            continue
        path = os.path.join(parent, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _partial_dead(base: str, pid: int) -> bool:
    """Whether the job of the partial ``base`` has ended: its lock file is there and nobody holds it, or (a partial of
    an older version, with no lock file) no process of this namespace has its id."""
    try:
        fd = os.open(base + _ALIVE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return pid != os.getpid() and not pid_alive(pid)
    except OSError:
        return False  # a link or something else we cannot take for a lock: left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its job runs
    finally:
        os.close(fd)
    return True


def open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, which must be a regular file: opening a FIFO would block forever, a device
    such as /dev/zero never ends, and a store's files are never symbolic links (so none leads outside it).

    Raises
    ------
    FileNotFoundError
        Nothing is there.
    CorruptStoreError
        Something other than a regular file is.
    """
    return _regular(path, lambda: os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC))


def _regular(path: str, opener: Callable[[], int]) -> int:
    """The descriptor ``opener`` opens (without following a final symbolic link), which must be of a regular file."""
    try:
        fd = opener()
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptStoreError(f"{path} is a symbolic link; a store's files are regular files") from e
        if e.errno in (errno.EISDIR, errno.ENXIO):
            raise CorruptStoreError(f"{path} is not a regular file ({e.strerror})") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptStoreError(f"{path} is not a regular file (a directory, FIFO, socket or device)")
    return fd


def dir_beneath(root: str, parts: Sequence[str], create: bool) -> int:
    """A descriptor of the directory ``root/parts[0]/parts[1]/...``, each part opened without following a symbolic
    link (and made first when ``create``): a store's directories are its own, so no write or removal leaves it.

    Raises
    ------
    FileNotFoundError
        A part is missing (and ``create`` is false), or ``root`` is.
    CorruptStoreError
        A part is a symbolic link, a file or anything else but a directory, or no plain name ("", ".", "..").
    """
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            where = "/".join([root, *parts[: i + 1]])
            if part in ("", ".", ".."):
                raise CorruptStoreError(f"{where}: {part!r} names no entry of a store")
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise CorruptStoreError(
                        f"{where} is not a directory (a symbolic link or a file in its place); a store's directories "
                        "are its own"
                    ) from e
                raise
            os.close(fd)
            fd = inner
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_beneath(root: str, key: str, create: bool = False) -> int:
    """A descriptor of the regular file at ``key`` under the local directory ``root``, no symbolic link followed at
    any level below ``root``: read-only, or with ``create`` read-write and made (with its directories) if missing.

    Raises
    ------
    FileNotFoundError
        Nothing is there (and ``create`` is false).
    CorruptStoreError
        A link, a directory, a FIFO or a device is at ``key`` or in place of one of its directories; or, to be
        written, the file has another name (a hard link).

    Examples
    --------
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> os.close(open_beneath(root, "packs/float32/c/0/0", create=True))
    >>> os.path.isfile(f"{root}/packs/float32/c/0/0")
    True
    """
    *parts, name = key.split("/")
    if name in ("", ".", ".."):
        raise CorruptStoreError(f"{root}/{key}: {name!r} names no file of a store")
    parent = dir_beneath(root, parts, create)
    flags = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
    try:
        fd = _regular(f"{root}/{key}", lambda: os.open(name, flags, 0o644, dir_fd=parent))
    finally:
        os.close(parent)
    links = os.fstat(fd).st_nlink
    if create and links > 1:  # written in place: another name of the file would see (or be) the writes
        os.close(fd)
        raise CorruptStoreError(
            f"{root}/{key} has {links} names (hard links); a file written in place must be the store's alone (copy a "
            "store rather than linking its files)"
        )
    return fd


def remove_beneath(root: str, key: str) -> None:
    """Remove whatever is at ``key`` under the local directory ``root`` (a file, a directory and all it holds, a link
    itself and not what it names), no link followed on the way there; nothing there is no error. A link or a file in
    place of one of its directories is removed instead: nothing reached through it is the store's."""
    *parts, name = key.split("/")
    for i in range(len(parts)):
        try:
            os.close(dir_beneath(root, parts[: i + 1], create=False))
        except FileNotFoundError:
            return
        except CorruptStoreError:  # parts[i] is a link or a file: it goes, and with it what was to be removed
            parts, name = parts[:i], parts[i]
            break
    parent = dir_beneath(root, parts, create=False)
    try:
        remove_in(parent, name)
    finally:
        os.close(parent)


def remove_in(parent: int, name: str) -> None:
    """Remove whatever is at ``name`` in the directory ``parent`` (a directory with all it holds; a link itself)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)


def remove_temps(directory: str | int, names: Sequence[str]) -> int:
    """Remove the temp files ``<key>.<pid>.tmp`` among ``names`` in ``directory`` (a path, or a descriptor); returns
    how many."""
    removed = 0
    for name in names:
        stem, _, pid = name[: -len(".tmp")].rpartition(".") if name.endswith(".tmp") else ("", "", "")
        if stem and pid.isdigit():
            with contextlib.suppress(FileNotFoundError):
                if isinstance(directory, int):
                    os.unlink(name, dir_fd=directory)
                else:
                    os.unlink(os.path.join(directory, name))
                removed += 1
    return removed


def create_new(path: str) -> int:
    """A new file at ``path``, for writing: whatever a process of the same pid left there (killed mid-write, or junk
    in a store from elsewhere) is removed first, and a link there is never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            remove_in(parent, os.path.basename(path))
        finally:
            os.close(parent)
        return os.open(path, flags, 0o644)


def open_bounded(root: str, key: str, limit: int) -> tuple[int, int]:
    """(descriptor, size) of ``key`` under ``root``, a regular file (:func:`open_beneath`) of at most ``limit``
    bytes."""
    fd = open_beneath(root, key)
    size = os.fstat(fd).st_size
    if size > limit:
        os.close(fd)
        raise CorruptStoreError(f"{root}/{key} holds {size:,} bytes, more than the {limit:,} it may")
    return fd, size


def write_all(fd: int, data: Any, offset: int | None = None) -> None:
    """Write every byte of ``data`` to ``fd`` (at ``offset`` with pwrite, else at the file position), or raise.

    ``write``/``pwrite`` may write fewer bytes than asked (a nearly full disk, a file size limit); the rest is
    written by further calls, and a call that writes nothing raises ENOSPC rather than looping forever.
    """
    view = memoryview(data).cast("B")
    done, size = 0, len(view)
    while done < size:
        n = os.write(fd, view[done:]) if offset is None else os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, f"wrote {done} of {size} bytes, then the device took no more")
        done += n


def data_runs(fd: int, size: int, first: int = 0) -> list[tuple[int, int]]:
    """(start, end) of each part of bytes ``first .. size`` of a file that holds data, its holes (never written, read
    as zeros) left out; all of them where the file system cannot tell them apart (no ``SEEK_DATA``).

    Examples
    --------
    >>> import tempfile; fd, name = tempfile.mkstemp()
    >>> os.pwrite(fd, b"rows", 0); os.ftruncate(fd, 1 << 20)
    4
    >>> data_runs(fd, 1 << 20)  # doctest: +SKIP
    [(0, 4096)]
    """
    runs: list[tuple[int, int]] = []
    at = first
    try:
        while at < size:
            start = os.lseek(fd, at, os.SEEK_DATA)
            if start >= size:
                break
            at = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            runs.append((start, at))
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data past `at`: the rest is a hole
            return runs
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        return [(first, size)] if size > first else []
    return runs


def nonzero_runs(data: Any, offset: int) -> list[tuple[int, int]]:
    """(start, end) of the parts of ``data`` to write at byte ``offset`` of a file that reads as zeros there (a new
    one) for it to hold ``data``: ``data`` cut at the file's page boundaries, the pieces of zeros left out.

    Examples
    --------
    >>> nonzero_runs(bytes(8192) + b"row" + bytes(8192), 0)
    [(8192, 12288)]
    >>> nonzero_runs(b"row" + bytes(8192), 4000)
    [(0, 96)]
    """
    raw = np.frombuffer(data, np.uint8)
    head = min(len(raw), -offset % HOLE_PAGE)
    pages = (len(raw) - head) // HOLE_PAGE
    tail = head + pages * HOLE_PAGE
    bounds = np.concatenate(([0], head + HOLE_PAGE * np.arange(pages + 1), [len(raw)]))  # head, whole pages, tail
    full = raw[head:tail].view(np.uint64).reshape(pages, HOLE_PAGE // 8).any(axis=1)
    used = np.concatenate(([raw[:head].any()], full, [raw[tail:].any()]))
    keep = bounds[1:] > bounds[:-1]  # an empty head or tail
    bounds, used = np.append(bounds[:-1][keep], len(raw)), used[keep]
    edges = np.flatnonzero(np.diff(np.concatenate(([0], used.astype(np.int8), [0]))))
    return list(zip(bounds[edges[0::2]].tolist(), bounds[edges[1::2]].tolist()))


def write_sparse(fd: int, data: Any, offset: int) -> int:
    """Write ``data`` at byte ``offset`` of ``fd``, where the file reads as zeros (a new file), leaving its pages of
    zeros unwritten: holes, once the file is long enough (``ftruncate``). Returns the bytes written.

    Examples
    --------
    >>> import tempfile; fd, name = tempfile.mkstemp()
    >>> write_sparse(fd, bytes(3 * 4096) + b"row", 0)
    3
    >>> os.ftruncate(fd, 3 * 4096 + 3); os.pread(fd, 4, 3 * 4096 - 1)
    b'\\x00row'
    """
    view = memoryview(data).cast("B")
    runs = nonzero_runs(view, offset)
    for a, b in runs:
        write_all(fd, view[a:b], offset + a)
    return sum(b - a for a, b in runs)


def blocks_directory(path: str) -> bool:
    """Whether something other than a directory is at ``path``: a link (to anything) or a file, where a scratch
    directory of its own (a repair's, a copy's) goes. Nothing there, or a directory, is False."""
    return os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path))


def fsync_file(path: str) -> None:
    """fsync a file or directory by path (a directory's fsync makes renames and new entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: str) -> None:
    """Write a file's dirty pages back, then drop its pages from the OS page cache (a cold start). Anything but a
    regular file (a link, a FIFO someone left in a store) is left alone."""
    try:
        fd = open_regular(path)
    except (OSError, CorruptStoreError):
        return
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pread_into(root: str, key: str, buf: np.ndarray, offset: int) -> int:
    """Read ``key`` under ``root`` (:func:`open_beneath`) from ``offset`` straight into ``buf`` (no intermediate
    bytes); the count read, 0 when the file does not exist, short at its end."""
    try:
        fd = open_beneath(root, key)
    except FileNotFoundError:
        return 0
    try:
        view, got = memoryview(buf), 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


class FileShares:
    """A bound on the files one kind of holder keeps open across calls, shared by every such holder alive in the
    process: in all, the process's soft limit on descriptors over ``divisor`` (read when asked: a process may change
    it), at most ``most``; each holder may keep that over the number of them, at least ``least``, and lets go of its
    least recently used files past it. Samplers of many stores in one process (a mixture over a sharded dataset's
    stores) then stay within the descriptor limit one sampler stays within.

    Examples
    --------
    >>> shares = FileShares(divisor=4, least=16, most=64)
    >>> holder = type("Holder", (), {})()
    >>> shares.join(holder)
    >>> shares.share() <= 64
    True
    """

    def __init__(self, divisor: int, least: int, most: int) -> None:
        self.divisor, self.least, self.most = divisor, least, most
        self._live: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()
        reset_in_child(self)

    def after_fork(self) -> None:
        self._lock = threading.Lock()

    def join(self, holder: Any) -> None:
        with self._lock:
            self._live.add(holder)

    def leave(self, holder: Any) -> None:
        with self._lock:
            self._live.discard(holder)

    def share(self) -> int:
        """The files each holder alive may keep open now."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        total = min(self.most, (1 << 20 if soft == resource.RLIM_INFINITY else soft) // self.divisor)
        return max(self.least, total // max(1, len(self._live)))


def data_between(runs: list[tuple[int, int]], starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Bytes of the data ``runs`` (sorted, disjoint ``(start, end)``) that lie in each ``starts[i] .. ends[i]``.

    Examples
    --------
    >>> data_between([(0, 10), (20, 30)], np.array([5, 0]), np.array([25, 40])).tolist()
    [10, 20]
    """
    if not runs:
        return np.zeros(len(starts), np.int64)
    r = np.asarray(runs, np.int64)
    before = np.concatenate(([0], np.cumsum(r[:, 1] - r[:, 0])))  # data bytes before each run

    def upto(x: np.ndarray) -> np.ndarray:  # data bytes below offset x
        i = np.searchsorted(r[:, 0], x, side="right") - 1
        inside = np.clip(x - r[np.maximum(i, 0), 0], 0, r[np.maximum(i, 0), 1] - r[np.maximum(i, 0), 0])
        return np.where(i >= 0, before[np.maximum(i, 0)] + inside, 0)

    return upto(ends) - upto(starts)
