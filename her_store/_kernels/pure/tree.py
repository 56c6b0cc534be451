"""A priority tree's update and walk (tree_set, tree_find of _frames.c), level by level over whole arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["tree_find", "tree_set"]


def _tree(sums: Any) -> tuple[np.ndarray, int, int]:
    s = np.frombuffer(sums, np.float64) if not isinstance(sums, np.ndarray) else sums
    n = len(s)
    if n < 2 or n & (n - 1) or s.dtype != np.float64:
        raise ValueError("a priority tree is float64 of 2 * L nodes, L a power of two")
    return s, n // 2, (n // 2).bit_length() - 1


def tree_set(sums: Any, mins: Any, nodes: Any, values: Any, /) -> None:
    """``sums[nodes] = values``, ``mins[nodes] = values`` (inf where 0), and every node above from its children."""
    s, leaf0, _ = _tree(sums)
    m = np.asarray(mins)
    at, v = np.asarray(nodes), np.asarray(values)
    if m.shape != s.shape or at.dtype != np.int64 or v.dtype != np.float64 or at.shape != v.shape:
        raise ValueError("tree_set needs mins as sums, int64 nodes and one float64 value per node")
    if at.size and (at.min() < leaf0 or at.max() >= 2 * leaf0 or not (v >= 0).all()):
        raise ValueError("tree_set needs leaf nodes (L .. 2L - 1) and values >= 0")
    s[at] = v
    m[at] = np.where(v > 0, v, np.inf)
    # level by level, parents from their children (a parent listed twice gets the same value twice) while the level
    # above is wider than the batch, then whole levels up to the root
    width = leaf0 // 2
    while width >= 1:
        if width <= len(at):
            s[width : 2 * width] = s[2 * width : 4 * width : 2] + s[2 * width + 1 : 4 * width : 2]
            np.minimum(m[2 * width : 4 * width : 2], m[2 * width + 1 : 4 * width : 2], out=m[width : 2 * width])
        else:
            at = at >> 1
            left = 2 * at
            s[at] = s[left] + s[left + 1]
            m[at] = np.minimum(m[left], m[left + 1])
        width //= 2


def tree_find(sums: Any, u: Any, out: Any, /) -> None:
    """``out[i]``: the leaf node ``u[i]`` walks down to by the subtrees' sums."""
    s, _, depth = _tree(sums)
    r = np.array(u, np.float64)
    o = np.asarray(out)
    if o.dtype != np.int64 or o.shape != r.shape:
        raise ValueError("tree_find needs float64 values and one int64 out per value")
    node = np.ones(r.shape, np.int64)
    for _ in range(depth):
        left = 2 * node
        sl = s[left]
        right = (r >= sl) & (s[left + 1] > 0)
        right |= sl <= 0
        r -= np.where(right, sl, 0.0)
        node = left + right
    o[...] = node
