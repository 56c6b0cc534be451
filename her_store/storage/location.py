"""Bytes in and out of a store's location: local paths or fsspec URLs, atomic writes, the writer lock, chunk writes.

Two ways to write rows into a Zarr array:
- ``RawChunkFile``: uncompressed arrays on local disk. A v3 chunk without codecs is the raw little-endian rows
  (FACTS.md), so rows are ``pwrite``-n in place into pre-sized chunk files: a commit writes only its own bytes.
- ``ZarrChunks``: compressed arrays, or any array on object storage. Whole chunks are assembled in memory and
  written through zarr (one PUT per chunk on S3; temp file + rename on disk), so a chunk is never torn.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import io
import json
import math
import os
import re
import resource
import shutil
import socket
import stat
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
import zarr
import zarr.storage
from zarr.core.array_spec import ArrayConfigParams

from her_store.checks import is_number
from her_store.errors import CorruptStoreError, StoreLockedError, StoreTimeoutError
from her_store.extras import require

if TYPE_CHECKING:
    from her_store.ops.pack import PackedArchive

__all__ = [
    "ZARR_CONFIG", "FileShares", "Location", "ObjectReplaced", "RawChunkFile", "WriterLock", "ZarrChunks", "chunk_io",
    "staged_output",
]

DEFAULT_LEASE_TTL = 300.0  # seconds an object-storage writer lease lasts unless renewed
HOLE_PAGE = 4096  # the unit of a hole: a page of zeros written nowhere
METADATA_LIMIT = 64 << 20  # bytes a commit record, lease or zarr.json may hold (spaces with per-pixel bounds included)
ZARR_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}  # an all-zero chunk is data here, not absence
OBJECT_LIMIT = 1 << 30  # bytes any object of a store read over HTTP may hold (a chunk is under 256 MiB)
HTTP_TIMEOUT = 60.0  # seconds an HTTP server may take to answer, or to send the next bytes of a body
HTTP_DEADLINE = 300.0  # seconds one HTTP request may take in all (storage_options["request_deadline"] sets another)


class Location:
    """A store's place: a local directory or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ``file://``, or
    ``http(s)://``, read-only). A packed store (a zip file on local disk, or a URL ending in ``.zip`` that names a zip
    object over HTTP(S) or S3) is read in place through :attr:`archive`.

    Examples
    --------
    >>> Location("/tmp/run1").is_local
    True
    >>> Location("memory://run1").is_local
    False
    """

    def __init__(self, path_or_url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        url = os.fspath(path_or_url)
        self.storage_options = dict(storage_options or {})
        if url.startswith("file://"):
            url = url[len("file://") :]
        self.is_local = "://" not in url
        if self.is_local:
            self.root = os.path.abspath(url)
            self.url = self.root
            self.fs = fsspec.filesystem("file")
        else:
            self.url = url.rstrip("/")
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.is_http = not self.is_local and self.url.split("://", 1)[0].lower() in ("http", "https")
        # why nothing may be written here (None: writable): an HTTP server serves files, it takes no writes or lock
        self.read_only: str | None = None
        if self.is_http:
            self.fs = _http_filesystem()(**self.storage_options)
            self.read_only = (
                f"{self.url} is served over HTTP, which is read-only: a store opened by URL is never written and "
                "takes no writer lock (copy it with `her-store copy` to write to it)"
            )
        self.archive: PackedArchive | None = None  # a packed store: one zip file, read in place (her_store.ops.pack)
        if self.is_local and os.path.isfile(self.root):
            from her_store.ops.pack import PackedArchive, is_archive

            if is_archive(self.root):
                self.archive = PackedArchive(self.root)
        elif not self.is_local and self.url.lower().endswith(".zip"):  # a zip object, read by ranged GETs
            from her_store.ops.pack import open_remote_archive

            self.archive = open_remote_archive(self.fs, self.root, self.url, self.is_http)

    def __str__(self) -> str:
        return self.url

    def key_path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        if self.archive is not None:
            return self.archive.zarr_store()
        if self.is_local:
            return zarr.storage.LocalStore(self.root, read_only=read_only)
        if self.is_http:  # every GET through the bounded filesystem, on zarr's own event loop
            fs = _http_filesystem()(asynchronous=True, **self.storage_options)
            return zarr.storage.FsspecStore(fs, read_only=True, path=self.root)
        return zarr.storage.FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only)

    def read_bytes(self, key: str, limit: int = METADATA_LIMIT) -> bytes | None:
        """Contents of ``key``, or None when it does not exist.

        Nothing in a store is trusted: locally ``key`` must be a regular file (not a symbolic link, a FIFO, a device
        or a directory), and anywhere it must hold at most ``limit`` bytes; otherwise CorruptStoreError.
        """
        if self.archive is not None:
            return self.archive.read(key, limit)
        path = self.key_path(key)
        try:
            if self.is_local:
                fd, size = _open_bounded(self.root, key, limit)
                try:
                    return os.pread(fd, size, 0)
                finally:
                    os.close(fd)
            raw = self.fs.cat_file(path, start=0, end=limit + 1)
        except FileNotFoundError:
            return None
        if len(raw) > limit:
            raise CorruptStoreError(f"{path} holds more than the {limit:,} bytes it may")
        return raw

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes | None]:
        """Bytes ``starts[i] .. ends[i]`` of each ``keys[i]`` (None where the key does not exist), read concurrently
        on object storage and HTTP (one ranged GET each; a server that ignores Range sends the whole object, which
        is then cut).

        Raises
        ------
        CorruptStoreError
            An existing key holds fewer bytes than asked for (locally it must be a regular file).

        Examples
        --------
        >>> Location("/tmp/no-store").read_ranges(["packs/float32/c/0/0"], [0], [8])
        [None]
        """
        paths = [self.key_path(k) for k in keys]
        got: list[Any] = []
        if self.archive is not None:  # members of a packed store: byte ranges of the archive
            got = self.archive.read_ranges(keys, starts, ends)
        elif self.is_local:
            for key, a, b in zip(keys, starts, ends):
                try:
                    fd = open_beneath(self.root, key)
                except FileNotFoundError:
                    got.append(None)
                    continue
                try:
                    got.append(os.pread(fd, b - a, a))
                finally:
                    os.close(fd)
        else:
            got = self.fs.cat_ranges(paths, list(starts), list(ends), on_error="return")
        out: list[bytes | None] = []
        for path, a, b, raw in zip(paths, starts, ends, got):
            if isinstance(raw, FileNotFoundError):
                raw = None
            elif isinstance(raw, BaseException):
                raise raw
            if raw is not None and len(raw) != b - a:
                raise CorruptStoreError(
                    f"{path}: bytes {a:,}..{b:,} read as {len(raw):,} bytes; the file is shorter than its rows"
                )
            out.append(raw)
        return out

    @functools.cached_property
    def ranged(self) -> bool:
        """Whether a ranged read fetches only its bytes: always on local disk and object storage; over HTTP when the
        server answers a Range request with 206 Partial Content (asked once, of the root ``zarr.json``'s first byte: its
        answer is read no further than that byte, see ``get_object``; a packed store is opened over HTTP only from a
        server that does)."""
        if not self.is_http or self.archive is not None:
            return True
        return bool(fsspec.asyn.sync(self.fs.loop, self.fs.get_object, self.key_path("zarr.json"), "bytes=0-0")[3])

    def check_file(self, key: str, limit: int = METADATA_LIMIT) -> None:
        """Before a library (zarr) reads local ``key`` itself: a regular file of at most ``limit`` bytes, or missing."""
        if self.archive is not None:
            self.archive.check(key, limit)
            return
        if not self.is_local:
            return
        try:
            os.close(_open_bounded(self.root, key, limit)[0])
        except (FileNotFoundError, NotADirectoryError):  # missing (under a file too): what zarr then says is reported
            return

    def write_atomic(self, key: str, data: bytes, fsync: bool, if_match: str | None = None) -> str | None:
        """Replace ``key`` so that a reader sees the old or the new bytes, never a mix.

        Local: temp file + ``os.replace`` (atomic on POSIX), with fsync of file and directory for power loss. A
        temp file that could not be written whole (a full disk) is removed and never renamed into place. The key's
        directories are made if missing; one that is a link or a file raises CorruptStoreError (no write leaves the
        store).
        Object storage: a single PUT replaces an object whole; with ``if_match`` only if the object still has that
        ETag (the PUT fails otherwise). Returns the new object's ETag where the store reports one.
        """
        path = self.key_path(key)
        if not self.is_local:
            return _etag_of(self.fs.pipe_file(path, data, **({"IfMatch": if_match} if if_match else {})))
        tmp, fd = self.create_temp(key)
        try:
            try:
                write_all(fd, data)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if fsync:
            try:
                fsync_file(os.path.dirname(path))
            except OSError as e:  # the new bytes are in place and visible: raising would report a write that happened
                warnings.warn(
                    f"{path} was replaced but its directory could not be fsync'ed ({e}); it may not survive a power loss",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return None

    def create_temp(self, key: str) -> tuple[str, int]:
        """(path, descriptor open for writing) of a new local temp file ``<key>.<pid>.tmp`` that the caller renames
        onto ``key`` once written: the key's directories are made if missing, none of them a link (no write leaves the
        store), and the file is made anew, never through a link nor into one a killed process of the same pid left.

        Raises
        ------
        CorruptStoreError
            One of the key's directories is a link or a file.
        """
        self.make_parents(key)
        tmp = f"{self.key_path(key)}.{os.getpid()}.tmp"
        return tmp, _create_new(tmp)

    def make_parents(self, key: str, create: bool = True) -> None:
        """Make the local directories of ``key`` that are missing, none of them through a link; with ``create`` false,
        only check the ones that exist.

        Raises
        ------
        CorruptStoreError
            One of them is a link, or a file.
        """
        try:
            os.close(_dir_beneath(self.root, key.split("/")[:-1], create))
        except FileNotFoundError:
            if create:
                raise

    def etag(self, key: str) -> str | None:
        """The ETag of an object on object storage (None locally, or when the store reports none)."""
        if self.is_local:
            return None
        path = self.key_path(key)
        self.fs.invalidate_cache(path)  # a listing's cached entry would hide a newer object
        try:
            return self.fs.info(path).get("ETag")
        except FileNotFoundError:
            return None

    def holds_chunks(self) -> bool:
        """Whether any chunk of data exists under the location (a key :func:`is_chunk_key` recognises)."""
        if self.archive is not None:
            return any(map(is_chunk_key, self.archive.members))
        if self.is_local:
            return any(
                is_chunk_key(os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/"))
                for d, _, files in os.walk(self.root)
                for f in files
            )
        root = self.root.rstrip("/") + "/"
        return any(is_chunk_key(k[len(root) :]) for k in self.fs.find(self.root) if k.startswith(root))

    def clear(self, keep: str) -> None:
        """Remove everything under the location but ``keep`` (an unfinished create being started again)."""
        # the root zarr.json goes last: until then, a clear cut short leaves an unfinished create, still recognised
        if self.is_local:
            for name in sorted(os.listdir(self.root), key=lambda n: n == "zarr.json"):
                if name != keep:
                    self.remove(name)  # (a zarr temp file may be gone already: its own cleanup removed it first)
            return
        root_meta = self.key_path("zarr.json")
        doomed = [k for k in self.fs.find(self.root) if k not in (self.key_path(keep), root_meta)]
        if doomed:
            self.fs.rm(doomed)
        self.fs.rm_file(root_meta)

    def remove_temp_files(self, keys: Sequence[str] | None = None) -> int:
        """Remove the temp files that atomic writes of a writer killed mid-write left (``<key>.<pid>.tmp``, local disk
        only: on object storage a write is one PUT), under the whole location or, given ``keys``, of those keys only
        (a create's, in a directory that may hold other files; no link is followed to them). Call it holding the
        writer lock. Returns how many."""
        if not self.is_local:
            return 0
        if keys is None:
            return sum(_remove_temps(d, files) for d, _, files in os.walk(self.root))
        removed = 0
        for key in keys:
            *parts, stem = key.split("/")
            try:
                fd = _dir_beneath(self.root, parts, create=False)
            except FileNotFoundError:
                continue
            try:
                removed += _remove_temps(fd, [n for n in os.listdir(fd) if n.startswith(f"{stem}.")])
            finally:
                os.close(fd)
        return removed

    def remove(self, key: str) -> None:
        """Remove whatever is at ``key`` (a file, or locally a directory or link in a file's place, never what a link
        names: :func:`remove_beneath`); nothing there is no error. Only for keys no commit refers to, or whose data a
        commit has dropped."""
        if self.is_local:
            remove_beneath(self.root, key)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key_path(key), recursive=True)

    def exists(self, key: str) -> bool:
        if self.archive is not None:
            return self.archive.member(key) is not None
        return bool(self.fs.exists(self.key_path(key)))

    def open_range(self, key: str) -> tuple[io.FileIO, int, int]:
        """A local key's bytes as (an open file the caller closes, their offset in it, their size): a file of its
        own in a store directory, a member's bytes inside a packed store. Readers map or ``pread`` them.

        Raises
        ------
        FileNotFoundError
            No such key.
        CorruptStoreError
            In a directory, something other than a regular file, or a link on the way (:func:`open_beneath`).
        """
        if self.archive is not None:
            return self.archive.open_range(key)
        f = io.FileIO(open_beneath(self.root, key), "rb")
        return f, 0, os.fstat(f.fileno()).st_size


class ObjectReplaced(Exception):
    """A GET conditioned on an ETag (``If-Match``) found the object replaced since that ETag was read (HTTP 412)."""


def _range_header(start: int | None, end: int | None) -> str | None:
    """The HTTP Range of fsspec's ``start``/``end`` (end exclusive, a negative start counts from the end), or None for
    the whole object (also for a range HTTP cannot say: the whole object is then fetched and cut)."""
    if start is None and end is None:
        return None
    if start is not None and start < 0:
        return f"bytes={start}" if end is None else None
    start = start or 0
    if end is None:
        return f"bytes={start}-"
    return f"bytes={start}-{end - 1}" if end > start else None


@functools.cache
def _http_filesystem() -> type:
    """fsspec's HTTPFileSystem (aiohttp, imported only when a store is opened by http(s) URL), every GET of which is
    bounded and checked: nothing a server sends is trusted (see ``get_object``); no request outlives its deadline."""
    aiohttp = require("aiohttp", "http")
    from fsspec.implementations.http import HTTPFileSystem

    class StoreHTTPFileSystem(HTTPFileSystem):  # type: ignore[misc]
        """Reads of a her_store store over HTTP: bounded bodies, ranged and conditional GETs, one clear error each.

        Parameters
        ----------
        request_deadline : float, optional
            Seconds any one request may take in all, from its connection to its body's last byte (default
            ``HTTP_DEADLINE``); beyond it, ``StoreTimeoutError``. A server must also send something at least every
            ``HTTP_TIMEOUT`` s. Given as ``storage_options={"request_deadline": ...}``.
        client_kwargs : dict, optional
            As fsspec's; the session's default timeout is the idle one above unless these name another.
        **storage_options
            As fsspec's HTTPFileSystem's (headers, auth, and the like go with every request).
        """

        def __init__(
            self, *args: Any, request_deadline: float = HTTP_DEADLINE, client_kwargs: dict | None = None, **kwargs: Any
        ) -> None:
            if not is_number(request_deadline, finite=True) or request_deadline <= 0:
                raise ValueError(f"storage_options['request_deadline'] must be seconds > 0, got {request_deadline!r}")
            idle = aiohttp.ClientTimeout(sock_connect=HTTP_TIMEOUT, sock_read=HTTP_TIMEOUT)  # no total: the deadline's
            super().__init__(*args, client_kwargs={"timeout": idle, **(client_kwargs or {})}, **kwargs)
            self.request_deadline = float(request_deadline)

        async def _within_deadline(self, request: Any, what: str) -> Any:
            """The result of coroutine ``request`` (about ``what``, e.g. "GET <url>"), or StoreTimeoutError once it
            has run ``request_deadline`` seconds; it is then cancelled, which closes its connection."""
            task = asyncio.ensure_future(request)
            try:
                done, _ = await asyncio.wait((task,), timeout=self.request_deadline)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if not done:
                task.cancel()
                await asyncio.wait((task,))
                raise StoreTimeoutError(
                    f"{what}: no whole answer within the request deadline of {self.request_deadline:g} s "
                    "(storage_options['request_deadline'])"
                )
            return task.result()

        async def _info(self, url: str, **kwargs: Any) -> dict[str, Any]:
            return await self._within_deadline(super()._info(url, **kwargs), f"HEAD {url}")

        async def _ls_real(self, url: str, detail: bool = True, **kwargs: Any) -> list[Any]:
            return await self._within_deadline(super()._ls_real(url, detail, **kwargs), f"GET {url} (a listing)")

        async def _exists(self, path: str, strict: bool = False, **kwargs: Any) -> bool:
            return await self._within_deadline(super()._exists(path, strict, **kwargs), f"GET {path}")

        async def _cat_file(self, url: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
            if start is not None and end is not None and 0 <= end <= start:
                return b""
            rng = _range_header(start, end)
            limit = METADATA_LIMIT if url.endswith(".json") else OBJECT_LIMIT
            body, _, _, partial = await self.get_object(url, rng, limit=limit)
            if body is None:
                raise FileNotFoundError(url)
            return body if partial or rng is None and start is None and end is None else body[start:end]

        async def get_object(
            self, url: str, rng: str | None = None, if_match: str | None = None, limit: int = OBJECT_LIMIT
        ) -> tuple[bytes | None, str, int, bool]:
            """One GET, within ``request_deadline``: (the body, None when the server has no such object; its ETag or
            ""; the object's size; whether the server sent just the range asked for, 206).

            What is read of an answer is bounded: the body of a 206 is read no further than the
            bytes its ``Content-Range`` names (the range asked for, or less at the object's end) and one more, which
            tells a server that sends more than it names; of a whole object sent for a range ``bytes=a-b`` (a server
            that ignores Range), only the first ``b + 1`` bytes are read (the range lies within them; the size
            returned is then theirs); any other body, at most ``limit`` bytes. So the 206 answers to the concurrent
            GETs of a gather together hold no more than the ranges asked for and a byte each, whatever the server
            sends or announces (Content-Length, Content-Range).

            Raises
            ------
            ObjectReplaced
                ``if_match`` is given and the object no longer has that ETag (412).
            CorruptStoreError
                A body longer than ``limit`` bytes or than its range, cut short, or not the range its Content-Range
                names.
            StoreTimeoutError
                Nothing sent for ``HTTP_TIMEOUT`` s, or no whole answer within ``request_deadline`` s.
            OSError
                Another answer than 200, 206, 404, 410, 412 or 416, or no connection.
            """
            what = f"GET {url}" + (f" ({rng})" if rng else "")
            return await self._within_deadline(self._get_object(url, rng, if_match, limit), what)

        @staticmethod
        def _range_of(url: str, rng: str | None, content_range: str, limit: int) -> tuple[int, int]:
            """(the object's size, the bytes of the body) a 206's ``Content-Range`` names, checked to be the range
            ``rng`` asked for and at most ``limit`` bytes: the body is then read no further."""
            m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", content_range.strip())
            if m is None or int(m[2]) >= int(m[3]) or not _range_answers(rng, int(m[1]), int(m[2]), int(m[3])):
                raise CorruptStoreError(
                    f"{url}: a ranged GET answered with Content-Range {content_range!r}; expected "
                    f"'bytes first-last/size' naming the range asked for ({rng})"
                )
            want = int(m[2]) - int(m[1]) + 1
            if want > limit:
                raise CorruptStoreError(f"{url}: bytes {m[1]}-{m[2]} are {want:,}, more than the {limit:,} it may hold")
            return int(m[3]), want

        async def _get_object(
            self, url: str, rng: str | None, if_match: str | None, limit: int
        ) -> tuple[bytes | None, str, int, bool]:
            headers = dict(self.kwargs.get("headers") or {})
            if rng:
                headers["Range"] = rng
            if if_match:
                headers["If-Match"] = if_match
            kw = {**self.kwargs, "headers": headers}
            closed = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
            session = await self.set_session()
            try:
                async with session.get(self.encode_url(url), **kw) as r:
                    if r.status in (404, 410):
                        return None, "", 0, False
                    if r.status == 412:
                        raise ObjectReplaced(url)
                    if r.status == 416:  # a range past the end: the object is shorter than its readers need
                        return b"", "", 0, True
                    if r.status not in (200, 206):
                        raise OSError(f"GET {url} answered HTTP {r.status} {r.reason}")
                    size = None
                    if r.status == 206:
                        size, want = self._range_of(url, rng, r.headers.get("Content-Range", ""), limit)
                        if r.content_length is not None and r.content_length != want:
                            raise CorruptStoreError(
                                f"{url}: a ranged GET ({rng}) announced {r.content_length:,} bytes for the {want:,} "
                                f"its Content-Range {r.headers['Content-Range']!r} names"
                            )
                        cap = want + 1  # one byte past the range tells a server that sends more than it names
                    elif r.content_length is not None and r.content_length > limit:
                        raise CorruptStoreError(f"{url} holds {r.content_length:,} bytes, more than the {limit:,} it may")
                    else:  # a whole object: of one sent for a range bytes=a-b, the range lies in its first b + 1 bytes
                        cap = min(int(closed[2]) + 1, limit + 1) if closed else limit + 1
                    body = bytearray()
                    while len(body) < cap:
                        piece = await r.content.read(min(1 << 20, cap - len(body)))
                        if not piece:
                            break
                        body += piece
                    if r.status == 206 and len(body) != want:
                        raise CorruptStoreError(
                            f"{url}: a ranged GET ({rng}) answered {'more' if len(body) > want else 'fewer'} than the "
                            f"{want:,} bytes its Content-Range {r.headers['Content-Range']!r} names"
                        )
                    if len(body) > limit:
                        raise CorruptStoreError(f"{url} holds more than the {limit:,} bytes it may")
                    etag = r.headers.get("ETag", "")
            except aiohttp.ClientPayloadError as e:
                raise CorruptStoreError(f"{url}: the server's answer was cut short or malformed ({e})") from e
            except asyncio.TimeoutError as e:
                raise StoreTimeoutError(f"GET {url}: nothing sent for {HTTP_TIMEOUT:g} s") from e
            except aiohttp.ClientError as e:
                raise OSError(f"GET {url} failed: {e}") from e
            return bytes(body), etag, len(body) if size is None else size, r.status == 206

    return StoreHTTPFileSystem


async def s3_get_object(
    fs: Any, path: str, rng: str | None, if_match: str | None, limit: int
) -> tuple[bytes | None, str, int]:
    """One GET of an object through s3fs (on its event loop), ranged by ``rng`` and conditioned on ``if_match``: (its
    bytes, None when there is no such object; its ETag; the object's size, from the Content-Range of a range).

    Raises
    ------
    ObjectReplaced
        ``if_match`` is given and the object no longer has that ETag (412).
    CorruptStoreError
        The answer holds more than ``limit`` bytes (refused before a byte of it is read).
    """
    bucket, key, _ = fs.split_path(path)
    kw = {"Range": rng} if rng else {}
    if if_match is not None:
        kw["IfMatch"] = if_match
    try:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, **kw)
    except FileNotFoundError:
        return None, "", 0
    except OSError as e:
        if if_match is not None and _precondition_failed(e):
            raise ObjectReplaced(path) from e
        raise
    try:
        length = int(resp.get("ContentLength") or 0)
        if length > limit:
            raise CorruptStoreError(f"{path}: an answer of {length:,} bytes, more than the {limit:,} it may hold")
        body = await resp["Body"].read()
    finally:
        resp["Body"].close()
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]  # "bytes a-b/size" answers a ranged GET
    return body, str(resp.get("ETag") or ""), int(total) if total.isdigit() else len(body)


def _precondition_failed(e: BaseException) -> bool:
    """Whether an error s3fs raised is S3's 412 Precondition Failed (an If-Match that no longer holds)."""
    response = getattr(e.__cause__, "response", None) or {}
    return response.get("Error", {}).get("Code") == "PreconditionFailed" or (
        response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412
    )


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
    lock = os.open(tmp + _ALIVE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
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
        return pid != os.getpid() and not _pid_alive(pid)
    except OSError:
        return False  # a link or something else we cannot take for a lock: left alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # held: its job runs
    finally:
        os.close(fd)
    return True


def _range_answers(asked: str | None, first: int, last: int, size: int) -> bool:
    """Whether a 206's bytes ``first..last`` of ``size`` are the range ``asked`` (``bytes=a-b``, ``bytes=a-`` or
    ``bytes=-n``): a server may cut a range at the object's end, never move it.

    Examples
    --------
    >>> _range_answers("bytes=10-19", 10, 19, 100), _range_answers("bytes=10-19", 0, 9, 100)
    (True, False)
    >>> _range_answers("bytes=-8", 92, 99, 100), _range_answers("bytes=90-", 90, 99, 100)
    (True, True)
    """
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", asked or "")
    if m is None:
        return False
    if m[1]:
        return first == int(m[1]) and (last == size - 1 if not m[2] else last == min(int(m[2]), size - 1))
    return bool(m[2]) and last == size - 1 and first == max(0, size - int(m[2]))


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


def _dir_beneath(root: str, parts: Sequence[str], create: bool) -> int:
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
    parent = _dir_beneath(root, parts, create)
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
            os.close(_dir_beneath(root, parts[: i + 1], create=False))
        except FileNotFoundError:
            return
        except CorruptStoreError:  # parts[i] is a link or a file: it goes, and with it what was to be removed
            parts, name = parts[:i], parts[i]
            break
    parent = _dir_beneath(root, parts, create=False)
    try:
        _remove_in(parent, name)
    finally:
        os.close(parent)


def _remove_in(parent: int, name: str) -> None:
    """Remove whatever is at ``name`` in the directory ``parent`` (a directory with all it holds; a link itself)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=parent)
        else:
            os.unlink(name, dir_fd=parent)


def _remove_temps(directory: str | int, names: Sequence[str]) -> int:
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


def _create_new(path: str) -> int:
    """A new file at ``path``, for writing: whatever a process of the same pid left there (killed mid-write, or junk
    in a store from elsewhere) is removed first, and a link there is never followed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        parent = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _remove_in(parent, os.path.basename(path))
        finally:
            os.close(parent)
        return os.open(path, flags, 0o644)


def _open_bounded(root: str, key: str, limit: int) -> tuple[int, int]:
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder_text(raw: bytes | None) -> str:
    try:
        h = json.loads(raw or b"")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))
        text = f"pid {h['pid']} on host {h['host']} since {since}"
        return f"{text} (lease token {h['token']})" if "token" in h else text
    except (ValueError, KeyError, TypeError, OverflowError, OSError):
        return "an unknown writer"


def active_writer(location: Location, key: str) -> str | None:
    """Who is writing the store now, read without taking or touching the lock: the holder named in ``key`` when it is
    a live process on this host that holds the lock's flock (local disk: the kernel's flock is let go when the store
    is closed, and dies with the process) or a lease not yet expired (object storage); None when nobody is.

    Examples
    --------
    >>> import tempfile
    >>> active_writer(Location(tempfile.mkdtemp()), "writer.lock") is None
    True
    """
    try:
        raw = location.read_bytes(key, limit=1 << 16)
        h = json.loads(raw or b"")
        if location.is_local:
            alive = h["host"] == socket.gethostname() and _pid_alive(int(h["pid"])) and int(h["pid"]) != os.getpid()
            alive = alive and _flocked(location.root, key) is not False  # a writer that closed the store is gone
        else:
            alive = float(h["expires"]) >= time.time()
    except (ValueError, KeyError, TypeError, OverflowError, CorruptStoreError, OSError):
        return None
    return _holder_text(raw) if alive else None


def _flocked(root: str, key: str) -> bool | None:
    """Whether a process holds the exclusive flock on the local file ``key`` (as a writer of the store does while it is
    open), seen in the kernel's table of locks without taking or touching the lock; None where that table cannot be
    read."""
    fd = open_beneath(root, key)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:  # "1: FLOCK  ADVISORY  WRITE <pid> <major>:<minor>:<inode> 0 EOF"
            return any(p[1:3] == ["FLOCK", "ADVISORY"] and p[3] == "WRITE" and p[5] == where for p in map(str.split, f))
    except OSError:
        return None


def _token_of(raw: bytes | None) -> str | None:
    try:
        return json.loads(raw or b"")["token"]
    except (ValueError, KeyError, TypeError):
        return None


def _etag_of(reply: object) -> str | None:
    """The ETag of what ``fs.pipe_file`` wrote: s3fs returns S3's PutObject reply; other filesystems mostly None."""
    return reply.get("ETag") if isinstance(reply, Mapping) else None


class WriterLock:
    """One writer per store.

    Local disk: ``flock`` on ``writer.lock``; the kernel drops it when the holder dies (even by kill -9), so the
    lock of a dead process is taken over without any staleness guess. The file names the holder.

    Object storage: a lease object ``writer.lock`` naming its holder and a unique token. A fresh lease is created
    with a conditional PUT (If-None-Match: *). A daemon thread renews it every ``lease_ttl / 4`` seconds and
    :meth:`ensure_held` renews it before every commit, so a live writer keeps it however long it idles. A lease is
    stale when its holder is a dead process on this host or when ``expires`` has passed; another writer then takes
    it over. Where the store honours If-Match (S3), every lease write is fenced: a renewal or release names the
    ETag of our last write, a take-over the ETag of the stale lease it read, so a writer that was frozen past its
    TTL fails its next renewal and raises StoreLockedError before its commit writes a row. Filesystems that ignore
    If-Match (fsspec's memory://, possibly gcsfs) fall back to reading the lease and comparing its token before
    each write, and to delete + create for a take-over: correct unless two writers interleave within one round
    trip.

    Parameters
    ----------
    location : Location
        The store's place.
    key : str
        The lock's key in the store (``writer.lock``).
    lease_ttl : float
        Object storage: seconds a lease lasts unless renewed (a positive, finite number).

    Examples
    --------
    >>> import tempfile
    >>> lock = WriterLock(Location(tempfile.mkdtemp()), "writer.lock", lease_ttl=30)
    >>> lock.acquire(); lock.ensure_held(); lock.release()
    """

    def __init__(self, location: Location, key: str, lease_ttl: float = DEFAULT_LEASE_TTL) -> None:
        if not is_number(lease_ttl) or not 0 < lease_ttl < math.inf:
            raise ValueError(f"lease_ttl must be a positive, finite number of seconds, got {lease_ttl!r}")
        self.location = location
        self.key = key
        self.lease_ttl = float(lease_ttl)
        self._fd: int | None = None
        self._token: str = uuid.uuid4().hex  # also makes each writer's lease bytes, so their S3 ETag (an MD5), unique
        self._since = 0.0
        self._held = False
        self._etag: str | None = None  # of our last lease write; None where If-Match is not honoured
        self._lost: str | None = None  # why the lease is no longer ours
        self._mutex = threading.Lock()  # the renewal thread and a commit's check both write the lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        _LOCKS.add(self)

    def _record(self, expires: float | None = None) -> bytes:
        return json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "token": self._token,
                "since": self._since,
                "expires": time.time() + self.lease_ttl if expires is None else expires,
            }
        ).encode()

    def acquire(self) -> None:
        """Take the lock (local) or the lease (object storage, then renewed in the background until released).

        Raises
        ------
        StoreLockedError
            If another live writer holds it; the message names that writer.
        """
        self._since = time.time()
        if self.location.is_local:
            self._acquire_flock()
            return
        self._acquire_lease()
        self._held = True
        self._thread = threading.Thread(
            target=self._keep_renewing, name=f"her_store lease {self.location}", daemon=True
        )
        self._thread.start()

    def _acquire_flock(self) -> None:
        # never through a link: the record below truncates the file it opens
        fd = open_beneath(self.location.root, self.key, create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0)
            os.close(fd)
            raise StoreLockedError(
                f"{self.location} is being written by {_holder_text(holder)}; one writer per store "
                "(open with mode='r' to read while it writes)"
            ) from None
        try:  # the record only names the holder; the flock is the lock, and dies with this fd
            os.ftruncate(fd, 0)
            write_all(fd, self._record(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _acquire_lease(self) -> None:
        fs, path = self.location.fs, self.location.key_path(self.key)
        for _ in range(2):
            try:
                reply = fs.pipe_file(path, self._record(), mode="create")
            except FileExistsError:
                raw, etag = self._read_lease()
                if raw is None:
                    continue  # released and removed since: create it again
                if not self._stale(raw):
                    raise StoreLockedError(
                        f"{self.location} is being written by {_holder_text(raw)} (lease {self.key}); one writer per "
                        "store (open with mode='r' to read while it writes)"
                    ) from None
                if etag is None:
                    with contextlib.suppress(FileNotFoundError):  # another writer removed it first
                        fs.rm_file(path)
                    continue
                try:
                    # fails if the lease was renewed or taken over since it was read
                    reply = fs.pipe_file(path, self._record(), IfMatch=etag)
                except OSError:
                    continue
            self._etag = _etag_of(reply)
            if self._etag is not None and not self._if_match_honoured(path):
                self._etag = None
            return
        raise StoreLockedError(f"{self.location}: another writer took the stale lease {self.key} first")

    @property
    def fences_writes(self) -> bool:
        """Whether this writer holds an object-storage lease on a store that honours If-Match, so that its commit
        records can be written conditionally too (a writer that lost the lease then cannot replace them)."""
        return not self.location.is_local and self._etag is not None

    def _if_match_honoured(self, path: str) -> bool:
        """Whether the store refuses a PUT whose If-Match names an ETag the lease does not have. S3 does; a store
        that silently ignored it would make every fenced write unconditional, so that is checked, not assumed."""
        try:
            self.location.fs.pipe_file(path, self._record(), IfMatch='"her_store-if-match-probe"')
        except OSError:
            return True
        return False

    def _read_lease(self) -> tuple[bytes | None, str | None]:
        """The lease's bytes and an ETag of them (None where the filesystem reports none); (None, None) if absent."""
        path = self.location.key_path(self.key)
        self.location.fs.invalidate_cache(path)
        try:
            # the ETag first: the bytes read next are of that version or a newer one, so a write conditioned on
            # this ETag fails if what the bytes say is not what the lease still holds
            etag = self.location.fs.info(path).get("ETag")
        except FileNotFoundError:
            return None, None
        return self.location.read_bytes(self.key), etag

    def _stale(self, raw: bytes | None) -> bool:
        try:
            h = json.loads(raw or b"")
            if h["host"] == socket.gethostname() and not _pid_alive(int(h["pid"])):
                return True
            if h["host"] == socket.gethostname() and int(h["pid"]) == os.getpid():
                # this process's own lease: stale unless a handle here still holds it (a close whose release
                # failed leaves one behind, which must not lock this process out for lease_ttl)
                return not any(lock._held and lock._token == h.get("token") for lock in list(_LOCKS))
            return float(h["expires"]) < time.time()
        except (ValueError, KeyError, TypeError):
            return True

    def ensure_held(self) -> None:
        """Before a commit: renew the lease, which proves it is still ours (one conditional PUT on S3).

        A no-op on local disk, where the flock cannot be lost while this process holds the file open.

        Raises
        ------
        StoreLockedError
            If another writer took the lease over; the caller must then write nothing.
        OSError
            If the lease could not be read or written; whether it is still held is unknown, so nothing may be
            written either (a later call retries).
        """
        if self.location.is_local:
            return
        with self._mutex:
            self._renew()

    def _renew(self) -> None:
        """Extend the lease if it is still ours, else remember why not and raise StoreLockedError (holds _mutex)."""
        if self._lost is not None:
            raise StoreLockedError(self._lost)
        fs, path = self.location.fs, self.location.key_path(self.key)
        if self._etag is None:
            self._check_token(self.location.read_bytes(self.key))
            fs.pipe_file(path, self._record())
            return
        try:
            reply = fs.pipe_file(path, self._record(), IfMatch=self._etag)
        except OSError:
            raw, etag = self._read_lease()
            self._check_token(raw)
            self._etag = etag  # still ours: the write failed in transit, or was applied and its reply lost
            raise
        self._etag = _etag_of(reply)

    def _check_token(self, raw: bytes | None) -> None:
        if _token_of(raw) != self._token:
            self._lost = (
                f"{self.location} lost its writer lease {self.key} to {_holder_text(raw)}, which found it not renewed "
                f"within lease_ttl={self.lease_ttl:g} s (this writer was suspended or cut off from the store, or the "
                "hosts' clocks disagree) and took it over; this handle commits nothing more (reopen with mode='a' to "
                "append after that writer's commits)"
            )
            raise StoreLockedError(self._lost)

    def _keep_renewing(self) -> None:
        while not self._stop.wait(self.lease_ttl / 4) and self._lost is None:
            # a lost lease sets _lost, which ends the loop; any other failure (a network hiccup) must not end
            # renewal: the next round retries, and the pre-commit check reports a failure that persists
            with self._mutex, contextlib.suppress(Exception):
                self._renew()

    def _forked(self) -> None:
        """In a child after fork: the lock is the parent's. Close the inherited flock fd (the flock stays the
        parent's and is released when the parent dies) and never renew or release the parent's lease."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._held = False
        self._thread = None

    def release(self) -> None:
        """Give the lock or lease up; idempotent. A lease another writer took over is left to it."""
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking would race a waiting opener)
            self._fd = None
            return
        if not self._held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._held = False
        if self._lost is not None:
            return
        fs, path = self.location.fs, self.location.key_path(self.key)
        if self._etag is None:
            if _token_of(self.location.read_bytes(self.key)) == self._token:
                fs.rm_file(path)
            return
        # an expired record rather than a delete: S3 ignores If-Match on DELETE, and a blind delete could remove a
        # lease another writer has just taken. If this write fails, the lease lapses after lease_ttl.
        try:
            fs.pipe_file(path, self._record(expires=0.0), IfMatch=self._etag)
        except OSError as e:  # closing goes on: the lease lapses by itself, and this process can take it back
            warnings.warn(
                f"{self.location}: the writer lease {self.key} could not be released ({e}); other processes can take "
                f"it over after lease_ttl={self.lease_ttl:g} s",
                RuntimeWarning,
                stacklevel=2,
            )


_LOCKS: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_LOCKS):
        if lock._pid != os.getpid():
            lock._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def chunk_key(path: str, chunk: int, ndim: int, separator: str) -> str:
    """Key of chunk ``chunk`` along rows of a row-chunked array (v3 default encoding with ``separator``, ``"/"`` or
    ``"."``: ``<path>/c/<i>/0...`` or ``<path>/c.<i>.0...``)."""
    return f"{path}/" + separator.join(["c", str(chunk)] + ["0"] * (ndim - 1))


def is_chunk_key(key: str) -> bool:
    """Whether a key relative to a store has the form of one of its chunks' (FORMAT.md, chunk keys):
    ``packs/<dtype>/c/<i>/0``, ``episodes/<column>/c/<i>``, ``steps/<field>/c/<i>/0...`` (versions 1 and 2) or
    ``steps/<field>/c.<i>.0...`` (version 3, at least one ``.0``)."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "steps":
        return len(parts[2].split(".")) >= 3 and chunk_of(parts[2], ".") is not None
    if len(parts) < 4 or parts[2] != "c" or chunk_of(parts[3], "/") is None or any(p != "0" for p in parts[4:]):
        return False
    axes = len(parts) - 3
    return (parts[0], axes) in (("packs", 2), ("episodes", 1)) or (parts[0] == "steps" and axes >= 2)


def chunk_entry(path: str, chunk: int, ndim: int, separator: str) -> str:
    """The entry of an array's directory tree that holds chunk ``chunk`` and nothing else: the file ``<path>/c.<i>.0...``
    for ``"."``; for ``"/"``, ``<path>/c/<i>``, the chunk's own directory (or, for a 1-D array, its file). Removing it
    removes the chunk, whatever is there, and never reaches past a link in its place."""
    return chunk_key(path, chunk, ndim, separator) if separator == "." else f"{path}/c/{chunk}"


def key_separator(array: zarr.Array) -> str:
    """The separator of an array's chunk keys, from its metadata (checked against the layout when it was opened)."""
    return str(array.metadata.chunk_key_encoding.separator)


def chunk_of(name: str, separator: str, ndim: int | None = None) -> int | None:
    """The chunk index of a name in an array's directory or its ``c/`` subdirectory, or None for any other name
    (metadata, a temp file, a number written otherwise): for ``"/"``, the directory name ``<i>``; for ``"."``, the file
    name ``c.<i>.0...``, with one ``.0`` per axis after the first (``ndim``; any number when None). ``<i>`` is ASCII
    digits without a leading zero, as zarr writes it."""
    if separator == ".":
        parts = name.split(".")
        if len(parts) < 2 or parts[0] != "c" or any(p != "0" for p in parts[2:]):
            return None
        if ndim is not None and len(parts) != ndim + 1:
            return None
        name = parts[1]
    if not (name.isascii() and name.isdigit()) or (name[0] == "0" and name != "0"):
        return None
    return int(name)


def _pread_into(root: str, key: str, buf: np.ndarray, offset: int) -> int:
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


class RawChunkFile:
    """Rows of an uncompressed local array written in place with ``pwrite`` (see the module docstring).

    Its chunk files stay open between writes, at most its share of ``OPEN`` (every writer's arrays in the process).
    """

    OPEN = FileShares(divisor=16, least=1, most=4096)

    def __init__(
        self, root: str, path: str, dtype: np.dtype, row_shape: tuple[int, ...], chunk_rows: int, separator: str,
        archive: PackedArchive | None = None,
    ) -> None:
        self.root = root
        self.archive = archive  # a packed store's: rows are read from its members (it is never written)
        self.path = path
        self.separator = separator
        self.dtype = dtype
        self.row_shape = row_shape
        self.row_nbytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        self.chunk_rows = chunk_rows
        self._fds: dict[int, int] = {}
        self._dirty: set[int] = set()
        self.OPEN.join(self)

    def _key(self, chunk: int) -> str:
        return chunk_key(self.path, chunk, 1 + len(self.row_shape), self.separator)

    def _file(self, chunk: int) -> str:
        return os.path.join(self.root, self._key(chunk))

    def _fd(self, chunk: int) -> int:
        fd = self._fds.get(chunk)
        if fd is None:
            fd = open_beneath(self.root, self._key(chunk), create=True)  # a link or a directory there: refused
            size = self.chunk_rows * self.row_nbytes
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zarr expects a full chunk; the unwritten tail stays sparse
            while self._fds and len(self._fds) >= self.OPEN.share():
                os.close(self._fds.pop(next(iter(self._fds))))
            self._fds[chunk] = fd
        return fd

    def write(self, row0: int, rows: np.ndarray) -> None:
        data = np.ascontiguousarray(rows, dtype=self.dtype)
        n = len(data)
        at = 0
        while at < n:
            chunk, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            write_all(self._fd(chunk), data[at : at + take], r * self.row_nbytes)
            self._dirty.add(chunk)
            at += take

    def flush(self, fsync: bool) -> None:
        if fsync:
            dirs = set()
            for chunk in self._dirty:
                os.fsync(self._fd(chunk))
                dirs.add(os.path.dirname(self._file(chunk)))
            for d in dirs:
                fsync_file(d)
        self._dirty.clear()

    def read(self, row0: int, row1: int) -> np.ndarray:
        """Rows ``[row0, row1)``; rows past a chunk file's end (never written) read as zeros."""
        out = np.empty((row1 - row0, *self.row_shape), self.dtype)
        flat = out.reshape(-1).view(np.uint8)
        at = row0
        while at < row1:
            chunk, r = divmod(at, self.chunk_rows)
            take = min(row1 - at, self.chunk_rows - r)
            o, n = (at - row0) * self.row_nbytes, take * self.row_nbytes
            if self.archive is not None:
                buf = self.archive.pread(self._key(chunk), n, r * self.row_nbytes)
                got = len(buf)
                flat[o : o + got] = np.frombuffer(buf, np.uint8)
            else:
                got = _pread_into(self.root, self._key(chunk), flat[o : o + n], r * self.row_nbytes)
            flat[o + got : o + n] = 0
            at += take
        return out

    def discard(self, chunk: int) -> None:
        """Remove a chunk that holds no committed row, whatever is there (:func:`chunk_entry`; a link itself, never
        what it names)."""
        fd = self._fds.pop(chunk, None)
        if fd is not None:
            os.close(fd)
        self._dirty.discard(chunk)
        remove_beneath(self.root, chunk_entry(self.path, chunk, 1 + len(self.row_shape), self.separator))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.OPEN.leave(self)


class ZarrChunks:
    """Rows of a compressed or remote array, written as whole chunks through zarr (see the module docstring)."""

    def __init__(self, array: zarr.Array, location: Location, raw: bool = False) -> None:
        self.array = array
        self.location = location
        self.chunk_rows = int(array.chunks[0])
        self.raw = raw  # uncompressed: rows are read as byte ranges of their chunks, not whole chunks through zarr
        self._cache: dict[int, np.ndarray] = {}
        self._dirty: set[int] = set()

    def _key(self, chunk: int) -> str:
        return chunk_key(self.array.path, chunk, self.array.ndim, key_separator(self.array))

    def _check(self, first: int, last: int) -> None:
        """Locally, before zarr reads or replaces chunks ``first .. last`` (it would follow a link, and block on a
        FIFO): each a regular file of at most what a compressed chunk may hold (:func:`~her_store.format.frames.shard_limit`,
        as copies and verify bound it), or missing, with no link on its way (:meth:`Location.check_file`)."""
        if self.location.is_local:
            from her_store.format.frames import shard_limit  # (shard builds on this module)

            row_nbytes = int(np.prod(self.array.shape[1:], dtype=np.int64)) * np.dtype(self.array.dtype).itemsize
            limit = shard_limit(self.chunk_rows, row_nbytes)
            for chunk in range(first, last + 1):
                self.location.check_file(self._key(chunk), limit)

    def _chunk(self, chunk: int) -> np.ndarray:
        buf = self._cache.get(chunk)
        if buf is None:
            self._check(chunk, chunk)
            r0 = chunk * self.chunk_rows
            buf = np.array(self.array[r0 : r0 + self.chunk_rows])  # fill values where the chunk does not exist yet
            self._cache[chunk] = buf
        return buf

    def write(self, row0: int, rows: np.ndarray) -> None:
        n = len(rows)
        at = 0
        while at < n:
            chunk, r = divmod(row0 + at, self.chunk_rows)
            take = min(n - at, self.chunk_rows - r)
            self._chunk(chunk)[r : r + take] = rows[at : at + take]
            self._dirty.add(chunk)
            at += take

    def flush(self, fsync: bool) -> None:
        for chunk in sorted(self._dirty):
            self._check(chunk, chunk)
            r0 = chunk * self.chunk_rows
            self.array[r0 : r0 + self.chunk_rows] = self._cache[chunk]
            if fsync and self.location.is_local:
                fsync_file(self.location.key_path(self._key(chunk)))
        if fsync and self.location.is_local and self._dirty:
            fsync_file(os.path.dirname(self.location.key_path(self._key(max(self._dirty)))))
        # keep only the newest chunk: the next commit most likely appends to it
        if self._dirty:
            keep = max(self._dirty)
            self._cache = {keep: self._cache[keep]}
        self._dirty.clear()

    def read(self, row0: int, row1: int) -> np.ndarray:
        if row1 > self.array.shape[0]:
            raise IndexError(f"rows {row0}..{row1} of {self.array.path} past its {self.array.shape[0]} rows")
        if self.raw:
            return self._read_ranges(row0, row1)
        if row1 > row0:
            self._check(row0 // self.chunk_rows, (row1 - 1) // self.chunk_rows)
        try:
            return np.asarray(self.array[row0:row1])
        except (ValueError, RuntimeError, TypeError) as e:  # what numcodecs and zarr raise for undecodable bytes
            raise CorruptStoreError(f"rows {row0}..{row1} of {self.array.path} cannot be decoded ({e})") from e

    def _read_ranges(self, row0: int, row1: int) -> np.ndarray:
        """Rows of an uncompressed array, one byte range of each chunk they lie in (read at once; a chunk never
        written reads as zeros): a row of a 1,048,576-row chunk costs its bytes, not the chunk's."""
        keys, starts, ends, rows = self._ranges(row0, row1)
        return rows(self.location.read_ranges(keys, starts, ends))

    def _ranges(
        self, row0: int, row1: int
    ) -> tuple[list[str], list[int], list[int], Callable[[Sequence[bytes | None]], np.ndarray]]:
        """The byte ranges (keys, starts, ends) that hold rows ``row0 .. row1`` of an uncompressed array, and what
        makes the rows of their bytes (None for a chunk never written: zeros)."""
        dtype, row_shape = np.dtype(self.array.dtype).newbyteorder("<"), tuple(self.array.shape[1:])
        row_nbytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        first = np.arange(row0 - row0 % self.chunk_rows, row1, self.chunk_rows)
        lo, hi = np.maximum(first, row0), np.minimum(first + self.chunk_rows, row1)
        keys = [self._key(c) for c in (first // self.chunk_rows).tolist()]

        def rows(got: Sequence[bytes | None]) -> np.ndarray:
            out = np.zeros((row1 - row0, *row_shape), dtype)
            flat = out.reshape(-1).view(np.uint8)
            for a, raw in zip((lo - row0) * row_nbytes, got):
                if raw is not None:
                    flat[a : a + len(raw)] = np.frombuffer(raw, np.uint8)
            return out

        return keys, ((lo - first) * row_nbytes).tolist(), ((hi - first) * row_nbytes).tolist(), rows

    def discard(self, chunk: int) -> None:
        """Remove a chunk that holds no committed row, whatever is there (:func:`chunk_entry`)."""
        self._cache.pop(chunk, None)
        self._dirty.discard(chunk)
        self.location.remove(chunk_entry(self.array.path, chunk, self.array.ndim, key_separator(self.array)))

    def close(self) -> None:
        self._cache.clear()


def read_rows(reads: Sequence[tuple[RawChunkFile | ZarrChunks, int, int]]) -> list[np.ndarray]:
    """``io.read(row0, row1)`` for each ``(io, row0, row1)``; the byte ranges of uncompressed arrays on object storage
    or HTTP, all on one location, are fetched together (one round of concurrent GETs for the ten index columns of an
    episode table, rather than ten rounds one after the other).

    Examples
    --------
    >>> cols = read_rows([(col, 0, 5) for col in store._index_io.values()])  # doctest: +SKIP
    """
    remote = [
        (i, col) for i, (col, _, row1) in enumerate(reads)
        if isinstance(col, ZarrChunks) and col.raw and not col.location.is_local and row1 <= col.array.shape[0]
    ]
    plans = {i: col._ranges(reads[i][1], reads[i][2]) for i, col in remote if col.location is remote[0][1].location}
    if len(plans) < 2:
        return [col.read(row0, row1) for col, row0, row1 in reads]
    keys, starts, ends = ([x for plan in plans.values() for x in plan[j]] for j in range(3))
    got = remote[0][1].location.read_ranges(keys, starts, ends)  # type: ignore[arg-type]
    out: list[np.ndarray] = []
    at = 0
    for i, (col, row0, row1) in enumerate(reads):
        if i in plans:
            n, rows = len(plans[i][0]), plans[i][3]
            out.append(rows(got[at : at + n]))
            at += n
        else:
            out.append(col.read(row0, row1))
    return out


def chunk_io(location: Location, array: zarr.Array, compressed: bool) -> RawChunkFile | ZarrChunks:
    """Row access to one array, whose metadata the caller has checked against the layout (it names the files written):
    raw files for uncompressed local arrays, whole chunks through zarr otherwise."""
    if location.is_local and not compressed:
        return RawChunkFile(
            location.root, array.path, array.dtype, tuple(array.shape[1:]), int(array.chunks[0]), key_separator(array),
            location.archive,
        )
    return ZarrChunks(array.with_config(ZARR_CONFIG), location, raw=not compressed)
