"""Where stores live: one backend class each for local disk, object storage, HTTP(S) and zip archives, behind one
interface (:class:`Backend`); the writer lock; atomic writes and safe opening of local files.

:func:`open_backend` is the one road from a path or URL to its backend.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from her_store.checks import check_mapping, check_path
from her_store.storage.archive import PackedArchive, open_remote_archive
from her_store.storage.archive_backend import ArchiveBackend
from her_store.storage.base import METADATA_LIMIT, OBJECT_LIMIT, Backend, Defaults, ObjectReplaced, WriterLock
from her_store.storage.http import HTTPBackend
from her_store.storage.local import LocalBackend
from her_store.storage.lock import DEFAULT_LEASE_TTL
from her_store.storage.objects import FsspecBackend
from her_store.storage.zip_directory import is_archive

__all__ = [
    "DEFAULT_LEASE_TTL",
    "METADATA_LIMIT",
    "OBJECT_LIMIT",
    "ArchiveBackend",
    "Backend",
    "Defaults",
    "FsspecBackend",
    "HTTPBackend",
    "LocalBackend",
    "ObjectReplaced",
    "WriterLock",
    "open_backend",
]


def open_backend(
    path_or_url: str | os.PathLike[str] | Backend, storage_options: Mapping[str, Any] | None = None
) -> Backend:
    """The backend of a store's place: a local directory (or ``file://`` URL), a packed store (a zip file, or a URL
    ending in ``.zip`` that names a zip object over HTTP(S) or S3), an ``http(s)://`` URL (read-only), or any other
    fsspec URL (``s3://``, ``gs://``, ``memory://``). A backend given is returned as it is.

    Parameters
    ----------
    path_or_url : str, PathLike or Backend
        The place.
    storage_options : mapping, optional
        Passed to fsspec for URLs (credentials, ``client_kwargs={"endpoint_url": ...}``; over HTTP also
        ``request_deadline``, seconds any one request may take).

    Examples
    --------
    >>> open_backend("/tmp/run1")
    LocalBackend('/tmp/run1')
    >>> open_backend("memory://run1")
    FsspecBackend('memory://run1')
    """
    if isinstance(path_or_url, Backend):
        return path_or_url
    url = check_path(path_or_url, "path_or_url")
    storage_options = check_mapping(storage_options, "storage_options")
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        local = LocalBackend(url, storage_options)
        if os.path.isfile(local.root) and is_archive(local.root):
            return ArchiveBackend(PackedArchive(local.root), local.defaults, storage_options)
        return local
    scheme = url.split("://", 1)[0].lower()
    backend: Backend = (
        HTTPBackend(url, storage_options) if scheme in ("http", "https") else FsspecBackend(url, storage_options)
    )
    if backend.url.lower().endswith(".zip"):  # a zip object, read by ranged GETs; else a directory of that name
        archive = open_remote_archive(backend)
        if archive is not None:
            return ArchiveBackend(archive, backend.defaults, storage_options)
    return backend
