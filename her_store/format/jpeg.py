"""Lossy image codecs, off by default: JPEG frames in a sharded image array, for users who accept the error.

A store created with ``compressors={"observation": "jpeg"}`` (or :func:`jpeg_codec` for another quality) keeps its
image field as the sharded array every compressed field is (FORMAT.md, Arrays), each frame one inner chunk whose
codec chain is ``bytes`` then ``her_store.jpeg``: a Zarr v3 codec registered with zarr by this module and by
her_store's ``zarr.codecs`` entry point, so ``zarr`` alone reads any frame once her_store is installed. Encoding
needs imagecodecs (``pip install "her_store[lossy]"``).

An encoded frame is one baseline JPEG followed by the crc32c of its bytes (4 bytes, little-endian; JPEG decoders
ignore bytes after the end-of-image marker). How a frame of shape ``shape`` becomes one image, by SB3's rule for
where the channels are (the smallest axis, channels first when it is the first):

- ``(H, W)``: a grayscale image;
- ``(3, H, W)`` (SB3's image observations after VecTransposeImage) or ``(H, W, 3)``: a color image (YCbCr without
  chroma subsampling: small objects of an 84x84 frame keep their color);
- ``(C, H, W)`` or ``(H, W, C)`` with C other than 3 (frame stacks, one channel): the C planes stacked as one
  grayscale image of ``C * H`` rows.

The error is reported by :func:`error_report`. The rows a writer stages are not what readers decode, so an
episode's crc32 does not cover a lossy array: each frame carries its own crc32c instead, checked on every read.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import struct
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import google_crc32c
import numpy as np
from zarr.abc.codec import BytesBytesCodec
from zarr.core.common import JSON, parse_named_configuration
from zarr.registry import register_codec

from her_store.checks import is_int

if TYPE_CHECKING:
    from typing import Self

    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer

__all__ = [
    "ErrorReport", "JpegCodec", "JpegFrames", "check_frames", "error_report", "frame_codec", "is_lossy", "jpeg_codec"
]

CODEC_NAME = "her_store.jpeg"
DEFAULT_QUALITY = 90
MAX_SIDE = 65500  # libjpeg's largest image side
MAX_SEGMENTS = 32  # markers before the frame header: libjpeg writes 3 to 5; more is not a frame her_store wrote


def _imagecodecs() -> ModuleType:
    """imagecodecs, or ImportError saying which extra of her_store installs it (the core has no hard dependency)."""
    try:
        return importlib.import_module("imagecodecs")
    except ImportError as e:
        raise ImportError(
            'imagecodecs is needed for JPEG image fields; install it with: pip install "her_store[lossy]"'
        ) from e


def _parse_quality(quality: Any) -> int:
    if not is_int(quality) or not 1 <= quality <= 100:
        raise ValueError(f"JPEG quality must be an int from 1 to 100, got {quality!r}")
    return int(quality)


class _Plan(NamedTuple):
    """How a frame of ``shape`` maps to one JPEG image."""

    image: tuple[int, ...]  # (rows, cols) grayscale or (rows, cols, 3) color
    channels_first: bool
    stacked: bool  # planes stacked as one grayscale image

    @property
    def direct(self) -> bool:
        """Whether the image's bytes are the frame's in C order (decoded straight into the row)."""
        return self.stacked == self.channels_first


def check_frames(dtype: Any, shape: tuple[int, ...]) -> _Plan:
    """How frames of ``dtype`` and ``shape`` are encoded as JPEG images.

    Raises
    ------
    ValueError
        Not uint8, not 2 or 3 dimensions, or an image side larger than JPEG allows.

    Examples
    --------
    >>> check_frames(np.uint8, (3, 84, 84)).image
    (84, 84, 3)
    >>> check_frames(np.uint8, (4, 84, 84)).image
    (336, 84)
    """
    shape = tuple(int(s) for s in shape)
    if np.dtype(dtype) != np.uint8 or len(shape) not in (2, 3) or min(shape, default=0) < 1:
        raise ValueError(
            f"JPEG encodes uint8 frames of shape (H, W), (C, H, W) or (H, W, C); got {np.dtype(dtype)} frames of "
            f"shape {shape}"
        )
    if len(shape) == 2:
        plan = _Plan(shape, False, False)
    else:
        first = int(np.argmin(shape)) == 0  # SB3's is_image_space_channels_first
        c, h, w = shape if first else (shape[2], shape[0], shape[1])
        plan = _Plan((h, w, 3), first, False) if c == 3 else _Plan((c * h, w), first, True)
    if max(plan.image[:2]) > MAX_SIDE:
        raise ValueError(
            f"frames of shape {shape} make a {plan.image[0]}x{plan.image[1]} JPEG; sides are at most {MAX_SIDE}"
        )
    return plan


def _header(raw: bytes) -> tuple[int, int, int]:
    """(rows, cols, components) of a baseline or extended sequential JPEG's frame header, read before decoding.

    Raises
    ------
    ValueError
        No SOI marker, a malformed segment, or no sequential frame header among the first segments.
    """
    if raw[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG (no start-of-image marker)")
    pos, n = 2, len(raw)
    for _ in range(MAX_SEGMENTS):
        if pos + 4 > n or raw[pos] != 0xFF:
            break
        marker = raw[pos + 1]
        (length,) = struct.unpack_from(">H", raw, pos + 2)
        if marker in (0xC0, 0xC1):  # SOF0/SOF1: precision, rows, cols, components
            if length < 8 or pos + 10 > n or raw[pos + 4] != 8:
                break
            rows, cols = struct.unpack_from(">HH", raw, pos + 5)
            return rows, cols, raw[pos + 9]
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) or marker == 0xDA or length < 2:
            break  # another kind of frame (progressive, lossless, arithmetic), or image data before any frame
        pos += 2 + length
    raise ValueError("no 8-bit sequential JPEG frame header where libjpeg writes one")


class JpegFrames:
    """One frame at a time, as :class:`her_store.format.frames.FrameCodec` calls it: ``encode(row)`` and ``decode(raw,
    out)``.

    Parameters
    ----------
    quality : int
        JPEG quality, 1..100.
    dtype, shape
        The frames' (one row's) dtype and shape; see :func:`check_frames`.

    Examples
    --------
    >>> frames = JpegFrames(90, np.uint8, (3, 8, 8))
    >>> out = np.empty((3, 8, 8), np.uint8)
    >>> frames.decode(frames.encode(np.full((3, 8, 8), 100, np.uint8)), out.reshape(-1)).shape
    (192,)
    """

    def __init__(self, quality: int, dtype: Any, shape: tuple[int, ...]) -> None:
        self.quality = _parse_quality(quality)
        self.plan = check_frames(dtype, shape)
        self.shape = tuple(int(s) for s in shape)
        self.nbytes = int(np.prod(self.shape))
        self._ic = _imagecodecs()

    def _to_image(self, row: np.ndarray) -> np.ndarray:
        plan, frame = self.plan, row.reshape(self.shape)
        if plan.direct:
            return np.ascontiguousarray(frame).reshape(plan.image)
        # channels moved one plane at a time: about 3x faster than copying a transposed view
        if plan.stacked:  # (H, W, C) to C planes
            image = np.empty((self.shape[2], *self.shape[:2]), np.uint8)
            for c in range(len(image)):
                image[c] = frame[:, :, c]
        else:  # (3, H, W) to (H, W, 3)
            image = np.empty(plan.image, np.uint8)
            for c in range(3):
                image[:, :, c] = frame[c]
        return image.reshape(plan.image)

    def encode(self, row: np.ndarray) -> bytes:
        """One frame's bytes: a JPEG, then its crc32c."""
        jpeg = self._ic.jpeg8_encode(self._to_image(row), level=self.quality, subsampling="444")
        return bytes(jpeg) + struct.pack("<I", google_crc32c.value(jpeg))

    def decode(self, raw: Any, out: np.ndarray) -> np.ndarray:
        """Decode one frame's bytes into ``out`` (one row's buffer, any shape of its size); returns ``out``.

        Raises
        ------
        ValueError
            The bytes fail their crc32c, or are not a JPEG of exactly this frame's image (checked from its header,
            before anything is decoded or allocated).
        """
        data = raw if isinstance(raw, bytes) else bytes(raw)
        jpeg = data[:-4]
        if len(data) < 8 or struct.unpack_from("<I", data, len(jpeg))[0] != google_crc32c.value(jpeg):
            raise ValueError("a JPEG frame that fails its crc32c check")
        plan = self.plan
        found = _header(jpeg)
        want = (*plan.image[:2], 3 if len(plan.image) == 3 else 1)
        if found != want or jpeg[-2:] != b"\xff\xd9":
            raise ValueError(f"a JPEG of (rows, cols, components) {found}, expected {want} and an end-of-image marker")
        frame = out.reshape(self.shape)
        if plan.direct:
            self._ic.jpeg8_decode(jpeg, out=frame.reshape(plan.image))
            return out
        image = self._ic.jpeg8_decode(jpeg, out=np.empty(plan.image, np.uint8))
        if plan.stacked:  # (C * H, W) planes of an (H, W, C) frame
            frame[...] = image.reshape(self.shape[2], *self.shape[:2]).transpose(1, 2, 0)
        else:  # an (H, W, 3) image of a (3, H, W) frame
            frame[...] = image.transpose(2, 0, 1)
        return out


