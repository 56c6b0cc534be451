"""Minari datasets: a store's episodes exported as a local Minari dataset, and a Minari dataset imported.

Export is :mod:`.export`, import :mod:`.import_`; the card and spaces travel in Minari's metadata (:mod:`.metadata`).

A Minari dataset is a directory holding ``data/metadata.json`` and ``data/main_data.hdf5``; Minari keeps them at
``<root>/<dataset_id>`` (the root is ``MINARI_DATASETS_PATH``, default ``~/.minari/datasets``), where
``minari.load_dataset(dataset_id)`` finds them, and ``minari.MinariDataset(path + "/data")`` opens them anywhere.
"""

from her_store.interop.minari.export import export_minari
from her_store.interop.minari.import_ import import_minari
from her_store.interop.minari.metadata import minari_dataset_id

__all__ = ["export_minari", "import_minari", "minari_dataset_id"]
