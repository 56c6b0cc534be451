"""Fault injection for the write path: make the n-th write into a store fail the way a failing machine does.

Counted are the calls that put bytes of the store somewhere: ``os.write``/``os.pwrite``/``os.fsync`` on a file
under the store's directory, the raw writes of files opened with ``open`` under it (``zipfile``, ``numpy`` and
Python's buffered files write through them), zarr's local ``_put`` (array metadata, compressed chunks) under it, and
s3fs PUTs (``_pipe_file``) under the store's URL; with ``renames``, also the ``os.replace``/``os.rename`` that puts a
written temp file or directory in place (a whole-object write); with ``removals``, also each ``os.unlink``/``os.remove``
/``os.rmdir`` of an entry under the store (``shutil.rmtree`` removes through them), named by its ``dir_fd`` when given.
``under`` narrows all of these to one part of the store, such as one sharded array's shards. Modes:

- ``short``: that call writes half of its bytes and returns the short count (a whole-object write raises ENOSPC
  instead); every later write raises ENOSPC: a disk filling up.
- ``enospc``: that call and every later one raise ENOSPC.
- ``eio``: that call raises EIO, once: a transient device error.
- ``kill``: the process SIGKILLs itself at that call (run it in a subprocess).

Writes made in C by a library (HDF5's) reach none of these: :class:`FileSizeLimit` fails them (``EFBIG``) from the
byte it is given on, as a full quota does.

Usage as a script (the kill runs): ``python tests/faults.py CONFIG PATH AT MODE FIRST [STORAGE_OPTIONS_JSON]``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import functools
import gc
import io
import json
import os
import resource
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable
from typing import Any, Self

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from tests.conftest import fetch_spaces, make_episode, random_rows

MODES = ("short", "enospc", "eio", "kill")


class WriteFaults:
    """Count (``at=None``) or fail (``at=n``) the writes into one store (or the part ``under`` it) while the context
    is active."""

    def __init__(
        self, root: str, at: int | None = None, mode: str = "enospc", under: str = "", renames: bool = False,
        removals: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(mode)
        self.root = root.rstrip("/")
        self.prefix = f"{self.root}/{under}"  # a counted write's path starts with this
        self.renames = renames
        self.removals = removals
        self.at = at
        self.mode = mode
        self.calls = 0
        self.kinds: list[str] = []  # per counted call: "bytes" (write/pwrite, may be short) or "object" (whole)
        self.paths: list[str] = []  # per counted call: the path written (a file, object, directory or rename target)
        self.full = False  # the disk filled up: every later write fails
        self._saved: list[tuple[Any, str, Any]] = []

    # -- the decision ------------------------------------------------------------------------------------------
    def _fault(self, whole_object: bool, path: str) -> str | None:
        """None to let the call through, "short" to write half, or raises."""
        self.calls += 1
        self.kinds.append("object" if whole_object else "bytes")
        self.paths.append(path)
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if self.at is None or self.calls != self.at:
            return None
        if self.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "eio":
            raise OSError(errno.EIO, "Input/output error (injected)")
        self.full = True
        if self.mode == "short" and not whole_object:
            return "short"
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def _ours_fd(self, fd: int) -> str:
        """The path of ``fd`` if it lies under the prefix, else ""."""
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""
        return path if path.startswith(self.prefix) else ""

    # -- the patched calls ----------------------------------------------------------------------------------------
    def __enter__(self) -> Self:
        import zarr.storage._local as zlocal

        s3fs = _s3fs()
        self._patch_fd_writes()
        self._patch_renames()
        if self.removals:
            self._patch_removals()
        self._patch_open()
        self._patch_zarr_put(zlocal)
        if s3fs is not None:
            self._patch_s3_put(s3fs)
        return self

    def _patch_fd_writes(self) -> None:
        """``os.write``, ``os.pwrite`` and ``os.fsync`` of a file under the prefix."""
        write, pwrite, fsync = os.write, os.pwrite, os.fsync

        def p_write(fd: int, data: Any) -> int:
            if (path := self._ours_fd(fd)) and self._fault(False, path) == "short":
                return write(fd, memoryview(data).cast("B")[: max(1, len(memoryview(data).cast("B")) // 2)])
            return write(fd, data)

        def p_pwrite(fd: int, data: Any, offset: int) -> int:
            if (path := self._ours_fd(fd)) and self._fault(False, path) == "short":
                return pwrite(fd, memoryview(data).cast("B")[: max(1, len(memoryview(data).cast("B")) // 2)], offset)
            return pwrite(fd, data, offset)

        def p_fsync(fd: int) -> None:
            if path := self._ours_fd(fd):
                self._fault(True, path)
            return fsync(fd)

        self._patch(os, "write", p_write)
        self._patch(os, "pwrite", p_pwrite)
        self._patch(os, "fsync", p_fsync)

    def _patch_renames(self) -> None:
        """``os.replace`` and ``os.rename`` onto a path under the prefix, counted with ``renames``."""
        replace, rename = os.replace, os.rename

        def p_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if self.renames and os.path.abspath(dst).startswith(self.prefix):
                self._fault(True, os.path.abspath(dst))
            return replace(src, dst, *args, **kwargs)

        def p_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if self.renames and os.path.abspath(dst).startswith(self.prefix):
                self._fault(True, os.path.abspath(dst))
            return rename(src, dst, *args, **kwargs)

        self._patch(os, "replace", p_replace)
        self._patch(os, "rename", p_rename)

    def _patch_removals(self) -> None:
        """``os.unlink``, ``os.remove`` and ``os.rmdir`` of an entry under the prefix (named by its ``dir_fd``)."""

        def removal(real: Callable[..., None]) -> Callable[..., None]:
            def p_remove(path: Any, *, dir_fd: int | None = None) -> None:
                where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path) if dir_fd is not None else path
                if os.path.abspath(os.fsdecode(where)).startswith(self.prefix):
                    self._fault(True, os.path.abspath(os.fsdecode(where)))
                return real(path, dir_fd=dir_fd)

            return p_remove

        for name in ("unlink", "remove", "rmdir"):
            self._patch(os, name, removal(getattr(os, name)))

    def _patch_open(self) -> None:
        """``open`` (and ``io.open``) of a file under the prefix for writing: its raw writes are counted."""
        real_open = io.open
        faults = self

        class FaultyFile(io.FileIO):
            """A file whose every raw write (what a buffered file, zipfile or numpy calls) is counted."""

            def write(self, data: Any) -> int | None:
                if faults._fault(False, str(self.name)) == "short":
                    view = memoryview(data).cast("B")
                    return super().write(view[: max(1, len(view) // 2)])
                return super().write(data)

        def p_open(
            file: Any,
            mode: str = "r",
            buffering: int = -1,
            encoding: str | None = None,
            errors: str | None = None,
            newline: str | None = None,
            closefd: bool = True,
            opener: Any = None,
        ) -> Any:
            if (
                isinstance(file, int)
                or not set(mode) & set("wxa+")
                or not os.path.abspath(os.fsdecode(file)).startswith(self.prefix)
            ):
                return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
            raw = FaultyFile(file, mode.replace("b", "").replace("t", ""), closefd=closefd, opener=opener)
            if buffering == 0:
                return raw
            buffered_class = io.BufferedRandom if "+" in mode else io.BufferedWriter
            buffered = buffered_class(raw, buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE)
            if "b" in mode:
                return buffered
            return io.TextIOWrapper(buffered, encoding, errors, newline, line_buffering=buffering == 1)

        self._patch(io, "open", p_open)
        self._patch(builtins, "open", p_open)

    def _patch_zarr_put(self, zlocal: Any) -> None:
        """zarr's local ``_put`` (array metadata, compressed chunks) of a path under the prefix."""
        put = zlocal._put

        def p_put(path: Any, *args: Any, **kwargs: Any) -> Any:
            if str(path).startswith(self.prefix):
                self._fault(True, str(path))
            return put(path, *args, **kwargs)

        self._patch(zlocal, "_put", p_put)

    def _patch_s3_put(self, s3fs: Any) -> None:
        """s3fs's PUTs (``_pipe_file``) of a key under the prefix."""
        pipe = s3fs.S3FileSystem._pipe_file

        async def p_pipe(fs: Any, path: str, *args: Any, **kwargs: Any) -> Any:
            if path.startswith(self.prefix):
                self._fault(True, path)
            return await pipe(fs, path, *args, **kwargs)

        self._patch(s3fs.S3FileSystem, "_pipe_file", p_pipe)
        # a filesystem instance binds its sync methods (fs.pipe_file) to _pipe_file when it is made: new ones only
        s3fs.S3FileSystem.clear_instance_cache()

    def _patch(self, owner: Any, name: str, fn: Callable[..., Any]) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, fn)

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()
        if (s3fs := _s3fs()) is not None:
            s3fs.S3FileSystem.clear_instance_cache()


