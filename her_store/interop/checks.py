"""Checks on the files an import reads, where nothing is trusted: file kinds, sizes, HDF5 objects and value casts.

An input must be a regular file; an HDF5 file's objects must stay inside it; a cast into the store's dtype must keep
every value. A file of deflated zeros can claim any length at a few bytes: what a read would allocate is bounded
(:data:`MEMBER_LIMIT` per member or dataset, :data:`EPISODE_LIMIT` per episode) before anything is read.
"""

from __future__ import annotations

import math
import os
import stat
import warnings
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

from her_store.format.schema import Schema

__all__ = ["EPISODE_LIMIT", "MEMBER_LIMIT", "check_episode_bytes", "check_hdf5", "exact_cast", "open_input"]

MEMBER_LIMIT = 1 << 30  # bytes a member read whole, or one HDF5 dataset, may decode to
EPISODE_LIMIT = 1 << 30  # bytes of one imported episode's fields together: they are all read before it is appended


def open_input(path: str, what: str) -> BinaryIO:
    """``path`` opened for reading, which must be a regular file: a FIFO would block the open (and every read)
    forever, a device never ends.

    Raises
    ------
    ValueError
        ``path`` is something other than a regular file.

    Examples
    --------
    >>> open_input("/dev/null", "an npz file")  # doctest: +SKIP
    Traceback (most recent call last):
    ValueError: /dev/null is a character device, not a regular file; expected an npz file
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, then is refused
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        name = {stat.S_IFIFO: "FIFO", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device",
                stat.S_IFSOCK: "socket", stat.S_IFDIR: "directory"}.get(kind, "special file")
        raise ValueError(f"{path} is a {name}, not a regular file; expected {what}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_episode_bytes(schema: Schema, T: int, where: str) -> None:
    """Refuse, unread, an episode of ``T`` steps whose fields in ``schema`` (observation fields hold ``T + 1`` rows)
    take more than EPISODE_LIMIT bytes together: a file of deflated zeros can claim any length at a few bytes, and an
    episode's fields are all read (then staged by the store) before it is appended. (HDF5 episodes are bounded from
    their datasets' shapes: :func:`check_hdf5`.)

    Raises
    ------
    ValueError
        Naming the episode (``where``) and its size.
    """
    nbytes = sum((T if f.per_step else T + 1) * f.row_nbytes for f in schema.fields)
    if nbytes > EPISODE_LIMIT:
        raise ValueError(
            f"{where} takes {nbytes:,} bytes in its fields; at most {EPISODE_LIMIT:,} are read for one episode "
            "(split longer episodes before importing)"
        )


def check_hdf5(f: Any, source: str, frames: Mapping[str, int] | None = None) -> None:
    """Refuse what an HDF5 file may hold that reads outside it or explodes in memory: soft and external links,
    datasets stored in external files or virtual (mapped from other files), datasets over ``MEMBER_LIMIT`` bytes, and
    groups (episodes) whose datasets take over ``EPISODE_LIMIT`` bytes together.

    ``frames`` maps paths below each top-level group (``observations/pixels``) to the bytes one row decodes to, for
    datasets of encoded images a reader decodes row by row: such a dataset counts as what it stores plus its rows
    decoded, which a few bytes of deflated rows could otherwise claim without bound.

    Raises
    ------
    ValueError
        Naming the object and what it is.

    Examples
    --------
    >>> import h5py  # doctest: +SKIP
    >>> with h5py.File("point.hdf5") as f: check_hdf5(f, "point.hdf5")  # doctest: +SKIP
    """
    import h5py

    frames = frames or {}
    groups: dict[str, int] = {}  # bytes of the datasets under each top-level group (an episode's)

    def visit(name: str, link: Any) -> str | None:  # a message stops the walk (h5py cannot raise through it)
        if not isinstance(link, h5py.HardLink):
            return f"{name} is a {type(link).__name__}; a dataset's objects must all lie in its file"
        obj = f[name]
        if isinstance(obj, h5py.Dataset):
            if obj.external or obj.is_virtual:
                return f"{name} keeps its data outside the file; refused"
            nbytes = math.prod(obj.shape or ()) * obj.dtype.itemsize
            top, _, below = name.partition("/")
            what = f"{obj.shape} of {obj.dtype}"
            if below in frames:
                rows = obj.shape[0] if obj.shape else 1
                nbytes += rows * frames[below]
                what += f", {rows:,} encoded frames of {frames[below]:,} bytes each decoded"
            if nbytes > MEMBER_LIMIT:
                return f"{name} is {what} ({nbytes:,} bytes); at most {MEMBER_LIMIT:,} per dataset"
            groups[top] = groups.get(top, 0) + nbytes
            if "/" in name and groups[top] > EPISODE_LIMIT:
                return f"{top} holds datasets of more than {EPISODE_LIMIT:,} bytes together; at most that per episode"
        return None

    try:
        problem = f.visititems_links(visit)
    except (RuntimeError, KeyError, OSError) as e:
        raise ValueError(f"{source}: its objects cannot be walked ({type(e).__name__}: {e})") from None
    if problem is not None:
        raise ValueError(f"{source}: {problem}")


def exact_cast(values: Any, dtype: np.dtype, where: str, name: str, episode: int, noted: set[str]) -> np.ndarray:
    """``values`` (an array read from a file made elsewhere) in the store's ``dtype``, when the cast keeps every value.

    A cast is exact when casting back gives every value again (NaN stays NaN): bool to uint8, float64 values that
    float32 holds, int64 values inside int16's range. The first cast of each ``name`` is stated as a warning (the
    caller keeps ``noted`` for one import). A cast that would change a value (float64 digits float32 drops, an
    integer out of range, NaN into an integer or a flag, 0.5 into a flag) is refused.

    Raises
    ------
    ValueError
        Naming ``where`` (the file), ``name``, ``episode`` (its number in the file), the file's dtype, the store's
        and the first value that would change.

    Examples
    --------
    >>> noted = set()
    >>> exact_cast(np.array([-1.0, 0.0]), np.dtype("<f4"), "x.npz", "rewards", 0, noted)
    array([-1.,  0.], dtype=float32)
    >>> exact_cast(np.array([0.1]), np.dtype("<f4"), "x.npz", "rewards", 1, noted)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: x.npz: rewards is float64 in the file and float32 in the store: casting would change 0.1 at (0,) ...
    """
    values, dtype = np.asarray(values), np.dtype(dtype)
    if values.dtype == dtype:
        return values
    if values.dtype.kind not in "biuf":
        raise ValueError(f"{where}: {name} is {values.dtype} in the file; expected numbers ({dtype})")
    with np.errstate(invalid="ignore", over="ignore"):  # what the cast breaks is found below, by casting back
        cast = values.astype(dtype)
        back = cast.astype(values.dtype)
    kept = back == values
    if values.dtype.kind == "f":
        kept |= np.isnan(values) & np.isnan(back)
    if not kept.all():
        at = tuple(int(i) for i in np.unravel_index(np.argmin(kept), kept.shape))
        raise ValueError(
            f"{where}: {name} is {values.dtype} in the file and {dtype} in the store: casting would change "
            f"{values[at].item()!r} at {at} of episode {episode} to {cast[at].item()!r}; refused"
        )
    if name not in noted:
        noted.add(name)
        warnings.warn(f"{where}: {name} is {values.dtype} in the file, stored as {dtype} (every value kept exactly)",
                      stacklevel=2)
    return cast
