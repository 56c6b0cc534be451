"""The pure kernels (her_store._kernels.pure) against the compiled ones (her_store._kernels._frames): every function, on
the same inputs, hostile ones included (ranges outside their source, rows never written, corrupt LZ4 blocks, empty
batches, rows taken at a stride, files cut short before the call, several threads), writes the same bytes, answers
the same tuples and raises the same exceptions."""

from __future__ import annotations

import errno
import mmap
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import numcodecs.lz4
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from her_store import _kernels
from her_store._kernels import pure

frames = pytest.importorskip(
    "her_store._kernels._frames", reason="the compiled kernels are not built: nothing to compare"
)
PATHS = (frames, pure)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHANGES = (
    "negative offset", "offset past the source", "range past the source", "never written", "huge nbytes", "no bytes",
    "header", "one byte more", "one byte less", "garbage block", "short block", "long block",
)
# those whose answer does not depend on where LZ4 stops reading a block: with the file cut short, C meets the first
# page past its end where its decoder reads it (a damaged block may fail before), the pure path where the row reaches it
INDEX_CHANGES = CHANGES[:7]


def _outcome(call: Callable[..., Any], *args: Any) -> tuple:
    """What a call gave: ("ok", its value), or ("raised", the exception's type and, for those whose words are the
    kernels' own or the buffer's exporter's, its words or errno)."""
    try:
        return "ok", call(*args)
    except (ValueError, TypeError, BufferError, OverflowError, OSError, RuntimeError) as e:
        said = e.errno if isinstance(e, OSError) else str(e) if isinstance(e, (ValueError, BufferError)) else None
        return "raised", type(e), said


def _both(name: str, make: Callable[[Any], tuple] | tuple) -> list[tuple[tuple, tuple]]:
    """Each path's outcome of ``name`` on the arguments ``make`` (fresh ones from ``make(path)``), and those arguments
    after the call."""
    got = []
    for path in PATHS:
        args = make if isinstance(make, tuple) else make(path)
        got.append((_outcome(getattr(path, name), *args), args))
    return got


def _lz4_block_claiming_a_row(n: int, row_nbytes: int) -> bytes:
    """A valid LZ4 block of ``n`` bytes whose size header claims ``row_nbytes``: it decodes to a short or long row."""
    block = numcodecs.lz4.compress(np.arange(n, dtype=np.uint8))
    return row_nbytes.to_bytes(4, "little") + block[4:]


