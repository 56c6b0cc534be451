"""npz files read and written a member at a time, in bounded memory and never unpickling.

:func:`write_npz` fills each big member piece by piece in a scratch file, then stores it in the zip;
:class:`NpzReader` streams each member's rows in order, refusing object arrays, headers that claim more bytes than
their member holds, and reads over :data:`~her_store.interop.checks.MEMBER_LIMIT` bytes.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tokenize
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from her_store.errors import short_repr
from her_store.format.schema import Schema
from her_store.interop import checks
from her_store.interop.layout import HEADER_KEY, parse_header
from her_store.storage.base import METADATA_LIMIT

__all__ = ["NpzReader", "read_npz_header", "write_npz"]


def write_npz(
    path: str,
    members: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    rows: Iterable[Mapping[str, np.ndarray]],
    small: Callable[[], Mapping[str, np.ndarray]],
) -> None:
    """Write an uncompressed npz (what :func:`numpy.load` reads, ``allow_pickle=False``) whose big members are
    filled piece by piece.

    ``members`` gives each big member's dtype and row shape; ``rows`` yields, piece after piece, the next rows of
    every member (a mapping member -> rows; each member's rows in order); a member holds the rows it was given. Each
    member is first appended to its own ``.npy`` scratch file beside ``path`` (memory stays bounded), its header
    rewritten with the final row count, then copied whole into the zip, which holds each member contiguous as npz
    needs. ``small()``, called once every piece is written, gives the members written from memory.

    Raises
    ------
    ValueError
        A piece does not match its member's dtype or row shape.
    """
    scratch = f"{path}.members"
    os.mkdir(scratch)
    files: dict[str, Any] = {}
    try:
        filled = dict.fromkeys(members, 0)
        for k, (name, (dt, row_shape)) in enumerate(members.items()):
            files[name] = open(os.path.join(scratch, f"{k}.npy"), "w+b")  # noqa: SIM115 - closed in finally
            files[name].write(_npy_header(np.dtype(dt), (_NPY_ROWS_RESERVED, *row_shape)))
        for piece in rows:
            for name, a in piece.items():
                dt, row_shape = members[name]
                if a.dtype != dt or a.shape[1:] != tuple(row_shape):
                    raise ValueError(f"npz member {name!r}: rows {a.dtype}{a.shape} do not fit {dt}{tuple(row_shape)}")
                files[name].write(np.ascontiguousarray(a).data.cast("B"))
                filled[name] += len(a)
        for name, (dt, row_shape) in members.items():  # the same header length: the reserved count is the widest
            files[name].seek(0)
            files[name].write(_npy_header(np.dtype(dt), (filled[name], *row_shape), _npy_header_size(dt, row_shape)))
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, a in small().items():
                with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.ascontiguousarray(a), allow_pickle=False)
            for name, f in files.items():
                f.seek(0)
                with zf.open(f"{name}.npy", "w", force_zip64=True) as out:
                    shutil.copyfileobj(f, out, 16 << 20)
                f.close()
    finally:
        for f in files.values():
            with contextlib.suppress(OSError):  # a full disk fails the flush again: the scratch goes all the same
                f.close()
        shutil.rmtree(scratch, ignore_errors=True)


_NPY_ROWS_RESERVED = 10**18  # the row count a member's header is first written with: as wide as any it will hold


def _npy_header_size(dtype: np.dtype, row_shape: tuple[int, ...]) -> int:
    return len(_npy_header(np.dtype(dtype), (_NPY_ROWS_RESERVED, *row_shape)))


def _npy_header(dtype: np.dtype, shape: tuple[int, ...], size: int | None = None) -> bytes:
    """An ``.npy`` version 2.0 header of ``size`` bytes (padded with spaces; by default to a multiple of 64)."""
    text = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": tuple(shape)})
    body = text.encode("latin1")
    size = size if size is not None else -(-(12 + len(body) + 1) // 64) * 64
    body += b" " * (size - 12 - len(body) - 1) + b"\n"
    return b"\x93NUMPY\x02\x00" + len(body).to_bytes(4, "little") + body


class NpzReader:
    """Reads the members of an npz file as streams: each member's rows in order, a piece at a time (bounded memory),
    never unpickling (object arrays are refused). A damaged file (cut short, bad CRC, not a zip) raises ValueError
    naming the file.

    Examples
    --------
    >>> with NpzReader("episodes.npz") as z:  # doctest: +SKIP
    ...     lengths = z.read_all("episode_lengths")
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file = checks.open_input(self.path, "an npz file")
        with self.reading():
            try:
                self._zip = zipfile.ZipFile(self._file)
            except BaseException:
                self._file.close()
                raise
        self.keys = [n[:-4] for n in self._zip.namelist() if n.endswith(".npy")]
        self._open: dict[str, tuple[Any, np.dtype, tuple[int, ...]]] = {}

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Turns the zip and npy errors of a damaged file into one ValueError naming the file."""
        try:
            yield
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, zipfile.LargeZipFile) as e:
            raise ValueError(f"{self.path} is not a complete npz file ({type(e).__name__}: {e})") from None
        except RuntimeError as e:  # what zipfile raises for an encrypted member
            raise ValueError(f"{self.path} cannot be read as an npz file ({e})") from None

    def header(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        """A member's dtype and shape (its stream is opened and positioned at its first row)."""
        if name not in self._open:
            if name not in self.keys:
                raise ValueError(f"{self.path} has no array {name!r} (it has {short_repr(sorted(self.keys))})")
            with self.reading():
                f = self._zip.open(f"{name}.npy")
                try:
                    version = np.lib.format.read_magic(f)
                    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
                    if version not in read:
                        raise ValueError(f"npy format version {version}; expected 1.0 or 2.0")
                    shape, fortran, dtype = read[version](f)
                except (ValueError, SyntaxError, tokenize.TokenError, RecursionError, MemoryError) as e:
                    f.close()
                    raise ValueError(
                        f"{self.path}: array {name!r} has no valid .npy header ({type(e).__name__}: {e})"
                    ) from None
            want = math.prod(shape) * dtype.itemsize if all(d >= 0 for d in shape) else -1
            if want < 0 or want > self._zip.getinfo(f"{name}.npy").file_size:
                f.close()
                raise ValueError(
                    f"{self.path}: array {name!r} claims shape {shape} of {dtype} ({want:,} bytes) but holds "
                    f"{self._zip.getinfo(f'{name}.npy').file_size:,} bytes"
                )
            if dtype.hasobject or fortran:
                raise ValueError(
                    f"{self.path}: array {name!r} is {dtype}{' in Fortran order' if fortran else ''}; expected plain "
                    "numbers in C order"
                )
            self._open[name] = (f, dtype, tuple(shape))
        _, dtype, shape = self._open[name]
        return dtype, shape

    def read(self, name: str, n: int) -> np.ndarray:
        """The next ``n`` rows of a member, at most ``MEMBER_LIMIT`` bytes (an episode claiming more is refused
        unread: a file of deflated zeros can claim any length)."""
        dtype, shape = self.header(name)
        f = self._open[name][0]
        nbytes = n * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        limit = checks.MEMBER_LIMIT
        if nbytes > limit:
            raise ValueError(
                f"{self.path}: {n:,} rows of array {name!r} are {nbytes:,} bytes; at most {limit:,} are read at once "
                "(one episode's rows of a field)"
            )
        with self.reading():
            raw = f.read(nbytes)
        if len(raw) != nbytes:
            raise ValueError(f"{self.path}: array {name!r} ends early ({len(raw):,} of {nbytes:,} bytes left)")
        return np.frombuffer(raw, dtype).reshape(n, *shape[1:])

    def read_all(self, name: str, limit: int = checks.MEMBER_LIMIT) -> np.ndarray:
        """A whole member (for small ones: lengths, flags, the header), its CRC checked; at most ``limit`` bytes."""
        dtype, shape = self.header(name)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > limit:
            raise ValueError(f"{self.path}: array {name!r} is {nbytes:,} bytes; at most {limit:,} are read whole")
        out = self.read(name, shape[0]) if shape else self.read(name, 1).reshape(())
        self.finish(name)
        return out

    def finish(self, name: str) -> None:
        """Read a member to its end, which checks its CRC; refuse bytes past its rows."""
        f = self._open.pop(name)[0]
        with self.reading():
            extra = f.read(1)
            f.close()
        if extra:
            raise ValueError(f"{self.path}: array {name!r} holds more bytes than its header's shape")

    def close(self) -> None:
        for f, _, _ in self._open.values():
            f.close()
        self._open.clear()
        self._zip.close()
        self._file.close()  # (a ZipFile closes only a file it opened itself)

    def __enter__(self) -> NpzReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_npz_header(z: NpzReader, kind: str) -> tuple[Schema, dict[str, Any]]:
    """The spaces and card of an npz an export wrote (its ``her_store_header`` member)."""
    raw = z.read_all(HEADER_KEY, limit=METADATA_LIMIT)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"{z.path}: {HEADER_KEY} is {raw.dtype}{raw.shape}; expected uint8 bytes of JSON")
    return parse_header(raw.tobytes(), kind, z.path)