@functools.lru_cache(maxsize=64)
def _frames(quality: int, dtype: str, shape: tuple[int, ...]) -> JpegFrames:
    return JpegFrames(quality, np.dtype(dtype), shape)


@dataclass(frozen=True)
class JpegCodec(BytesBytesCodec):
    """The ``her_store.jpeg`` Zarr v3 codec: a chunk of one uint8 frame (shape ``(1, *frame)``) as one JPEG and its
    crc32c (see the module's docstring for how a frame becomes an image).

    Registered with zarr when her_store is installed (an entry point) or imported, so ``zarr.open_array`` decodes
    a her_store JPEG field without her_store's reader.

    Parameters
    ----------
    quality : int
        JPEG quality, 1..100 (default 90: on rendered 84x84 frames a mean absolute error of about 1.5 levels).

    Examples
    --------
    >>> from her_store.format.jpeg import JpegCodec
    >>> JpegCodec(quality=80).to_dict()
    {'name': 'her_store.jpeg', 'configuration': {'quality': 80}}
    """

    is_fixed_size = False

    quality: int = DEFAULT_QUALITY

    def __init__(self, *, quality: int = DEFAULT_QUALITY) -> None:
        object.__setattr__(self, "quality", _parse_quality(quality))

    @classmethod
    def from_dict(cls, data: dict[str, JSON]) -> Self:
        _, config = parse_named_configuration(data, CODEC_NAME)
        if set(config or {}) - {"quality"}:
            raise ValueError(f"{CODEC_NAME} configuration {config!r}, expected only 'quality'")
        return cls(**(config or {}))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, JSON]:
        return {"name": CODEC_NAME, "configuration": {"quality": self.quality}}

    def _frames_of(self, chunk_spec: ArraySpec) -> JpegFrames:
        shape = tuple(chunk_spec.shape)
        if len(shape) < 3 or shape[0] != 1:
            raise ValueError(
                f"{CODEC_NAME} encodes chunks of one frame, shape (1, *frame); got chunks of shape {shape}"
            )
        return _frames(self.quality, chunk_spec.dtype.to_native_dtype().str, shape[1:])

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        frames = self._frames_of(chunk_spec)
        out = frames.decode(chunk_bytes.as_numpy_array(), np.empty(frames.nbytes, np.uint8))
        return chunk_spec.prototype.buffer.from_array_like(out)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer:
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    def _encode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        raw = self._frames_of(chunk_spec).encode(chunk_bytes.as_numpy_array())
        return chunk_spec.prototype.buffer.from_bytes(raw)

    async def _encode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> Buffer | None:
        return await asyncio.to_thread(self._encode_sync, chunk_bytes, chunk_spec)

    def compute_encoded_size(self, _input_byte_length: int, _chunk_spec: ArraySpec) -> int:
        raise NotImplementedError


