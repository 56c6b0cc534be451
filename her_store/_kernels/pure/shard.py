"""A shard's body in one buffer (:func:`shard_body`): its rows' bytes one after the other, then its index, with room
for the index's crc32c (FORMAT.md describes a shard).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from her_store._kernels.pure.arguments import items

__all__ = ["shard_body"]


def shard_body(rows: Any, /) -> bytearray:
    """A shard's bytes but the index's crc32c: the rows' bytes (None: never written), then per row (offset, nbytes)
    as little-endian uint64 (both 2**64 - 1 for a None row), then 4 zero bytes."""
    views = items(rows, True, "rows")
    sizes = np.array([-1 if v is None else v.nbytes for v in views], np.int64)
    written = sizes >= 0
    index = np.full((len(views), 2), np.iinfo(np.uint64).max, np.dtype("<u8"))
    kept = np.where(written, sizes, 0)
    index[written, 0] = (np.cumsum(kept) - kept)[written]
    index[written, 1] = sizes[written]
    out = bytearray(b"".join(v for v in views if v is not None))
    out += index.tobytes()
    out += bytes(4)
    return out
