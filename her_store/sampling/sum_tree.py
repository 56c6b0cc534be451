"""PriorityTree: the sum and the minimum of ``n`` non-negative leaves, with vectorised updates and prefix-sum search.

Proportional prioritized replay (Schaul et al., 2016) draws leaf ``i`` with probability ``leaf_i / total``: a value
``u`` uniform in ``[0, total)`` is walked down from the root, left while it is below the left subtree's sum. The
tree is implicit and complete: ``n`` rounded up to a power of two leaves at ``n .. 2n - 1``, node ``k``'s children
``2k`` and ``2k + 1``. Walks and updates are :mod:`her_store._kernels`' ``tree_find`` and ``tree_set`` (which
recomputes whole levels where a level is narrower than the update, so filling a tree costs one pass per level).
"""

from __future__ import annotations

import numpy as np

from her_store import _kernels
from her_store.checks import check_int

__all__ = ["PriorityTree"]


class PriorityTree:
    """Sum and minimum over ``size`` leaves (float64), all 0 at first; a leaf of 0 is never drawn and is left out of
    the minimum.

    Memory: 32 bytes per leaf of ``size`` rounded up to a power of two (two float64 arrays of twice that many nodes).

    Parameters
    ----------
    size : int
        Number of leaves (>= 1); :meth:`grow` makes room for more.

    Examples
    --------
    >>> tree = PriorityTree(5)
    >>> tree.set(np.array([0, 3]), np.array([1.0, 3.0]))
    >>> tree.total, tree.min
    (4.0, 1.0)
    >>> tree.find(np.array([0.5, 1.0, 3.9]))
    array([0, 3, 3])
    """

    def __init__(self, size: int) -> None:
        self.size = check_int(size, "size", low=1)
        self._depth = (self.size - 1).bit_length()
        self._leaf0 = 1 << self._depth  # node of leaf 0
        self._sum = np.zeros(2 * self._leaf0)
        self._min = np.full(2 * self._leaf0, np.inf)

    @property
    def total(self) -> float:
        """The sum of the leaves."""
        return float(self._sum[1])

    @property
    def min(self) -> float:
        """The smallest positive leaf (``inf`` when none is positive)."""
        return float(self._min[1])

    @property
    def leaves(self) -> np.ndarray:
        """The leaf values, read-only."""
        view = self._sum[self._leaf0 : self._leaf0 + self.size]
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        """Bytes the tree holds."""
        return self._sum.nbytes + self._min.nbytes

    def get(self, leaves: np.ndarray) -> np.ndarray:
        """The values of ``leaves``."""
        return self._sum[self._leaf0 + np.asarray(leaves, np.int64)]

    def set(self, leaves: np.ndarray, values: np.ndarray) -> None:
        """Set ``leaves`` (ints in ``[0, size)``) to ``values`` (finite, >= 0; the last of repeated leaves wins),
        and every sum and minimum above them.

        Raises
        ------
        ValueError
            A leaf out of range or a value that is not >= 0.
        """
        nodes = self._leaf0 + np.asarray(leaves, np.int64).reshape(-1)
        values = np.ascontiguousarray(np.broadcast_to(np.asarray(values, np.float64), nodes.shape))
        if np.any(nodes >= self._leaf0 + self.size):
            raise ValueError(f"tree_set needs leaf nodes (L .. 2L - 1) and values >= 0: a leaf >= size {self.size}")
        _kernels.tree_set(self._sum, self._min, nodes, values)

    def find(self, u: np.ndarray) -> np.ndarray:
        """The leaves that values ``u`` in ``[0, total)`` fall in, walking down by the subtrees' sums: leaf ``i`` is
        found for a share ``leaf_i / total`` of ``[0, total)``, in leaf order. Never a leaf of 0 while the total is
        positive: a subtree of sum 0 is never entered (rounding cannot lead the walk there)."""
        u = np.ascontiguousarray(u, np.float64)
        out = np.empty(u.shape, np.int64)
        _kernels.tree_find(self._sum, u, out)
        return out - self._leaf0

    def grow(self, size: int) -> None:
        """Room for ``size`` leaves (more than now), keeping the values of the present ones."""
        size = check_int(size, "size", low=self.size)
        if size == self.size:
            return
        old = self.leaves.copy()
        self.__init__(size)  # type: ignore[misc]
        nonzero = np.flatnonzero(old)
        self.set(nonzero, old[nonzero])
