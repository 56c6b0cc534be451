"""A store read over plain HTTP(S) from any static file server: bounded, ranged and conditional GETs, each within a
deadline; read-only.

Nothing a server sends is trusted: every body is read no further than what was asked for (a ranged GET's range, an
object's bound), a 206 must name the range asked for, and every request ends within ``request_deadline`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import zarr.storage

from her_store.checks import check_number
from her_store.errors import CorruptStoreError, StoreTimeoutError
from her_store.extras import require
from her_store.storage.base import METADATA_LIMIT, OBJECT_LIMIT, ObjectReplaced, WriterLock
from her_store.storage.objects import FsspecBackend

__all__ = ["HTTP_DEADLINE", "HTTP_TIMEOUT", "HTTPBackend", "http_filesystem"]

HTTP_TIMEOUT = 60.0  # seconds an HTTP server may take to answer, or to send the next bytes of a body
HTTP_DEADLINE = 300.0  # seconds one HTTP request may take in all (storage_options["request_deadline"] sets another)


class HTTPBackend(FsspecBackend):
    """A store served over HTTP(S): read-only, every GET bounded and within a deadline (:func:`http_filesystem`).

    Parameters
    ----------
    url : str
        The store's URL.
    storage_options : mapping, optional
        Headers, auth and other options of fsspec's HTTP filesystem, and ``request_deadline`` (seconds any one
        request may take in all; default ``HTTP_DEADLINE``).

    Examples
    --------
    >>> HTTPBackend("https://example.org/datasets/point").read_only  # doctest: +ELLIPSIS
    'https://example.org/datasets/point is served over HTTP, which is read-only: ...'
    """

    conditional = True  # If-Match, RFC 9110 (a server that ignores it is found out: readers probe it)
    lists = False  # a static file server's directory pages are no listing of keys

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.root = self.url
        self.fs = http_filesystem()(**self.storage_options)
        self._zarr_filesystems: list[tuple[int, Any]] = []  # zarr_store's (process, filesystem): sessions close() ends
        self.read_only = (
            f"{self.url} is served over HTTP, which is read-only: a store opened by URL is never written and "
            "takes no writer lock (copy it with `her-store copy` to write to it)"
        )

    async def get_object(
        self, key: str, rng: str | None, if_match: str | None, limit: int
    ) -> tuple[bytes | None, str, int]:
        """One bounded GET (``StoreHTTPFileSystem.get_object``); a server that ignores Range sends the whole object,
        whose size is then the body's."""
        body, etag, size, _ = await self.fs.get_object(self.key_path(key), rng, if_match, limit)
        return body, etag, size

    def read_head(self, key: str, n: int) -> tuple[bytes | None, str, int, bool]:
        # a whole file sent for the range is read no further than its first n bytes
        return self.run(self.fs.get_object, self.key_path(key), f"bytes=0-{n - 1}", None, OBJECT_LIMIT)  # type: ignore[no-any-return]

    @functools.cached_property
    def ranged(self) -> bool:
        """Whether the server answers a Range request with 206 Partial Content (asked once, of the root
        ``zarr.json``'s first byte: its answer is read no further than that byte)."""
        return self.read_head("zarr.json", 1)[3]

    def fingerprints(self, keys: Sequence[str]) -> dict[str, tuple[str, int]]:
        """ETags and sizes, one HEAD each (a server offers no listing); "" where it sends no ETag."""
        out = {}
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                i = self.fs.info(self.key_path(key))
                out[key] = (str(i.get("ETag") or i.get("etag") or ""), int(i.get("size") or 0))
        return out

    def zarr_store(self, read_only: bool) -> zarr.storage.StoreLike:
        # every GET through the bounded filesystem, on zarr's own event loop; the filesystem is this backend's alone
        # (not fsspec's cached instance), so that close() may end its session
        fs = http_filesystem()(asynchronous=True, skip_instance_cache=True, **self.storage_options)
        self._zarr_filesystems.append((os.getpid(), fs))
        return zarr.storage.FsspecStore(fs, read_only=True, path=self.root)

    def close(self) -> None:
        """End the HTTP sessions of zarr's reads, on zarr's event loop (fsspec ends a session of its own loop when
        its filesystem goes, but not one of an asynchronous filesystem: aiohttp then warns of an unclosed session)."""
        while self._zarr_filesystems:
            pid, fs = self._zarr_filesystems.pop()
            session = getattr(fs, "_session", None)  # made by the first request, if any
            if session is not None and not session.closed and pid == os.getpid():  # (a parent's loop is not here)
                zarr.core.sync.sync(session.close())

    def writer_lock(self, key: str, lease_ttl: float) -> WriterLock:
        self._writable()
        raise AssertionError("unreachable: an HTTP store is read-only")

    def active_writer(self, key: str) -> str | None:
        return None  # whoever writes the store writes it elsewhere: a server's files have no lease here

    def child(self, key: str) -> HTTPBackend:
        return HTTPBackend(f"{self.url}/{key}", self.storage_options)


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


