"""A store on object storage through fsspec (S3 through s3fs, GCS, memory://): whole-object PUTs, conditional PUTs for
the lease and create-once, ranged GETs, and on S3 GETs conditioned on an ETag.

An object store has no directories, no holes and no torn objects: a PUT replaces an object whole, so every write is
atomic by itself; each request is a round trip, so what can go together is sent concurrently.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import fsspec
import fsspec.asyn
import zarr.storage

from her_store.errors import CorruptStoreError
from her_store.storage.base import METADATA_LIMIT, OBJECT_LIMIT, Backend, Defaults, ObjectReplaced, WriterLock
from her_store.storage.lock import LeaseLock

__all__ = ["FsspecBackend", "s3_get_object"]


class FsspecBackend(Backend):
    """A store at an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

    Parameters
    ----------
    url : str
        The store's URL.
    storage_options : mapping, optional
        Passed to fsspec (credentials, ``client_kwargs={"endpoint_url": ...}``).
    fs : fsspec filesystem, optional
        The filesystem to use (one that bounds what it reads, say); by default the URL's.

    Examples
    --------
    >>> backend = FsspecBackend("memory://objects")
    >>> backend.create_once("sharded.json", b"{}"), backend.create_once("sharded.json", b"[]")
    (True, False)
    >>> backend.read_bytes("sharded.json")
    b'{}'
    """

    defaults = Defaults(chunk_rows=1 << 13, index_chunk_rows=1 << 13, commit_interval=2.0, refresh_interval=1.0)

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        url_fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.fs = url_fs if fs is None else fs
        self.conditional = _is_s3(self.fs)

    @property
    def fs(self) -> Any:
        """The fsspec filesystem; in a forked child, one of its own made as this one was, on first use there (fsspec's
        runs on an event loop thread of the parent's, which the child does not have, and its sessions are bound to
        that loop)."""
        if self._fs_pid != os.getpid():
            self._fs = type(self._fs)(*self._fs.storage_args, **self._fs.storage_options)
            self._fs_pid = os.getpid()
        return self._fs

    @fs.setter
    def fs(self, fs: Any) -> None:
        self._fs, self._fs_pid = fs, os.getpid()

    # -- reading ------------------------------------------------------------------------------------------------------
    def read_bytes(self, key: str, limit: int = METADATA_LIMIT) -> bytes | None:
        path = self.key_path(key)
        try:
            raw = self.fs.cat_file(path, start=0, end=limit + 1)
        except FileNotFoundError:
            return None
        if len(raw) > limit:
            raise CorruptStoreError(f"{path} holds more than the {limit:,} bytes it may")
        return raw

    def read_objects(self, keys: Sequence[str], limit: int = OBJECT_LIMIT) -> list[bytes | None]:
        """Each of ``keys`` whole (None where it does not exist), read concurrently.

        Raises
        ------
        CorruptStoreError
            One holds more than ``limit`` bytes.
        """
        paths = [self.key_path(k) for k in keys]
        out: list[bytes | None] = []
        got = self.fs.cat_ranges(paths, [0] * len(paths), [limit + 1] * len(paths), on_error="return")
        for path, raw in zip(paths, got):
            if isinstance(raw, FileNotFoundError):
                raw = None
            elif isinstance(raw, BaseException):
                raise raw
            elif len(raw) > limit:
                raise CorruptStoreError(f"{path} holds more than the {limit:,} bytes it may")
            out.append(raw)
        return out

    def _read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[Any]:
        paths = [self.key_path(k) for k in keys]
        return list(self.fs.cat_ranges(paths, list(starts), list(ends), on_error="return"))

    async def get_object(
        self, key: str, rng: str | None, if_match: str | None, limit: int
    ) -> tuple[bytes | None, str, int]:
        """On S3, one GET through s3fs's client (:func:`s3_get_object`), conditioned on ``if_match``."""
        if not self.conditional:
            raise NotImplementedError(f"{self} cannot condition a GET on an ETag: read objects whole")
        return await s3_get_object(self.fs, self.key_path(key), rng, if_match, limit)

    def run(self, coroutine: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        """On fsspec's I/O thread, from any other thread."""
        return fsspec.asyn.sync(self.fs.loop, coroutine, *args)

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self.key_path(key)))

    def head(self, key: str) -> str | None:
        """The ETag of ``key`` as the store says it now (no cached listing), None where it reports none.

        Raises
        ------
        FileNotFoundError
            There is no such object.
        """
        path = self.key_path(key)
        self.fs.invalidate_cache(path)  # a listing's cached entry would hide a newer object
        return self.fs.info(path).get("ETag")

    def etag(self, key: str) -> str | None:
        try:
            return self.head(key)
        except FileNotFoundError:
            return None

    def size(self, key: str) -> int:
        return int(self.fs.size(self.key_path(key)))

    def fingerprints(self, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
        """ETags and sizes, from one listing."""
        self.fs.invalidate_cache(self.root)
        listed = self.fs.find(self.root, detail=True)
        infos = {key: listed[self.key_path(key)] for key in keys if self.key_path(key) in listed}
        return {k: (str(i.get("ETag") or i.get("etag") or ""), int(i.get("size") or 0)) for k, i in infos.items()}

    def list_files(self, prefix: str = "") -> dict[str, int]:
        root = self.root.rstrip("/") + "/"
        path = self.key_path(prefix)
        self.fs.invalidate_cache(path)
        found = self.fs.find(path, detail=True)
        return {name[len(root) :]: int(info.get("size") or 0) for name, info in found.items() if name.startswith(root)}

    def list_dir(self, prefix: str) -> list[str]:
        path = self.key_path(prefix)
        self.fs.invalidate_cache(path)  # listings are cached by s3fs and others: a refresh must see new objects
        try:
            listed = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(name).rstrip("/").rsplit("/", 1)[-1] for name in listed)

    def list_dirs(self, prefix: str) -> list[str]:
        """The directory-like prefixes directly under ``prefix``, sorted."""
        path = self.key_path(prefix)
        self.fs.invalidate_cache(path)
        try:
            listed = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in listed if e.get("type") == "directory")

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        return zarr.storage.FsspecStore.from_url(self.url, storage_options=self.storage_options, read_only=read_only)

    # -- writing ------------------------------------------------------------------------------------------------------
    def put(self, key: str, data: bytes, *, create: bool = False, if_match: str | None = None) -> str | None:
        """One PUT of ``key``: only if it does not exist with ``create`` (If-None-Match: *), only while it has ETag
        ``if_match`` with that; the new object's ETag where the store reports one.

        Raises
        ------
        FileExistsError
            ``create`` and the object exists.
        OSError
            ``if_match`` no longer holds (or the PUT failed otherwise).
        """
        self._writable()
        kw: dict[str, Any] = {"mode": "create"} if create else {}
        if if_match:
            kw["IfMatch"] = if_match
        reply = self.fs.pipe_file(self.key_path(key), data, **kw)
        return reply.get("ETag") if isinstance(reply, Mapping) else None  # s3fs returns S3's PutObject reply

    def write_atomic(self, key: str, data: bytes, fsync: bool, if_match: str | None = None) -> str | None:
        """A single PUT replaces an object whole; with ``if_match`` only if the object still has that ETag."""
        return self.put(key, data, if_match=if_match)

    def create_once(self, key: str, data: bytes) -> bool:
        """One PUT with ``If-None-Match: *``."""
        try:
            self.put(key, data, create=True)
        except FileExistsError:
            return False
        return True

    def put_many(self, items: Mapping[str, bytes]) -> None:
        self._writable()
        self.fs.pipe({self.key_path(k): v for k, v in items.items()})

    def make_root(self) -> None:
        self._writable()
        self.fs.makedirs(self.root, exist_ok=True)

    def existing(self, keys: Sequence[str]) -> list[str]:
        found = set(self.fs.find(self.root, withdirs=True))
        return [k for k in keys if self.key_path(k) in found]

    def clear(self, keep: str) -> None:
        self._writable()
        root_meta = self.key_path("zarr.json")
        doomed = [k for k in self.fs.find(self.root) if k not in (self.key_path(keep), root_meta)]
        if doomed:
            self.fs.rm(doomed)
        self.fs.rm_file(root_meta)

    def remove(self, key: str) -> None:
        self._writable()
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key_path(key), recursive=True)

    def writer_lock(self, key: str, lease_ttl: float) -> WriterLock:
        self._writable()
        return LeaseLock(self, key, lease_ttl)

    def active_writer(self, key: str) -> str | None:
        return LeaseLock.holder(self, key)

    def child(self, key: str) -> FsspecBackend:
        return type(self)(f"{self.url}/{key}", self.storage_options)


