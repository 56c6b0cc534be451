"""The frame codec of image rows: frame files (Zarr shards) of one frame per inner chunk, encoded and checked.

Compressed arrays are stored as frame files of one frame per inner chunk, so reading a frame decodes that frame alone.

(Zarr calls such a file a shard; in her_store's own terms it is a *frame file*, and a *shard* is one writer's store in a
dataset of many writers, :mod:`her_store.datasets`.) A frame file is one file (one object on object storage) holding
``chunk_rows`` rows: each row's encoded bytes, then the shard index, ``chunk_rows`` pairs ``(offset, nbytes)`` as
little-endian uint64 (both ``2**64 - 1`` for a row never written), then the index's crc32c. That is Zarr v3's
``sharding_indexed`` codec with the index at the end, so ``zarr`` alone reads any row; her_store encodes, writes and
reads the bytes itself (FORMAT.md, Arrays):

- :class:`FrameCodec` encodes and decodes one row with the array's inner codecs, straight into the caller's buffer;
- :func:`build_shard` and :func:`parse_index` make and check a shard's bytes (nothing read is trusted: every offset
  must lie in the shard, and a bad crc32c is a damaged shard);
- :class:`~her_store.store.frame_writer.FrameWriter` writes them (the store layer) and
  :class:`~her_store.store.frame_rows.FrameArray` gathers them.
"""

from __future__ import annotations

import struct
import warnings
import zlib
from collections.abc import Sequence
from typing import Any

import google_crc32c
import numcodecs
import numcodecs.blosc
import numcodecs.lz4
import numpy as np
import zarr
import zarr.codecs as zc
from zarr.codecs.numcodecs import LZ4

from her_store import _kernels
from her_store.errors import CorruptStoreError, StoreError, short_repr
from her_store.format.jpeg import check_frames, frame_codec, is_lossy
from her_store.format.schema import Field

__all__ = [
    "EMPTY", "FrameCodec", "build_shard", "frame_codecs", "index_nbytes", "lz4_codec", "parse_index", "shard_limit"
]

# zarr warns, each time it builds a numcodecs codec (creating or opening a store), that other Zarr implementations
# may not read it; FORMAT.md says so once, and her_store's own reader decodes it
warnings.filterwarnings(
    "ignore", "Numcodecs codecs are not in the Zarr version 3 specification", UserWarning, r"zarr\.codecs\.numcodecs"
)

EMPTY = (1 << 64) - 1  # offset and nbytes of a row never written
LZ4_MAX_ACCELERATION = 65537  # LZ4_ACCELERATION_MAX of lz4.c


def shard_limit(rows: int, row_nbytes: int) -> int:
    """The most bytes a shard of ``rows`` rows may hold: every row encoded at up to twice its size (LZ4's, zstd's and
    gzip's worst cases are a few percent over it, a JPEG of noise about 1.5x), plus the index."""
    return rows * (2 * row_nbytes + 1024) + index_nbytes(rows)


def index_nbytes(rows: int) -> int:
    """Bytes of a shard's index: ``rows`` (offset, nbytes) pairs and a 4-byte crc32c."""
    return 16 * rows + 4


