"""A working set's rows (its row source): a ring of rows of every array a batch reads, on the host or a device.

Refills load it and batches gather from it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np
import torch

from her_store.format.layout import ArraySpec
from her_store.sampling.gather import contiguous_field
from her_store.store.rows import ChunkReader

__all__ = ["HOST_FIELDS", "RingRows"]

# what batch assembly computes on with numpy (goals, rewards, flags; infos too): brought to the host from a device
HOST_FIELDS = frozenset({"achieved_goal", "desired_goal", "reward", "terminated", "truncated"})


class RingRows:
    """``capacity_rows`` rows of each array, a ring (row ``r`` of the store's numbering, past the end, is row ``r %
    capacity_rows``), allocated at once on ``device``.

    As a row source (:class:`~her_store.sampling.gather.RowSource`), rows are gathered at once: ``numpy.take`` on
    the CPU (as the reader gathers a local store's rows), one ``index_select`` on another device, where the fields
    in ``host_fields`` then come to the host and the others stay on the device.

    Parameters
    ----------
    specs : mapping of str to ArraySpec
        The arrays, by path.
    capacity_rows : int
        Rows of the ring.
    device : torch.device
        Where the rows live.
    host_fields : collection of str
        Fields batch assembly computes on with numpy.

    Attributes
    ----------
    buffers : dict of str to torch.Tensor
        The ring's rows of each array, ``(capacity_rows, *row shape)``; empty once released.
    numpy_gather : bool
        Gather with ``numpy.take`` (the rows on the CPU); otherwise with ``index_select``, which a CPU ring can run
        too (it gives the same rows).

    Raises
    ------
    RuntimeError, MemoryError
        The device cannot give the rows (torch's allocators raise RuntimeError, CUDA's a subclass of it).
    """

    def __init__(
        self,
        specs: Mapping[str, ArraySpec],
        capacity_rows: int,
        device: torch.device,
        host_fields: Collection[str],
    ) -> None:
        self.capacity_rows = capacity_rows
        self.device = device
        self.host_fields = frozenset(host_fields)
        self.numpy_gather = device.type == "cpu"
        self.buffers: dict[str, torch.Tensor] = {
            path: torch.empty(
                (capacity_rows, *spec.row_shape), dtype=torch.from_numpy(np.empty(0, spec.dtype)).dtype, device=device
            )
            for path, spec in specs.items()
        }

    @property
    def nbytes(self) -> int:
        """Bytes of the ring (every row of every array)."""
        return sum(b.element_size() * b.nelement() for b in self.buffers.values())

    def load(self, reader: ChunkReader, at: int, rows: np.ndarray) -> None:
        """Read the store's ``rows`` of every array into ring rows ``at, at + 1, ...`` (past the ring's last row, on
        from its first), by large reads of the reader: into the ring's own memory on the CPU."""
        split = min(len(rows), self.capacity_rows - at)
        for path, buf in self.buffers.items():
            for where, part in ((at, rows[:split]), (0, rows[split:])):
                if not len(part):
                    continue
                block = buf[where : where + len(part)]
                if block.device.type == "cpu":
                    reader.gather(path, part, out=block.numpy())
                else:
                    block.copy_(torch.from_numpy(reader.gather(path, part)))

    def release(self) -> None:
        """Free the rows."""
        self.buffers = {}

    def rows(self, path: str, rows: np.ndarray) -> Any:
        """Ring rows ``rows`` (modulo the ring) of array ``path``."""
        if self.numpy_gather:
            return np.take(self.buffers[path].numpy(), rows, axis=0, mode="wrap")
        return self.buffers[path].index_select(0, torch.as_tensor(rows % self.capacity_rows, device=self.device))

    def rows_later(self, path: str, rows: np.ndarray) -> tuple[Any, Callable[[], None]]:
        """The ring's rows are gathered at once (:meth:`rows`)."""
        return self.rows(path, rows), _done

    def field(self, name: str, col: Any, shape: tuple[int, ...]) -> Any:
        """A field of gathered rows: from a device, on the host when batch assembly computes on it, else left there."""
        if isinstance(col, np.ndarray):
            return contiguous_field(name, col, shape)
        col = col.reshape(len(col), *shape)
        return col.contiguous().cpu().numpy() if name in self.host_fields else col.contiguous()


def _done() -> None:
    """A gather that is already complete."""