class _BoundedHTTPReads:
    """The methods of :func:`http_filesystem`'s class, which puts them ahead of fsspec's HTTPFileSystem (imported,
    with aiohttp, only when a store is opened by http(s) URL): bounded bodies, ranged and conditional GETs, each within
    its deadline, one clear error each."""

    def __init__(
        self, *args: Any, request_deadline: float = HTTP_DEADLINE, client_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        aiohttp = require("aiohttp", "http")
        deadline = check_number(
            request_deadline, "storage_options['request_deadline']", low=0, low_open=True, finite=True
        )
        idle = aiohttp.ClientTimeout(sock_connect=HTTP_TIMEOUT, sock_read=HTTP_TIMEOUT)  # no total: the deadline's
        super().__init__(*args, client_kwargs={"timeout": idle, **(client_kwargs or {})}, **kwargs)
        self.request_deadline = deadline

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
        aiohttp = require("aiohttp", "http")
        headers = dict(self.kwargs.get("headers") or {})
        if rng:
            headers["Range"] = rng
        if if_match:
            headers["If-Match"] = if_match
        kw = {**self.kwargs, "headers": headers}
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
                size, want, cap = self._read_bound(url, rng, r, limit)
                body = await self._read_at_most(r, cap)
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
        except aiohttp.TooManyRedirects as e:
            raise OSError(f"GET {url} failed: redirected {len(e.history)} times (a redirect loop?)") from e
        except aiohttp.ClientError as e:
            raise OSError(f"GET {url} failed: {e or type(e).__name__}") from e
        return bytes(body), etag, len(body) if size is None else size, r.status == 206

    def _read_bound(self, url: str, rng: str | None, r: Any, limit: int) -> tuple[int | None, int | None, int]:
        """For answer ``r`` (200 or 206) to a GET of ``rng``: (the object's size and the bytes of the range, as a
        206's ``Content-Range`` names them, else None and None; the most bytes of the body to read). Of a 206, its
        range and one byte more, which tells a server that sends more than it names; of a whole object sent for a
        range ``bytes=a-b``, its first ``b + 1`` bytes (the range lies in them); of any other body, ``limit + 1``."""
        if r.status == 206:
            size, want = self._range_of(url, rng, r.headers.get("Content-Range", ""), limit)
            if r.content_length is not None and r.content_length != want:
                raise CorruptStoreError(
                    f"{url}: a ranged GET ({rng}) announced {r.content_length:,} bytes for the {want:,} "
                    f"its Content-Range {r.headers['Content-Range']!r} names"
                )
            return size, want, want + 1
        if r.content_length is not None and r.content_length > limit:
            raise CorruptStoreError(f"{url} holds {r.content_length:,} bytes, more than the {limit:,} it may")
        closed = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
        return None, None, min(int(closed[2]) + 1, limit + 1) if closed else limit + 1

    @staticmethod
    async def _read_at_most(r: Any, cap: int) -> bytearray:
        """The body of answer ``r``, read no further than its first ``cap`` bytes."""
        body = bytearray()
        while len(body) < cap:
            piece = await r.content.read(min(1 << 20, cap - len(body)))
            if not piece:
                break
            body += piece
        return body


@functools.cache
def http_filesystem() -> type:
    """fsspec's HTTPFileSystem (aiohttp, imported only when a store is opened by http(s) URL), every GET of which is
    bounded and checked: nothing a server sends is trusted (see ``get_object``); no request outlives its deadline."""
    require("aiohttp", "http")
    from fsspec.implementations.http import HTTPFileSystem

    class StoreHTTPFileSystem(_BoundedHTTPReads, HTTPFileSystem):  # type: ignore[misc]
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

    return StoreHTTPFileSystem


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