register_codec(CODEC_NAME, JpegCodec)


def jpeg_codec(quality: int = DEFAULT_QUALITY) -> JpegCodec:
    """The lossy codec of ``compressors={"observation": "jpeg"}``; pass it yourself for another quality.

    Raises
    ------
    ImportError
        imagecodecs is not installed (``pip install "her_store[lossy]"``).
    ValueError
        ``quality`` is not an int from 1 to 100.

    Examples
    --------
    >>> from her_store.format.jpeg import jpeg_codec
    >>> jpeg_codec(quality=95).quality
    95
    """
    _imagecodecs()
    return JpegCodec(quality=quality)


def is_lossy(codec: Any) -> bool:
    """Whether a Zarr codec is one of this module's (its frames are not the rows written)."""
    return isinstance(codec, JpegCodec)


def frame_codec(codec: JpegCodec, dtype: Any, row_shape: tuple[int, ...]) -> JpegFrames:
    """The one-frame encoder/decoder :class:`her_store.format.frames.FrameCodec` uses for a lossy inner codec.

    Raises
    ------
    ValueError
        The rows are not frames it encodes.
    ImportError
        imagecodecs is not installed.

    Examples
    --------
    >>> frame_codec(jpeg_codec(), np.uint8, (3, 84, 84)).plan.image
    (84, 84, 3)
    """
    return JpegFrames(codec.quality, dtype, row_shape)