def _is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem, whose GETs take S3's If-Match."""
    try:
        import s3fs
    except ImportError:
        return False
    return isinstance(fs, s3fs.S3FileSystem)


async def s3_get_object(
    fs: Any, path: str, rng: str | None, if_match: str | None, limit: int
) -> tuple[bytes | None, str, int]:
    """One GET of an object through s3fs's S3 client (on its event loop), ranged by ``rng`` and conditioned on
    ``if_match``: (its bytes, None when there is no such object; its ETag; the object's size, from the Content-Range of
    a range). botocore's own retries apply (throttling, 5xx).

    Raises
    ------
    ObjectReplaced
        ``if_match`` is given and the object no longer has that ETag (412).
    CorruptStoreError
        The answer holds more than ``limit`` bytes (refused before a byte of it is read).
    OSError
        Any other failed request.
    """
    from botocore.exceptions import ClientError

    bucket, key, _ = fs.split_path(path)
    kw = {"Range": rng} if rng else {}
    if if_match is not None:
        kw["IfMatch"] = if_match
    await fs.set_session()
    client = await fs.get_s3(bucket)
    try:
        resp = await client.get_object(Bucket=bucket, Key=key, **kw)
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("NoSuchKey", "NoSuchBucket", "404") or status == 404:
            return None, "", 0
        if if_match is not None and (code == "PreconditionFailed" or status == 412):
            raise ObjectReplaced(path) from e
        raise OSError(f"GET {path} failed: {e}") from e
    try:
        length = int(resp.get("ContentLength") or 0)
        if length > limit:
            raise CorruptStoreError(f"{path}: an answer of {length:,} bytes, more than the {limit:,} it may hold")
        body = await resp["Body"].read()
    finally:
        resp["Body"].close()
    total = str(resp.get("ContentRange") or "").rpartition("/")[2]  # "bytes a-b/size" answers a ranged GET
    return body, str(resp.get("ETag") or ""), int(total) if total.isdigit() else len(body)
