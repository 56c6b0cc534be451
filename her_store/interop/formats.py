"""The format registry: the module and function that export or import each format, imported only when it is used.

Each format's module (the only one to import its optional dependency: h5py, minari, stable-baselines3) provides

- ``export_<fmt>(store, episode_ids, dest, *, progress=False) -> (episodes, transitions)``: whole episodes, in the
  format's own conventions, with the store's spaces and dataset card; the counts written; and
- ``import_<fmt>(source, store_path, *, progress=False) -> int``: a NEW store at ``store_path``; the number of
  episodes imported.

Both write under a temporary name beside their destination and rename it at the end
(:mod:`her_store.interop.staging`): nothing is left at the destination unless the whole operation succeeded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["EXPORTS", "IMPORTS", "format_function"]

# format -> (module, function)
EXPORTS: dict[str, tuple[str, str]] = {
    "npz": ("her_store.interop.npz", "export_npz"),
    "hdf5": ("her_store.interop.hdf5", "export_hdf5"),
    "minari": ("her_store.interop.minari.export", "export_minari"),
    "ogbench": ("her_store.interop.ogbench", "export_ogbench"),
}
IMPORTS: dict[str, tuple[str, str]] = {
    "minari": ("her_store.interop.minari.import_", "import_minari"),
    "hdf5": ("her_store.interop.hdf5", "import_hdf5"),
    "npz": ("her_store.interop.npz", "import_npz"),
    "ogbench": ("her_store.interop.ogbench", "import_ogbench"),
    "sb3": ("her_store.interop.sb3_pickle", "import_sb3"),
}


def format_function(table: dict[str, tuple[str, str]], fmt: str, what: str) -> Callable[..., Any]:
    """The function ``table`` (:data:`EXPORTS` or :data:`IMPORTS`) names for ``fmt``, its module imported.

    Raises
    ------
    ValueError
        ``fmt`` is not in ``table`` (``what`` names the table in the message).

    Examples
    --------
    >>> format_function(EXPORTS, "npz", "export").__name__
    'export_npz'
    >>> format_function(IMPORTS, "csv", "import")
    Traceback (most recent call last):
    ValueError: unknown import format 'csv'; expected one of minari, hdf5, npz, ogbench, sb3
    """
    if fmt not in table:
        raise ValueError(f"unknown {what} format {fmt!r}; expected one of {', '.join(table)}")
    module, name = table[fmt]
    return getattr(importlib.import_module(module), name)