class ErrorReport(NamedTuple):
    """What a lossy codec does to sample frames (levels are uint8 steps, 0..255)."""

    frames: int
    mean_abs_error: float
    max_abs_error: int
    psnr_db: float  # inf when every frame comes back exact
    bytes_per_frame: float  # encoded, with the 4-byte crc32c
    ratio: float  # raw frame bytes / encoded bytes

    def __str__(self) -> str:
        return (
            f"{self.frames} frames: mean |error| {self.mean_abs_error:.2f}, max {self.max_abs_error}, "
            f"PSNR {self.psnr_db:.1f} dB, {self.bytes_per_frame:.0f} bytes a frame ({self.ratio:.1f}x smaller)"
        )


def error_report(frames: np.ndarray, codec: JpegCodec | None = None) -> ErrorReport:
    """The error a lossy codec introduces on sample frames: encode and decode each, compare with the original.

    Parameters
    ----------
    frames : numpy.ndarray
        uint8, shape ``(n, *frame)``: frames as the store's field holds them (e.g. ``(n, 3, 84, 84)``).
    codec : JpegCodec, optional
        Default: :func:`jpeg_codec` at its default quality.

    Raises
    ------
    ValueError
        No frames, or frames the codec does not encode.

    Examples
    --------
    >>> import numpy as np
    >>> from her_store.format.jpeg import error_report, jpeg_codec
    >>> frames = np.random.default_rng(0).integers(0, 256, (4, 3, 16, 16), dtype=np.uint8)
    >>> r = error_report(frames, jpeg_codec(quality=100))
    >>> r.frames, r.max_abs_error < 40
    (4, True)
    """
    frames = np.asarray(frames)
    codec = jpeg_codec() if codec is None else codec
    if frames.ndim < 3 or len(frames) == 0:
        raise ValueError(f"error_report takes frames of shape (n, *frame) with n >= 1, got shape {frames.shape}")
    coder = frame_codec(codec, frames.dtype, frames.shape[1:])
    decoded = np.empty(frames.shape, np.uint8)
    size = 0
    for frame, out in zip(frames, decoded):
        raw = coder.encode(frame)
        size += len(raw)
        coder.decode(raw, out)
    err = np.abs(decoded.astype(np.int16) - frames)
    mse = float(np.mean(err.astype(np.float64) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)
    return ErrorReport(len(frames), float(err.mean()), int(err.max()), psnr, size / len(frames), frames.nbytes / size)