@st.composite
def lz4_batches(
    draw: st.DrawFn, changes: tuple[str, ...] = CHANGES
) -> tuple[np.ndarray, bytearray, np.ndarray, np.ndarray, int]:
    """Rows, their encoded bytes one after the other, each row's offset and size, and the row size, with up to three
    rows changed as a damaged or hostile index or file would change them."""
    rn = draw(st.sampled_from([1, 5, 64, 192, 3000]))
    n = draw(st.integers(0, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = rng.integers(0, draw(st.sampled_from([2, 16, 256])), (n, rn), np.uint8)
    encoded = frames.encode_lz4(rows, rn, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    offsets = np.cumsum(nbytes) - nbytes
    src = bytearray(b"".join(encoded))
    damage = st.tuples(st.integers(0, max(n - 1, 0)), st.sampled_from(changes))
    for i, change in draw(st.lists(damage, max_size=3, unique_by=lambda d: d[0])):  # a change each, to other rows
        if not n:
            break
        if change == "negative offset":
            offsets[i] = draw(st.sampled_from([-1, -(2**63)]))
        elif change == "offset past the source":
            offsets[i] = len(src) + draw(st.sampled_from([1, 4096, 2**62]))
        elif change == "range past the source":
            nbytes[i] = len(src) - offsets[i] + 1
        elif change == "never written":
            nbytes[i] = -1
        elif change == "huge nbytes":
            nbytes[i] = draw(st.sampled_from([2**31, 2**62, 2**63 - 1]))
        elif change in ("one byte more", "one byte less", "no bytes"):
            nbytes[i] = {"one byte more": nbytes[i] + 1, "one byte less": nbytes[i] - 1, "no bytes": 0}[change]
        elif change == "header":
            src[offsets[i] + draw(st.integers(0, 3))] ^= 1 << draw(st.integers(0, 7))
        elif change == "garbage block":
            src[offsets[i] + 4 : offsets[i] + nbytes[i]] = bytes([draw(st.integers(0, 255))]) * int(nbytes[i] - 4)
        else:
            extra = _lz4_block_claiming_a_row(rn - 1 if change == "short block" and rn > 1 else rn + 50, rn)
            offsets[i], nbytes[i] = len(src), len(extra)
            src += extra
    return rows, src, offsets, nbytes, rn


def _same_out(outs: list[np.ndarray], failed: int, slot: int | None) -> None:
    """Both paths' out alike, but for the slot of a row that failed (C may have written part of it)."""
    a, b = (o.copy() for o in outs)
    if failed >= 0 and slot is not None and 0 <= slot < len(a):
        a[slot] = b[slot] = 0
    np.testing.assert_array_equal(a, b)


# -- decoders --------------------------------------------------------------------------------------------------------


@SETTINGS
@given(batch=lz4_batches(), spare=st.integers(0, 2))
@example(  # a block overwritten with 0x50s: valid LZ4 of five 0x50s, not the row it held
    batch=(np.array([[0, 1, 1, 1, 1]], np.uint8), bytearray(b"\x05\x00\x00\x00PPPPPP"), np.array([0]),
           np.array([10]), 5),
    spare=0,
)
def test_decode_lz4_is_the_same_on_both_paths(batch, spare):
    rows, src, offsets, nbytes, rn = batch
    got = _both("decode_lz4", lambda _: (bytes(src), offsets, nbytes, np.full((len(rows) + spare, rn), 7, "u1"), rn))
    (a, args_a), (b, args_b) = got
    assert a == b
    failed = a[1][0] if a[0] == "ok" else -1
    _same_out([args_a[3], args_b[3]], failed, failed)
    if a == ("ok", (-1, 0)):  # each row is its block as numcodecs decodes it (a changed block may still be valid LZ4)
        blocks = [numcodecs.LZ4().decode(bytes(src[o : o + k])) for o, k in zip(offsets, nbytes)]
        want = np.frombuffer(b"".join(blocks), np.uint8).reshape(rows.shape)
        np.testing.assert_array_equal(args_a[3][: len(rows)], want)


@SETTINGS
@given(batch=lz4_batches(), order_seed=st.integers(0, 2**16), cut=st.none() | st.floats(0, 1), bad_fd=st.booleans())
def test_pread_lz4_is_the_same_on_both_paths(tmp_path_factory, batch, order_seed, cut, bad_fd):
    rows, src, offsets, nbytes, rn = batch
    n = len(rows)
    path = tmp_path_factory.mktemp("pread") / "f"
    path.write_bytes(b"pad" + src)
    if cut is not None:  # the file cut short before the call
        os.truncate(path, int(cut * (len(src) + 3)))
    dst = np.random.default_rng(order_seed).permutation(n).astype(np.int64)
    with open(path, "rb") as f:
        fds = np.full(n, f.fileno(), np.int32)
        if bad_fd and n:
            fds[n // 2] = -1
        got = _both("pread_lz4", lambda _: (fds, offsets + 3, nbytes, dst, np.full((n, rn), 7, np.uint8), rn))
    (a, args_a), (b, args_b) = got
    assert a[0] == b[0] == "ok", (a, b)
    assert a[1][:2] == b[1][:2] and a[1][2] >= 0 and b[1][2] >= 0  # the blocks read from disk: the machine's
    failed = a[1][0]
    _same_out([args_a[4], args_b[4]], failed, int(dst[failed]) if failed >= 0 else None)


@SETTINGS
@given(
    data=st.data(), order_seed=st.integers(0, 2**16), cut=st.none() | st.floats(0, 1),
    threads=st.sampled_from([None, 1, 2, 4]), pad=st.sampled_from([0, 3, 4096 + 5]),
)
def test_map_lz4_is_the_same_on_both_paths(tmp_path_factory, data, order_seed, cut, threads, pad):
    """From a mapped file (each path's own Mapping) and from a bytes copy; a file cut short before the call fails the
    first row on a page past its end with EIO on both; with threads the first failing row is the answer."""
    rows, src, offsets, nbytes, rn = data.draw(lz4_batches(CHANGES if cut is None else INDEX_CHANGES))
    n = len(rows)
    if not src:
        src += b"\0"  # a map holds a byte at least
    path = tmp_path_factory.mktemp("map") / "f"
    path.write_bytes(bytes(pad) + src)
    rng = np.random.default_rng(order_seed)
    dst = rng.permutation(n).astype(np.int64)
    slots = rng.integers(0, 2, n).astype(np.int32)
    with open(path, "r+b") as f:
        maps = {p: (p.map_file(f.fileno(), pad, len(src)), bytes(src)) for p in PATHS}
        if cut is not None:
            os.ftruncate(f.fileno(), int(cut * (len(src) + pad)))
        name = "map_lz4" if threads is None else "map_lz4_start"
        tail = () if threads is None else (threads,)
        got = _both(name, lambda p: (maps[p], slots, offsets, nbytes, dst, np.full((n, rn), 7, np.uint8), rn, *tail))
    (a, args_a), (b, args_b) = got
    assert a[0] == b[0] == "ok", (a, b)
    answers = [a[1], b[1]] if threads is None else [a[1].wait(), b[1].wait()]
    assert answers[0][:2] == answers[1][:2], answers
    failed = answers[0][0]
    if threads is not None and threads > 1 and failed >= 0:  # threads decode past the first failing row meanwhile
        done = dst[:failed]
        np.testing.assert_array_equal(args_a[5][done], args_b[5][done])
    else:
        _same_out([args_a[5], args_b[5]], failed, int(dst[failed]) if failed >= 0 else None)


@SETTINGS
@given(
    data=st.data(), rn=st.sampled_from([1, 8, 100, 1000]), chunk_rows=st.integers(0, 40),
    base=st.sampled_from([0, mmap.ALLOCATIONGRANULARITY]), cut=st.none() | st.floats(0, 1), with_at=st.booleans(),
)
def test_take_rows_is_the_same_on_both_paths(tmp_path_factory, data, rn, chunk_rows, base, cut, with_at):
    """A chunk mapped as the reader maps it (each path's map_file, the rows ``skip`` bytes in), rows outside it, at
    entries outside out or repeated, the file cut short before the call."""
    skip = data.draw(st.integers(0, 30))
    path = tmp_path_factory.mktemp("take") / "f"
    body = np.random.default_rng(chunk_rows).integers(0, 256, skip + chunk_rows * rn + 1, np.uint8).tobytes()
    path.write_bytes(bytes(base) + body)
    first = data.draw(st.sampled_from([0, 100, -(2**62), 2**62]))
    n = data.draw(st.integers(0, 12))
    near = st.integers(first - 2, first + chunk_rows + 2)
    extreme = st.sampled_from([-(2**63), 2**63 - 1])
    rows = np.array(data.draw(st.lists(near | extreme, min_size=n, max_size=n)), np.int64)
    out_rows = data.draw(st.integers(n, n + 3)) if not with_at else data.draw(st.integers(0, n + 3))
    at = np.array(data.draw(st.lists(st.integers(-1, out_rows), min_size=n, max_size=n)), np.int64) if with_at else None
    with open(path, "r+b") as f:
        maps = {p: p.map_file(f.fileno(), base, len(body)) for p in PATHS}
        if cut is not None:
            os.ftruncate(f.fileno(), base + int(cut * len(body)))
        tail = () if at is None else (at,)
        out = np.full((out_rows, rn), 7, np.uint8)
        got = _both("take_rows", lambda p: (maps[p], rows, first, skip, out.copy(), rn, *tail))
    (a, args_a), (b, args_b) = got
    assert a == b
    if a[0] == "ok":
        failed, err = a[1]
        slot = (int(at[failed]) if at is not None else failed) if failed >= 0 and err == errno.EIO else None
        _same_out([args_a[4], args_b[4]], failed, slot)


def test_take_rows_sharing_memory_with_out_reads_each_entry_as_it_is_used(tmp_path):
    """at sharing memory with out: a row copied over the next entry (a huge value) fails that row on both paths."""
    huge = np.full(8, 2**44, np.int64).view(np.uint8)
    (tmp_path / "g").write_bytes(huge.tobytes() * 2)
    with open(tmp_path / "g", "rb") as g:
        rows8 = mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ)
        answers = []
        for path in PATHS:
            into = np.zeros(16, np.int64)
            into[:2] = [1, 0]  # at = into[:2]: row 0 goes to into[1], which is at[1]
            got = path.take_rows(rows8, np.array([0, 1], np.int64), 0, 0, into.view(np.uint8), 8, into[:2])
            answers.append((got, into))
        del rows8
    assert answers[0][0] == answers[1][0] == (1, 0)
    np.testing.assert_array_equal(answers[0][1], answers[1][1])


def test_pread_lz4_and_map_lz4_sharing_memory_with_out_read_each_entry_as_it_is_used(tmp_path):
    """dst (and slots) sharing memory with out: decoding row 0 overwrites the entries of the rows after it."""
    rows = np.random.default_rng(0).integers(0, 9, (5, 192), np.uint8)
    encoded = frames.encode_lz4(rows, 192, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    offsets = np.cumsum(nbytes) - nbytes
    blob = b"".join(encoded)
    (tmp_path / "f").write_bytes(blob)
    seen = []
    for path in PATHS:
        out = np.zeros((5, 192), np.uint8)
        dst = out[4].view(np.int64)[:5]
        dst[:] = [4, 0, 1, 2, 3]  # row 0 goes to out[4], over dst itself
        with open(tmp_path / "f", "rb") as f:
            seen.append(path.pread_lz4(np.full(5, f.fileno(), np.int32), offsets, nbytes, dst, out, 192)[:2])
        seen.append(out.copy())
        out[:] = 0
        dst[:] = [4, 0, 1, 2, 3]
        slots = out[4][64:].view(np.int32)[:5]
        slots[:] = 0
        seen.append(path.map_lz4((blob,), slots, offsets, nbytes, dst, out, 192)[:2])
        seen.append(out.copy())
    assert seen[0] == seen[4] == (1, 0) and seen[2] == seen[6] == (1, 0)
    for k in (1, 3):
        np.testing.assert_array_equal(seen[k], seen[k + 4])


# -- encoders, shards, checksums -------------------------------------------------------------------------------------

TAKES = [
    lambda a: a,
    lambda a: a[1:7, 2],
    lambda a: a[::-2, 0],
    lambda a: a[3:4, 1],
    lambda a: a[:, :, :, ::2],  # rows that are not contiguous
    lambda a: np.broadcast_to(a[0, 0], (5, *a.shape[2:])),  # one row repeated at stride 0
    lambda a: a.reshape(-1),  # flat bytes
    lambda a: a[0, 0, 0],  # one row, 1-d
    lambda a: a[:, 0, 0, 0],  # one item a row, at a stride
    lambda a: np.asfortranarray(a[:, 0]),
]


@SETTINGS
@given(
    take=st.sampled_from(TAKES), dtype=st.sampled_from(["u1", "<i2", "<f4"]), levels=st.sampled_from([2, 200]),
    row=st.sampled_from(["right", "one more", "zero", "negative", "huge"]),
    acceleration=st.sampled_from([-5, 0, 1, 3, 100, 70_000]), threads=st.sampled_from([None, 1, 3]),
)
def test_encode_lz4_is_the_same_on_both_paths(take, dtype, levels, row, acceleration, threads):
    rows = take(np.random.default_rng(levels).integers(0, levels, (8, 3, 4, 6)).astype(dtype))
    right = rows[0].nbytes if rows.ndim > 1 and len(rows) else rows.itemsize
    rn = {"right": right, "one more": right + 1, "zero": 0, "negative": -right, "huge": 1 << 31}[row]
    name, tail = ("encode_lz4", ()) if threads is None else ("encode_lz4_start", (threads,))
    (a, _), (b, _) = _both(name, lambda _: (rows, rn, acceleration, *tail))
    if threads is not None and a[0] == b[0] == "ok":
        a, b = _outcome(a[1].wait), _outcome(b[1].wait)
    assert a == b
    if a[0] == "ok":
        want = np.ascontiguousarray(rows).reshape(-1).view(np.uint8).reshape(-1, rn)
        assert [numcodecs.lz4.decompress(f) for f in a[1]] == [r.tobytes() for r in want]


def test_encode_lz4_refuses_what_is_not_rows_alike():
    for args in (([1, 2, 3], 3, 1), (b"x" * 10, 3, 1), (b"x" * 10, 5, 2**31), (b"x" * 10, 5.0, 1), (None, 5, 1)):
        for name in ("encode_lz4", "encode_lz4_start"):
            (a, _), (b, _) = _both(name, args)
            assert a == b and a[0] == "raised", (name, args, a)
    for threads in (0, 65, 2**32 + 3, -(2**32) + 2, 2**70, "2", 1.0):
        (a, _), (b, _) = _both("encode_lz4_start", (b"x" * 10, 5, 1, threads))
        assert a == b and a[0] == "raised", (threads, a)


ITEMS = [
    b"abc", bytearray(b"de"), None, b"", np.arange(6, dtype=np.int16), np.zeros((2, 3), np.uint8),
    memoryview(b"xyz"), np.arange(8, dtype=np.uint8)[::2], "text", 3, np.asfortranarray(np.zeros((2, 3), np.uint8)),
]


@SETTINGS
@given(
    items=st.lists(st.sampled_from(range(len(ITEMS))), max_size=6), as_tuple=st.booleans(),
    value=st.sampled_from([0, 7, -1, 2**32 + 5]),
)
def test_shard_body_and_crc32_all_are_the_same_on_both_paths(items, as_tuple, value):
    rows = [ITEMS[i] for i in items]
    rows = tuple(rows) if as_tuple else rows
    (a, _), (b, _) = _both("shard_body", (rows,))
    assert a == b and (a[0] == "raised" or type(a[1]) is bytearray)
    (a, _), (b, _) = _both("crc32_all", (rows, value))
    assert a == b


def test_shard_body_and_crc32_all_refuse_what_is_not_a_list_alike():
    for items in ("abc", {b"a": 1}, b"ab", np.zeros(3), iter([b"a"])):
        for name in ("shard_body", "crc32_all"):
            (a, _), (b, _) = _both(name, (items,))
            assert a == b and a[0] == "raised", (name, items)


@SETTINGS
@given(
    runs=st.lists(st.tuples(st.integers(-2, 1100), st.integers(-2, 1100), st.integers(0, 2**32 - 1)), max_size=6),
    kind=st.sampled_from(["right", "int32 starts", "float ends", "big-endian starts", "bytes crcs", "read-only crcs",
                          "strided crcs", "uint8 crcs", "one run short", "shared"]),
)
def test_crc32_runs_is_the_same_on_both_paths(runs, kind):
    data = np.random.default_rng(len(runs)).integers(0, 256, 1000, np.uint8).tobytes()

    def make(_: Any) -> tuple:
        starts = np.array([r[0] for r in runs], np.int64)
        ends = np.array([r[1] for r in runs], np.int64)
        crcs = np.array([r[2] for r in runs], np.uint32)
        if kind == "int32 starts":
            starts = starts.astype(np.int32)
        elif kind == "float ends":
            ends = ends.astype(np.float64)
        elif kind == "big-endian starts":
            starts = starts.astype(">i8")
        elif kind == "bytes crcs":
            crcs = crcs.tobytes()
        elif kind == "read-only crcs":
            crcs.flags.writeable = False
        elif kind == "strided crcs":
            crcs = np.repeat(crcs, 2)[::2]
        elif kind == "uint8 crcs":
            crcs = crcs.view(np.uint8)
        elif kind == "one run short":
            ends = ends[:-1]
        elif kind == "shared" and runs:  # crcs sharing memory with ends: each crc written changes a later end
            ends = np.full(2 * len(runs), 1000, np.int64)
            starts = np.zeros(2 * len(runs), np.int64)
            crcs = ends.view(np.uint32)[2 * len(runs) :]
        return data, starts, ends, crcs

    (a, args_a), (b, args_b) = _both("crc32_runs", make)
    assert a == b
    assert bytes(args_a[3]) == bytes(args_b[3])


def test_crc32_and_same_bytes_are_the_same_on_both_paths():
    data = np.random.default_rng(0).integers(0, 256, 5000, np.uint8)
    for args in (
        (data,), (data[1:].tobytes(), 5), (b"",), (b"", 0xDEADBEEF), (data, -1), (data, 2**32 + 5),
        (data, np.uint32(7)),
        (data[::2],), ("text",), (data, 1.5), (memoryview(data)[3:],), (np.zeros((4, 3), np.float32),),
    ):
        (a, _), (b, _) = _both("crc32", args)
        assert a == b, args
    for args in (
        (b"abc", b"abc"), (b"abc", b"abd"), (b"abc", b"ab"), (b"", b""), (data, data.tobytes()),
        (data.view(np.int32), data), (data[::2], data[::2]), ("a", "a"), (b"a", None),
    ):
        (a, _), (b, _) = _both("same_bytes", args)
        assert a == b, args


# -- mapped files ----------------------------------------------------------------------------------------------------


def test_map_file_is_the_same_on_both_paths(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 100, np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f:
        for offset, length in (
            (0, len(data)), (4097, 5000), (8191, 1), (len(data) - 1, 1), (-1, 10), (0, 0), (0, -5), (0, len(data) + 1),
            (len(data), 1), (1 << 62, 1), (0, 2**63), (2**64, 1), (0.0, 1),
        ):
            (a, _), (b, _) = _both("map_file", (f.fileno(), offset, length))
            if a[0] == "ok":
                assert b[0] == "ok" and len(a[1]) == len(b[1]) == length
                assert bytes(memoryview(a[1])) == bytes(memoryview(b[1])) == data[offset : offset + length]
                assert memoryview(a[1]).readonly and memoryview(b[1]).readonly and bool(a[1]) and bool(b[1])
                for m in (a[1], b[1]):
                    m.drop_pages()  # read again from the file
                    assert bytes(memoryview(m)) == data[offset : offset + length]
            else:
                assert a == b, (offset, length, a, b)
    for fd in (-1, 2**31, "3"):
        (a, _), (b, _) = _both("map_file", (fd, 0, 10))
        assert a == b and a[0] == "raised", (fd, a)


def _advised_random(mapping: Any) -> bool:
    """Whether the pages of ``mapping`` are advised MADV_RANDOM: the ``rr`` flag of its area in /proc/self/smaps."""
    address = np.frombuffer(mapping, np.uint8).__array_interface__["data"][0]
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return "rr" in line.split()[1:]
    raise AssertionError(f"no area of /proc/self/smaps holds address {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="the advice is read from Linux's /proc/self/smaps")
def test_map_file_advises_random_reads_unless_asked_not_to(tmp_path):
    """A mapping for random rows reads no page ahead (MADV_RANDOM); one for rows read in order (random=False, what an
    export's reader asks for) leaves the kernel's readahead on: the same on both paths, and the same bytes."""
    data = np.random.default_rng(0).integers(0, 256, 5 * 4096 + 100, np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    with open(tmp_path / "f", "rb") as f:
        for path in PATHS:
            for args, advised in (((), True), ((True,), True), ((False,), False), ((0,), False), ((1,), True)):
                m = path.map_file(f.fileno(), 4097, 3 * 4096, *args)
                assert bytes(memoryview(m)) == data[4097 : 4097 + 3 * 4096]
                assert _advised_random(m) is advised, (path.__name__, args)
                del m


def test_pure_take_rows_reads_no_repr_of_its_source(tmp_path):
    """The pure gather knows a mapped file's end from its own Mapping alone: a Python mmap (whose repr says where it
    starts in its file) is read as any buffer, whatever its repr says, and the same rows come out as from the
    compiled gather."""

    class Told(mmap.mmap):
        def __repr__(self) -> str:
            return "<mmap.mmap closed=False, access=ACCESS_READ, length=8192, pos=0, offset=1048576>"

    body = np.arange(2 * 4096, dtype=np.uint64).astype(np.uint8).tobytes()
    (tmp_path / "f").write_bytes(body)
    rows = np.array([0, 7, 3, 15], np.int64)
    with open(tmp_path / "f", "rb") as f:
        src = Told(f.fileno(), len(body), access=mmap.ACCESS_READ)
        outs = [np.zeros((4, 512), np.uint8) for _ in PATHS]
        answers = [path.take_rows(src, rows, 0, 0, out, 512) for path, out in zip(PATHS, outs)]
        del src
    assert answers == [(-1, 0), (-1, 0)]
    for out in outs:
        np.testing.assert_array_equal(out, np.frombuffer(body, np.uint8).reshape(16, 512)[rows])


def test_a_pure_mapping_is_a_buffer_that_compares_as_the_compiled_one(tmp_path):
    """Not element by element: ``None in maps`` (the reader's test) and ``==`` are about the object."""
    (tmp_path / "f").write_bytes(bytes(range(256)) * 40)
    with open(tmp_path / "f", "rb") as f:
        for path in PATHS:
            m, other = path.map_file(f.fileno(), 5, 100), path.map_file(f.fileno(), 5, 100)
            assert None not in (m, other) and (m == other) is False and (m != other) is True and len({m, other}) == 2
            assert "Mapping" in repr(m) and np.frombuffer(m, np.uint8)[0] == 5


# -- arguments -------------------------------------------------------------------------------------------------------


def test_the_decoders_refuse_the_same_arguments(tmp_path):
    rows = np.random.default_rng(0).integers(0, 9, (3, 192), np.uint8)
    encoded = frames.encode_lz4(rows, 192, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    offsets = np.cumsum(nbytes) - nbytes
    blob = b"".join(encoded)
    (tmp_path / "f").write_bytes(blob)
    out, dst, slots = np.empty((3, 192), np.uint8), np.arange(3, dtype=np.int64), np.zeros(3, np.int32)
    ro = out.copy()
    ro.flags.writeable = False
    strided = np.empty((3, 3, 8, 16), np.uint8)[..., ::2]
    common = [  # (offsets, nbytes, out, row_nbytes)
        (offsets, nbytes, out[:2], 192), (offsets[:2], nbytes, out, 192), (offsets.astype(np.int32), nbytes, out, 192),
        (offsets.tobytes()[:-1], nbytes, out, 192), (offsets, nbytes, out, 0), (offsets, nbytes, out, -192),
        (offsets, nbytes, out, 1 << 40), (offsets, nbytes, bytes(out), 192), (offsets, nbytes, ro, 192),
        (offsets, nbytes, strided, 192), (offsets, nbytes, out, 2**63), (offsets, nbytes, out, "192"),
        (offsets[::2], nbytes, out, 192), (list(offsets), nbytes, out, 192), (offsets, nbytes, out, 192),
    ]
    with open(tmp_path / "f", "rb") as f:
        fds = np.full(3, f.fileno(), np.int32)
        calls: list[tuple[str, tuple]] = []
        for o, nb, ou, rn in common:
            calls += [("decode_lz4", (blob, o, nb, ou, rn)), ("decode_lz4", (None, o, nb, ou, rn))]
            calls += [("pread_lz4", (fds, o, nb, dst, ou, rn)), ("pread_lz4", (fds[:2], o, nb, dst, ou, rn))]
            for name in ("map_lz4", "map_lz4_start"):
                calls += [(name, ((blob,), slots, o, nb, dst, ou, rn)), (name, ([blob], slots, o, nb, dst, ou, rn))]
        for d in (dst + 1, dst - 1, dst[:2], dst.astype(np.int32)):
            calls.append(("pread_lz4", (fds, offsets, nbytes, d, out, 192)))
            calls += [(name, ((blob,), slots, offsets, nbytes, d, out, 192)) for name in ("map_lz4", "map_lz4_start")]
        for s in (slots + 1, slots - 1, slots[:2], slots.astype(np.int64)):
            calls += [(name, ((blob,), s, offsets, nbytes, dst, out, 192)) for name in ("map_lz4", "map_lz4_start")]
        calls += [(name, ((blob, 3), slots, offsets, nbytes, dst, out, 192)) for name in ("map_lz4", "map_lz4_start")]
        calls += [(n, ((blob, strided), slots, offsets, nbytes, dst, out, 192)) for n in ("map_lz4", "map_lz4_start")]
        for threads in (0, 65, "2", 2**70):
            calls.append(("map_lz4_start", ((blob,), slots, offsets, nbytes, dst, out, 192, threads)))
        calls.append(("map_lz4_start", ((blob,), slots, offsets, nbytes, dst, out[:1], 192, 0)))  # threads first
        for name, args in calls:
            (a, _), (b, _) = _both(name, args)
            if a[0] == b[0] == "ok":
                a, b = (("ok", x[1].wait()[:2] if name == "map_lz4_start" else x[1][:2]) for x in (a, b))
            assert a == b, (name, args, a, b)


def test_take_rows_refuses_the_same_arguments(tmp_path):
    src = np.arange(1000, dtype=np.uint8).tobytes()
    rows, out = np.array([101, 102], np.int64), np.zeros((5, 10), np.uint8)
    for args in (
        (src, rows.astype(np.int32)[:1], 100, 0, out, 10), (src, rows, 100, -1, out, 10),
        (src, rows, 100, len(src) + 1, out, 10), (src, rows, 100, 0, out, 0), (src, rows, 100, 0, out[:1], 10),
        (src, rows, 100, 0, out, 10, np.array([0], np.int64)), (src, rows, 100, 0, bytes(out), 10),
        (src, rows, 100, 0, out, 10, None), ("src", rows, 100, 0, out, 10), (src, rows, 1.0, 0, out, 10),
        (src, rows, 2**63, 0, out, 10), (src, rows, 100, 0, out, 10, np.array([4, 4], np.int64)),
        (src, rows, 100, len(src), out, 10), (src, np.zeros(0, np.int64), 0, 0, np.zeros(0, np.uint8), 10),
    ):
        (a, _), (b, _) = _both("take_rows", args)
        assert a == b, (args, a, b)


# -- tasks -----------------------------------------------------------------------------------------------------------


def _lz4_task_args(n: int, seed: int) -> tuple[np.ndarray, bytearray, tuple]:
    rows = np.random.default_rng(seed).integers(0, 9, (n, 3, 8, 8), np.uint8)
    encoded = frames.encode_lz4(rows, 192, 1)
    nbytes = np.array([len(f) for f in encoded], np.int64)
    blob = bytearray(b"".join(encoded))
    return rows, blob, (np.zeros(n, np.int32), np.cumsum(nbytes) - nbytes, nbytes, np.arange(n, dtype=np.int64))


@pytest.mark.parametrize("path", PATHS, ids=["compiled", "pure"])
def test_a_task_holds_its_buffers_until_waited_for_or_dropped_and_answers_every_wait(path):
    rows, blob, (slots, offsets, nbytes, dst) = _lz4_task_args(2_000, 3)
    for threads in (1, 3):
        out = np.zeros_like(rows)
        task = path.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, 192, threads)
        with pytest.raises(BufferError):  # the task holds the source: it cannot change size under its threads
            blob += b"x"
        assert task.wait() == (-1, 0, 0) and task.done() and task.wait() == (-1, 0, 0)
        np.testing.assert_array_equal(out, rows)
        blob += b"x"  # waited for: the source is let go
        out = np.zeros_like(rows)
        task = path.map_lz4_start((blob,), slots, offsets, nbytes, dst, out, 192, threads)
        del task  # dropped unwaited: its threads end first, and the source goes
        blob += b"x"
        np.testing.assert_array_equal(out, rows)
        task = path.encode_lz4_start(rows, 192, 1, threads)
        answers: list[list[bytes]] = []
        waiting = [threading.Thread(target=lambda t=task, a=answers: a.append(t.wait())) for _ in range(2)]
        for t in waiting:
            t.start()
        for t in waiting:
            t.join(timeout=60)
        assert answers == [frames.encode_lz4(rows, 192, 1)] * 2 and task.done()


@pytest.mark.parametrize("path", PATHS, ids=["compiled", "pure"])
@pytest.mark.parametrize("waiting", [False, True])
def test_a_task_waited_for_in_a_forked_child_never_says_undone_rows_are_done(path, waiting):
    """A forked child has none of the task's threads: its wait() gives every row, or says rows may be missing (a row
    failing with ESRCH, a RuntimeError), also when another thread of the parent was inside wait() at the fork."""
    rows, blob, (slots, offsets, nbytes, dst) = _lz4_task_args(30_000, 6)
    want = frames.encode_lz4(rows, 192, 1)
    out = np.zeros_like(rows)
    decoding = path.map_lz4_start((bytes(blob),), slots, offsets, nbytes, dst, out, 192, 2)
    encoding = path.encode_lz4_start(rows, 192, 1, 2)
    waiters = [threading.Thread(target=t.wait) for t in (decoding, encoding)]
    if waiting:
        for w in waiters:
            w.start()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when each answer is true, 1 otherwise; a hang is killed
        signal.alarm(30)
        failed, err, _ = decoding.wait()
        ok = (failed == -1 and err == 0 and bool((out == rows).all())) or (failed == 0 and err == errno.ESRCH)
        try:
            ok = ok and encoding.wait() == want
        except RuntimeError as e:
            ok = ok and "threads are gone" in str(e)
        os._exit(0 if ok and decoding.done() and encoding.done() else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert decoding.wait() == (-1, 0, 0) and encoding.wait() == want
    np.testing.assert_array_equal(out, rows)
    if waiting:
        for w in waiters:
            w.join()


def test_the_kernels_in_use_are_the_compiled_ones_unless_told_otherwise():
    """her_store._kernels chooses: the compiled kernels where built, the pure ones under HER_STORE_PURE=1."""
    import subprocess
    import sys

    code = (
        "from her_store import _kernels; from her_store._kernels import _frames; "
        "print(_kernels.COMPILED, _kernels.map_lz4 is _frames.map_lz4)"
    )
    for pure_env, said in (("0", b"True True"), ("1", b"False False"), (None, b"True True")):
        env = {k: v for k, v in os.environ.items() if k != "HER_STORE_PURE"}
        if pure_env is not None:
            env["HER_STORE_PURE"] = pure_env
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=False, timeout=120)
        assert done.stdout.strip() == said, done.stderr[-2000:]
    assert _kernels.COMPILED == (os.environ.get("HER_STORE_PURE") != "1")
