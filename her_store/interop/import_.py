"""Import by format name: a file or a Minari dataset read into a new store by the format's module.

The format's module and function are :data:`~her_store.interop.formats.IMPORTS`'s; the format is guessed from the
source when it is not given (:func:`guess_format`).
"""

from __future__ import annotations

import os
import re

from her_store.errors import short_repr
from her_store.interop.formats import IMPORTS, format_function
from her_store.interop.layout import HEADER_KEY
from her_store.interop.npz_members import NpzReader
from her_store.interop.staging import local_path

__all__ = ["guess_format", "import_source"]

_MINARI_ID = re.compile(r"^[\w.-]+(/[\w.-]+)*-v\d+$")  # a source that is no path: a Minari dataset id


def guess_format(source: str | os.PathLike[str]) -> str:
    """The import format of ``source``, guessed: an npz by its arrays (an export's ``her_store_header`` without
    ``terminals``: npz; ``observations``, ``actions``, ``terminals``: OGBench), ``.h5``/``.hdf5``: HDF5,
    ``.pkl``/``.pickle``: an SB3 replay buffer, a directory or a Minari id (``namespace/name-v0``): Minari.

    Raises
    ------
    ValueError
        Nothing tells; pass the format (``--from``).

    Examples
    --------
    >>> guess_format("D4RL/door/human-v2")  # doctest: +SKIP
    'minari'
    """
    path = os.fspath(source)
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "zarr.json")):
            raise ValueError(f"{path} is a her_store store already; copy it with her-store copy")
        return "minari"
    if os.path.exists(path):
        if ext == ".npz":
            with NpzReader(path) as z:
                if {"observations", "actions", "terminals"} <= set(z.keys):
                    return "ogbench"
                if HEADER_KEY in z.keys:
                    return "npz"
            raise ValueError(
                f"{path}: an npz with neither {HEADER_KEY!r} (her-store export) nor observations, actions and "
                f"terminals (OGBench); it has {short_repr(sorted(z.keys))}"
            )
        if ext in (".h5", ".hdf5"):
            return "hdf5"
        if ext in (".pkl", ".pickle"):
            return "sb3"
        raise ValueError(f"cannot tell the format of {path} from its name; pass --from {{{','.join(IMPORTS)}}}")
    if _MINARI_ID.match(path):
        return "minari"
    raise FileNotFoundError(f"{path} does not exist (and is not a Minari dataset id such as 'D4RL/door/human-v2')")


def import_source(
    source: str | os.PathLike[str],
    store_path: str | os.PathLike[str],
    fmt: str | None = None,
    *,
    progress: bool = False,
) -> int:
    """Import ``source`` as a new store at ``store_path`` (``fmt`` None: :func:`guess_format`). Returns the episodes
    imported. An SB3 pickle (``fmt="sb3"``, or guessed from ``.pkl``) is unpickled: that runs code from the file.

    Examples
    --------
    >>> import_source("antmaze-large-navigate-v0.npz", "runs/antmaze", "ogbench")  # doctest: +SKIP
    1000
    """
    local_path(store_path, "the new store")
    fmt = fmt or guess_format(source)
    return format_function(IMPORTS, fmt, "import")(source, store_path, progress=progress)