class FrameCodec:
    """Encode and decode one row of a sharded array with its inner codecs.

    Supported inner codec chains: ``bytes`` alone, or ``bytes`` + one of ``numcodecs.lz4`` (the default for images:
    decoded straight into the batch, a few microseconds a frame), Blosc, Zstd or Gzip (lossless), or
    the JPEG codec of :mod:`her_store.format.jpeg`. A chain naming anything else is refused when the store is opened.

    Also the decoder of a whole chunk of a version 1 array (:meth:`of_chunks`): a "row" is then a chunk.

    Parameters
    ----------
    array : zarr.Array
        A sharded array whose metadata :func:`her_store.format.layout.check_array` has checked.
    where : str
        The array's ``zarr.json``, for messages.

    Examples
    --------
    >>> codec = FrameCodec(store.zarr_array("steps/observation"), "steps/observation")  # doctest: +SKIP
    >>> out = np.empty((3, 84, 84), np.uint8)  # doctest: +SKIP
    >>> codec.decode(codec.encode(frame), out)  # doctest: +SKIP
    """

    def __init__(self, array: zarr.Array, where: str) -> None:
        self._setup(list(array.metadata.codecs[0].codecs), np.dtype(array.dtype), tuple(array.shape[1:]), where)

    @classmethod
    def of_chunks(cls, array: zarr.Array, rows: int, where: str) -> FrameCodec:
        """The decoder of whole chunks of ``rows`` rows of an unsharded (version 1) array, with the same checks."""
        self = cls.__new__(cls)
        self._setup(list(array.metadata.codecs), np.dtype(array.dtype), (rows, *array.shape[1:]), where)
        return self

    def _setup(self, inner: list[Any], dtype: np.dtype, row_shape: tuple[int, ...], where: str) -> None:
        self.dtype = dtype
        self.row_shape = row_shape
        self.nbytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        if not inner or not isinstance(inner[0], zc.BytesCodec) or inner[0].endian not in (None, zc.Endian.little):
            raise CorruptStoreError(f"{where}: inner codecs {inner!r}, expected little-endian bytes first")
        self._codec: Any = None
        self._blosc = self._zstd = self._gzip = False
        self._lz4: int | None = None  # acceleration of the numcodecs.lz4 codec (decoded straight into the batch)
        if len(inner) == 2:
            c = inner[1]
            if isinstance(c, LZ4):
                config = dict(c.codec_config)
                acceleration = config.pop("acceleration", 1)
                if (
                    config.pop("id", "lz4") != "lz4"
                    or config
                    or not (type(acceleration) is int and 1 <= acceleration <= LZ4_MAX_ACCELERATION)
                ):
                    raise CorruptStoreError(
                        f"{where}: numcodecs.lz4 configuration {short_repr(c.codec_config)}, expected only "
                        f"'acceleration', an integer 1..{LZ4_MAX_ACCELERATION}"
                    )
                self._lz4 = acceleration
                self._codec = numcodecs.LZ4(self._lz4)
            elif isinstance(c, zc.BloscCodec):
                shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[str(getattr(c.shuffle, "value", c.shuffle))]
                self._codec = numcodecs.Blosc(c.cname.value, c.clevel, shuffle, c.blocksize)
                self._blosc = True
            elif isinstance(c, zc.ZstdCodec):
                self._codec = numcodecs.Zstd(c.level, c.checksum)
                self._zstd = True
            elif isinstance(c, zc.GzipCodec):
                self._codec = numcodecs.GZip(c.level)
                self._gzip = True
            elif is_lossy(c):
                try:
                    self._codec = frame_codec(c, self.dtype, self.row_shape)
                except ValueError as e:
                    raise CorruptStoreError(f"{where}: {e}") from e
        if len(inner) > 2 or (len(inner) == 2 and self._codec is None):
            raise CorruptStoreError(
                f"{where}: inner codecs {inner!r}; her_store reads bytes alone or bytes + one of numcodecs.lz4, blosc, "
                "zstd, gzip, jpeg"
            )
        self.is_lz4 = self._lz4 is not None  # encoded and decoded in batches by her_store._kernels
        self.lz4_acceleration = self._lz4 or 1

    def encode(self, row: np.ndarray) -> bytes:
        """The encoded bytes of one row (C order, little-endian)."""
        data = np.ascontiguousarray(row, self.dtype.newbyteorder("<"))
        if self._codec is None:
            return data.tobytes()
        return bytes(self._codec.encode(data))

    def decode(self, raw: Any, out: np.ndarray) -> None:
        """Decode one row's bytes into ``out`` (a C-contiguous row of the array's dtype and shape).

        Raises
        ------
        ValueError
            The bytes do not decode to exactly one row (what a damaged or crafted shard gives).
        """
        flat = out.reshape(-1).view(np.uint8)
        try:
            self._decode(raw, flat)
        except (RuntimeError, EOFError, OSError, zlib.error) as e:  # what the codecs raise for undecodable bytes
            raise ValueError(f"not one row's encoded bytes ({e})") from e

    def _decode(self, raw: Any, flat: np.ndarray) -> None:
        if self._lz4 is not None:
            # numcodecs' LZ4 format: a little-endian int32 decoded size, then one LZ4 block, which must decode to
            # exactly that size; anything but one row is refused before decoding
            if len(raw) < 4 or struct.unpack_from("<i", raw)[0] != self.nbytes:
                raise ValueError(f"an LZ4 block whose header is not {self.nbytes} bytes")
            numcodecs.lz4.decompress(raw, flat)
        elif self._codec is None:
            if len(raw) != self.nbytes:
                raise ValueError(f"{len(raw)} bytes, expected {self.nbytes}")
            flat[:] = np.frombuffer(raw, np.uint8)
        elif self._blosc:
            # a blosc frame's header says its decoded size: anything but one row is refused before decoding
            nbytes, cbytes = struct.unpack_from("<I4xI", raw, 4) if len(raw) >= 16 else (-1, -1)
            if nbytes != self.nbytes or cbytes != len(raw):
                raise ValueError(f"a blosc frame of {nbytes} bytes in {len(raw)}, expected {self.nbytes}")
            numcodecs.blosc.decompress(raw, flat)
        elif self._zstd:
            # numcodecs decodes a frame of fewer bytes into the row without a word, leaving the rest of it stale: the
            # frame must declare exactly one row (libzstd then checks the data against that declared size)
            size = _zstd_content_size(raw)
            if size != self.nbytes:
                raise ValueError(f"a zstd frame declaring {size} bytes, expected {self.nbytes}")
            self._codec.decode(raw, out=flat)
        elif self._gzip:
            # numcodecs.GZip also accepts fewer bytes than the row (and reads a crafted stream without bound)
            d = zlib.decompressobj(wbits=31)  # one gzip member
            data = d.decompress(bytes(raw), self.nbytes + 1)
            if len(data) != self.nbytes or not d.eof or d.unused_data:
                raise ValueError(f"a gzip member that is not {self.nbytes} bytes")
            flat[:] = np.frombuffer(data, np.uint8)
        else:
            self._codec.decode(raw, out=flat)