def _s3fs() -> Any:
    """The s3fs module, or None where it is not installed (an optional dependency: then no store is written
    through it, and its PUTs need no patch)."""
    try:
        import s3fs
    except ImportError:
        return None
    return s3fs


class FileSizeLimit:
    """While active, no file of this process may grow past ``nbytes``: a write that would fails with ``EFBIG`` (the
    soft ``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so that the write fails rather than the process dying). Unlike
    :class:`WriteFaults` it reaches writes made in C (HDF5's); it applies to every file the process writes."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._saved: tuple[tuple[int, int], Any] | None = None

    def __enter__(self) -> Self:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        self._saved = ((soft, hard), signal.signal(signal.SIGXFSZ, signal.SIG_IGN))
        limit = self.nbytes if hard == resource.RLIM_INFINITY else min(self.nbytes, hard)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None
        resource.setrlimit(resource.RLIMIT_FSIZE, self._saved[0])
        signal.signal(signal.SIGXFSZ, self._saved[1])


# -- checks for the dataset tools --------------------------------------------------------------------------------
def tree_digest(path: str) -> dict[str, int]:
    """Every file under ``path`` (or the file itself), by relative name, with the crc32 of its bytes: equal digests
    mean nothing was added, removed or changed."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": zlib.crc32(f.read())}
    out = {}
    for d, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                out[os.path.relpath(os.path.join(d, name), path)] = zlib.crc32(f.read())
    return out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``her-store ARGS`` through its entry point in this process (faults patch this process; a subprocess also
    costs seconds): its exit status, stdout and stderr. An exception the command does not turn into a message
    propagates."""
    from her_store.cli.main import main

    if any("://" in a for a in args):  # the HTTP sessions of s3fs instances dropped before: their notices not in here
        gc.collect()
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_line_error(proc: subprocess.CompletedProcess, cause: str = "") -> None:
    """A failed command said why in one line on stderr, naming the command (and ``cause``), without a traceback."""
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"her-store {proc.args[0]}: "), proc
    assert "Traceback" not in proc.stdout + proc.stderr and cause in lines[0], proc


# -- the workloads ------------------------------------------------------------------------------------------------
OBS, ACT = fetch_spaces()
IMAGE_OBS = type(OBS)({**OBS.spaces, "pixels": __import__("gymnasium").spaces.Box(0, 255, (3, 6, 6), np.uint8)})

CONFIGS: dict[str, dict[str, Any]] = {
    # uncompressed packs written with pwrite, unbounded, flush
    "raw": {"obs": OBS, "kwargs": {"chunk_rows": 64, "info_keys": ["is_success"]}},
    # a compressed field (whole chunks through zarr) in a ring that wraps
    "ring-compressed": {"obs": IMAGE_OBS, "kwargs": {"chunk_rows": 32, "capacity": 120, "info_keys": ["is_success"]}},
    # the same with every commit fsync'ed (files and directories)
    "ring-compressed-fsync": {
        "obs": IMAGE_OBS,
        "kwargs": {"chunk_rows": 32, "capacity": 120, "durability": "fsync", "info_keys": ["is_success"]},
    },
}


def episode_for(config: str, i: int) -> dict[str, np.ndarray]:
    """Episode ``i`` of a workload: a function of ``i`` alone, so any process can check a stored one (its arrays are
    read-only: made once per process and shared by every caller)."""
    return dict(_episode(config, i))


@functools.lru_cache(maxsize=512)
def _episode(config: str, i: int) -> dict[str, np.ndarray]:
    T = int(np.random.default_rng(1000 + i).integers(3, 30))
    ep = make_episode(CONFIGS[config]["obs"], ACT, T, seed=i, info_keys=("is_success",))
    if "pixels" in ep:
        ep["pixels"] = random_rows(CONFIGS[config]["obs"]["pixels"], T + 1, np.random.default_rng(i))
    for v in ep.values():
        v.setflags(write=False)
    return ep


def store_options(config: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    kw = dict(CONFIGS[config]["kwargs"], commit_interval=0)
    if storage_options:
        kw["storage_options"] = storage_options
    return kw


def workload(
    config: str, path: str, first: int, count: int, storage_options: dict[str, Any] | None = None
) -> list[int]:
    """Open (or create) the store and append episodes ``first .. first + count - 1`` with a commit after every
    second one; returns the ids appended before anything raised (then re-raises)."""
    from her_store import open_store

    done: list[int] = []
    store = open_store(path, CONFIGS[config]["obs"], ACT, **store_options(config, storage_options))
    try:
        for i in range(first, first + count):
            done.append(store.append_episode(episode_for(config, i)))
            if i % 2:
                store.flush()
    finally:
        store.close()
    return done


if __name__ == "__main__":
    config, path, at, mode, first = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    opts = json.loads(sys.argv[6]) if len(sys.argv) > 6 else None
    root = os.path.abspath(path) if "://" not in path else path.split("://", 1)[1]
    with WriteFaults(root, at, mode):
        workload(config, path, first, 4, opts)
    print("finished", flush=True)
