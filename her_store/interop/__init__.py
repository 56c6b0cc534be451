"""Export and import: a store's episodes to and from npz, HDF5, Minari, OGBench's npz and SB3 replay-buffer pickles.

:func:`export_store` and :func:`import_source` dispatch by format name (:mod:`.formats`) to the format's own module
(``npz``, ``hdf5``, ``minari``, ``ogbench``, ``sb3_pickle``), imported only when it is used. The format modules share
the episodes read in checked batches (:mod:`.batches`), the header of spaces and card and Minari's field names
(:mod:`.layout`), staged destinations (:mod:`.staging`), streamed npz members (:mod:`.npz_members`) and the checks on
files read (:mod:`.checks`). The core never imports this package.
"""

from her_store.interop.batches import Batch, read_batches
from her_store.interop.export import export_store
from her_store.interop.formats import EXPORTS, IMPORTS
from her_store.interop.import_ import guess_format, import_source

__all__ = ["EXPORTS", "IMPORTS", "Batch", "export_store", "guess_format", "import_source", "read_batches"]