def _zstd_content_size(raw: Any) -> int:
    """The decoded size a zstd frame's header declares (RFC 8878, 3.1.1); -1 when it is not a zstd frame or declares
    none."""
    if len(raw) < 6 or bytes(raw[:4]) != b"\x28\xb5\x2f\xfd":
        return -1
    fhd = raw[4]
    single = (fhd >> 5) & 1
    at = 5 + (1 - single) + (0, 1, 2, 4)[fhd & 3]  # past the window descriptor and the dictionary id
    width = (single, 2, 4, 8)[fhd >> 6]
    if width == 0 or len(raw) < at + width:
        return -1
    value = int.from_bytes(bytes(raw[at : at + width]), "little")
    return value + 256 if width == 2 else value


def lz4_codec(acceleration: int = 1) -> Any:
    """The default codec of image rows: ``numcodecs.lz4`` (zarr-python reads it; other Zarr implementations may not,
    as FORMAT.md says)."""
    return LZ4(acceleration=int(acceleration))


def frame_codecs(codecs: Any, field: Field) -> Any:
    """Check the codecs asked for a sharded field: one codec FrameCodec decodes (a list of one is fine), and a lossy
    one only for frames it encodes.

    Raises
    ------
    StoreError
        Naming the field, what was given and what is supported.
    """
    items = list(codecs) if isinstance(codecs, (list, tuple)) else [codecs]
    if len(items) != 1 or not (
        isinstance(items[0], (LZ4, zc.BloscCodec, zc.ZstdCodec, zc.GzipCodec)) or is_lossy(items[0])
    ):
        raise StoreError(
            f"compressors[{field.name!r}] is {items!r}; an image field takes one codec: 'lz4' (default), 'zstd', "
            "'jpeg', a zarr.codecs Blosc/Zstd/Gzip codec or numcodecs LZ4/Blosc/Zstd, or None for uncompressed"
        )
    if is_lossy(items[0]):
        try:
            check_frames(field.dtype, field.shape)
        except ValueError as e:
            raise StoreError(f"compressors[{field.name!r}] is {items[0]!r}, which does not fit the field: {e}") from e
    return items


def build_shard(frames: Sequence[bytes | None]) -> bytearray:
    """A shard's bytes: the encoded rows in order, then the index and its crc32c (rows that are None: empty)."""
    out = _kernels.shard_body(frames)  # one pass in C: a shard is hundreds of KB of rows
    index = bytes(out[len(out) - index_nbytes(len(frames)) : len(out) - 4])
    struct.pack_into("<I", out, len(out) - 4, google_crc32c.value(index))
    return out


def parse_index(buf: Any, rows: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The (offsets, nbytes) of a shard's rows, int64, -1 for rows never written; every range checked to lie in the
    shard's data.

    Raises
    ------
    CorruptStoreError
        Too short for its index, a crc32c mismatch, a half-empty entry, or a range outside the shard's data.
    """
    size = len(buf)
    need = index_nbytes(rows)
    if size < need:
        raise CorruptStoreError(f"{where}: {size} bytes, shorter than the index of {rows} rows ({need} bytes)")
    raw_index = bytes(buf[size - need : size - 4])
    (crc,) = struct.unpack("<I", bytes(buf[size - 4 : size]))
    if google_crc32c.value(raw_index) != crc:
        raise CorruptStoreError(f"{where}: the shard index fails its crc32c check")
    index = np.frombuffer(raw_index, "<u8").reshape(rows, 2)
    empty = index == EMPTY
    if (empty[:, 0] != empty[:, 1]).any():
        raise CorruptStoreError(f"{where}: a shard index entry has only one of offset and nbytes empty")
    data_end = size - need
    live = ~empty[:, 0]
    if (index[live, 0] > data_end).any() or (index[live, 1] > data_end - index[live, 0]).any():
        raise CorruptStoreError(f"{where}: a shard index entry points past the shard's {data_end} bytes of data")
    offsets = np.where(live, index[:, 0], 0).astype(np.int64)
    nbytes = np.where(live, index[:, 1], 0).astype(np.int64)
    offsets[~live] = -1
    return offsets, nbytes


