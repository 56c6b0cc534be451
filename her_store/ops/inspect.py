"""What a store holds, for people and machines: the ``her-store inspect`` and ``her-store card`` commands.

:func:`summary` gathers a store's format, spaces, fields (dtype, shape, bytes on disk, compression ratio), episodes,
capacity and evictions, statistics of length, return and success (vectorised over the index columns) and its dataset
card, as plain JSON values; :func:`episode_page` lists index rows of an episode selection a page at a time. Both
read only the root attributes, the commit record, the index and a listing of file sizes: never a data row, so a
store of a million episodes is inspected in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

from her_store.format.card import CARD_FIELDS, card_problems, json_object, parse_assignment
from her_store.format.keys import chunk_of
from her_store.format.layout import ArraySpec, index_columns
from her_store.ops.selection import parse_selection
from her_store.store.episode_store import EpisodeStore

__all__ = ["add_arguments", "array_bytes", "episode_page", "print_summary", "print_table", "run", "summary"]

PAGE_SIZE = 50
INDEX_DIR = "episodes"
_SHOWN_CHARS = 200  # a card value longer than this is cut in tables (a store's card may hold anything)
_EPISODE_COLUMNS = (
    "episode_id", "start_row", "length", "return", "success", "terminated", "truncated", "env_index", "created_at",
    "crc32",
)


def _plain(value: Any) -> Any:
    """``value`` as plain JSON: numpy scalars and arrays become Python ones, non-finite floats null."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def array_bytes(store: EpisodeStore, *, on_disk: bool = False) -> dict[str, dict[int, int]] | None:
    """Sizes of the chunk (or shard) files of every array, by array path and row-chunk number: apparent sizes (what
    ``ls -l`` shows, the holes of an uncompressed array's chunk files counted), or with ``on_disk`` the bytes
    allocated for them (what ``du`` shows, holes not counted).

    Local stores list each array's directory (``os.scandir``, no file is opened); a packed store reads its members'
    sizes from the zip's directory; object storage lists the store once (fsspec ``du``), and its objects hold every
    byte of their size. Returns None over HTTP, which has no listing (only a server's HTML index pages, one request
    per directory), and where the filesystem cannot list.

    Examples
    --------
    >>> sizes = array_bytes(store)  # doctest: +SKIP
    >>> sum(sizes["packs/float32"].values())  # doctest: +SKIP
    25165824
    """
    sizes = _chunk_sizes(store)
    if sizes is None:
        return None
    return {path: {c: pair[on_disk] for c, pair in chunks.items()} for path, chunks in sizes.items()}


def _chunk_sizes(store: EpisodeStore) -> dict[str, dict[int, tuple[int, int]]] | None:
    """(apparent size, bytes on disk) of the chunk files of every array, by array path and row-chunk number, as
    :func:`array_bytes` gives them; None where the store cannot be listed (over HTTP)."""
    backend = store.backend
    if not backend.lists:
        return None
    keys = {spec.path: (spec.separator, 1 + len(spec.row_shape)) for spec in store.layout.arrays}
    keys.update({f"{INDEX_DIR}/{name}": ("/", 1) for name in index_columns(store.layout.version)})
    out: dict[str, dict[int, tuple[int, int]]] = {p: {} for p in keys}
    try:
        usage = backend.disk_usage()
    except (NotImplementedError, OSError, ValueError):
        return None
    _add_keys(usage.items(), keys, out)
    return out


def _add_keys(
    listed: Iterable[tuple[str, tuple[int, int]]], keys: Mapping[str, tuple[str, int]],
    out: dict[str, dict[int, tuple[int, int]]],
) -> None:
    """Add the sizes of store keys ``<array>/c/<i>/...`` (or ``<array>/c.<i>.0...``, by the array's separator and
    number of axes ``keys[array]``) to ``out[array][i]``."""
    prefixes = [(f"{a}/c/" if sep == "/" else f"{a}/", a, sep, ndim) for a, (sep, ndim) in keys.items()]
    for key, size in listed:
        for prefix, array, sep, ndim in prefixes:
            if key.startswith(prefix):
                rest = key[len(prefix) :]
                chunk = chunk_of(rest.split("/", 1)[0], "/") if sep == "/" else chunk_of(rest, ".", ndim)
                if chunk is not None:
                    _add_size(out[array], chunk, size)
                    break


def _add_size(sizes: dict[int, tuple[int, int]], chunk: int, size: tuple[int, int]) -> None:
    old = sizes.get(chunk, (0, 0))
    sizes[chunk] = (old[0] + int(size[0]), old[1] + int(size[1]))


def _file_sizes(entry: os.DirEntry[str]) -> tuple[int, int]:
    """(apparent size, bytes allocated) of a file: what ``ls -l`` and ``du`` show."""
    st = entry.stat(follow_symlinks=False)
    return st.st_size, st.st_blocks * 512


def _totals(chunks: Mapping[Any, tuple[int, int]] | None) -> tuple[int | None, int | None]:
    """(apparent size, bytes on disk) of an array's chunk files, None where unknown."""
    if chunks is None:
        return None, None
    return sum(a for a, _ in chunks.values()), sum(d for _, d in chunks.values())


def _covered_bytes(spec: ArraySpec, chunks: Mapping[int, tuple[int, int]], extent: int) -> int:
    """Uncompressed bytes of the rows the chunk files of a compressed array hold: whole chunks for an unsharded
    array (zarr writes a chunk whole), the rows below ``extent`` (the rows ever written) for a shard, which stores
    only its written rows."""
    if not spec.sharded:
        return len(chunks) * spec.chunk_rows * spec.row_nbytes
    rows = sum(min(spec.chunk_rows, max(0, extent - i * spec.chunk_rows)) for i in chunks)
    return rows * spec.row_nbytes


def _stats(x: np.ndarray) -> dict[str, float | None]:
    if not len(x):
        return {"mean": None, "std": None, "min": None, "median": None, "max": None}
    x = x.astype(np.float64, copy=False)
    return {"mean": float(x.mean()), "std": float(x.std()), "min": float(x.min()), "median": float(np.median(x)),
            "max": float(x.max())}


def summary(store: EpisodeStore, *, sizes: bool = True) -> dict[str, Any]:
    """Everything ``her-store inspect`` shows, as plain JSON values (no NaN: an unknown figure is None).

    Parameters
    ----------
    store : EpisodeStore
        An open store (any mode).
    sizes : bool
        List the store's files for their sizes and compression ratios (one directory listing per array locally,
        one listing of the store on object storage). False leaves them None.

    Returns
    -------
    dict
        ``location``, ``format_version``, ``spaces``, ``fields`` (name, dtype, shape, per_step, array,
        bytes_on_disk, apparent_bytes, compression_ratio), ``arrays``, ``index_bytes``, ``index_apparent_bytes``,
        ``bytes_on_disk``, ``apparent_bytes``, ``episodes``, ``transitions``, ``first_episode``, ``end_episode``,
        ``capacity``, ``evicted``, ``fill``, ``commit``, ``statistics`` (length, return, success, terminated,
        truncated) and ``card`` with ``card_warnings``. ``*bytes_on_disk`` and ``index_bytes`` are the bytes the
        files take (allocated: holes not counted, as ``du`` shows), ``*apparent_bytes`` their sizes (holes counted,
        as ``ls -l`` shows: an uncompressed array's chunk files are full-size from their first row on local disk);
        on object storage, where an object holds every byte of its size, the two are equal. A compression ratio is
        the rows' bytes over the apparent size of the files holding them.

    Examples
    --------
    >>> s = summary(EpisodeStore.open("runs/fetch"))  # doctest: +SKIP
    >>> s["episodes"], s["statistics"]["success"]["rate"]  # doctest: +SKIP
    (1000000, 0.41)
    """
    table = store.episodes
    commit = store.commit_record
    first, end = store.first_episode, store.end_episode
    lengths = table["length"]
    extent = max(commit.write_row, int((table["start_row"] + lengths).max()) + 1 if len(lengths) else 0)
    files = _chunk_sizes(store) if sizes else None
    arrays = []
    for spec in store.layout.arrays:
        chunks = files[spec.path] if files is not None else None
        apparent, disk = _totals(chunks)
        raw = _covered_bytes(spec, chunks, extent) if chunks is not None and spec.compressed else apparent
        arrays.append({
            "path": spec.path, "dtype": spec.dtype.name, "row_shape": list(spec.row_shape),
            "chunk_rows": spec.chunk_rows, "sharded": spec.sharded, "compressed": spec.compressed,
            "fields": [name for name, _, _ in spec.columns], "chunk_files": None if chunks is None else len(chunks),
            "bytes_on_disk": disk, "apparent_bytes": apparent,
            "compression_ratio": raw / apparent if apparent and raw is not None else None,
        })
    by_path = {a["path"]: a for a in arrays}
    fields = []
    for f in store.schema.fields:
        spec, lo, hi = store.layout.fields[f.name]
        a = by_path[spec.path]
        share = (hi - lo) / spec.row_shape[0] if spec.is_pack else 1.0  # a pack's bytes split by column width
        fields.append({
            "name": f.name, "dtype": f.dtype.name, "shape": list(f.shape), "per_step": f.per_step, "role": f.role,
            "array": spec.path,
            "bytes_on_disk": None if a["bytes_on_disk"] is None else round(a["bytes_on_disk"] * share),
            "apparent_bytes": None if a["apparent_bytes"] is None else round(a["apparent_bytes"] * share),
            "compression_ratio": a["compression_ratio"],
        })
    index = None if files is None else {
        (k, c): pair for k, v in files.items() if k.startswith(f"{INDEX_DIR}/") for c, pair in v.items()
    }
    index_apparent, index_bytes = _totals(index)
    disk_total = None if files is None else index_bytes + sum(a["bytes_on_disk"] for a in arrays)
    apparent_total = None if files is None else index_apparent + sum(a["apparent_bytes"] for a in arrays)
    success = table["success"]
    known = success >= 0
    card = store.metadata
    transitions = store.num_transitions
    return _plain({
        "location": store.url,
        "format_version": store.layout.version,
        "spaces": {
            "observation": {k: str(s) for k, s in store.observation_space.spaces.items()},
            "action": str(store.action_space),
            "info_keys": list(store.info_keys),
        },
        "fields": fields,
        "arrays": arrays,
        "index_bytes": index_bytes,
        "index_apparent_bytes": index_apparent,
        "bytes_on_disk": disk_total,
        "apparent_bytes": apparent_total,
        "episodes": end - first,
        "transitions": transitions,
        "first_episode": first,
        "end_episode": end,
        "capacity": store.capacity,
        "evicted": first,  # ids are consecutive from 0 and only the ring moves the first live one
        "fill": None if store.capacity is None else transitions / store.capacity,
        "commit": {"generation": commit.generation, "write_row": commit.write_row, "array_rows": commit.array_rows},
        "statistics": {
            "length": _stats(lengths),
            "return": _stats(table["return"]),
            "success": {"known": int(known.sum()), "succeeded": int((success == 1).sum()),
                        "rate": float(success[known].mean()) if known.any() else None},
            "terminated": int(table["terminated"].sum()),
            "truncated": int(table["truncated"].sum()),
        },
        "card": card,
        "card_warnings": card_problems(card),
    })


def episode_page(store: EpisodeStore, selection: str | None = None, page: int = 1,
                 page_size: int = PAGE_SIZE) -> dict[str, Any]:
    """One page of the index rows of an episode selection, as plain JSON values.

    Parameters
    ----------
    store : EpisodeStore
        An open store.
    selection : str, optional
        As :func:`her_store.ops.selection.parse_selection` reads it (``"0:100,250,-10:"``); None selects every live
        episode.
    page, page_size : int
        Pages count from 1; a page holds ``page_size`` rows.

    Returns
    -------
    dict
        ``selection``, ``total`` (episodes selected), ``page``, ``pages``, ``page_size`` and ``rows`` (one dict of
        the index columns per episode).

    Examples
    --------
    >>> episode_page(store, "-2:")["rows"][-1]["episode_id"] == store.end_episode - 1  # doctest: +SKIP
    True
    """
    if page < 1 or page_size < 1:
        raise ValueError(f"--page and --page-size count from 1, got page {page}, page size {page_size}")
    table = store.episodes
    first, end = store.first_episode, store.end_episode
    ids = parse_selection(selection, first, end)
    pages = max(1, -(-len(ids) // page_size))
    if page > pages:
        raise ValueError(f"page {page} is past the last page {pages} ({len(ids):,} episodes, {page_size} a page)")
    rows = ids[(page - 1) * page_size : page * page_size] - first
    columns = {name: table[name][rows].tolist() for name in _EPISODE_COLUMNS}
    return _plain({
        "selection": selection or "",
        "total": len(ids),
        "page": page,
        "pages": pages,
        "page_size": page_size,
        "rows": [dict(zip(columns, values)) for values in zip(*columns.values())],
    })


# -- rendering ------------------------------------------------------------------------------------------------
Section = tuple[str, Sequence[str] | None, list[Sequence[str]]]  # title, column headers (None: key/value), rows


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError


def _num(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _shown(value: Any) -> str:
    """A card value (or key) for a table: control characters escaped as JSON does (a card may hold terminal escape
    sequences), cut at a few hundred characters."""
    text = value if isinstance(value, str) and value.isprintable() else json.dumps(value, allow_nan=True)
    if len(text) > _SHOWN_CHARS:
        return f"{text[:_SHOWN_CHARS]}... ({len(text):,} characters)"
    return text


def _summary_sections(s: Mapping[str, Any]) -> tuple[list[Section], list[str]]:
    cap = s["capacity"]
    if cap is None:
        capacity = "unbounded"
    else:
        capacity = f"{cap:,} transitions ({s['fill']:.1%} full), {s['evicted']:,} episodes evicted"
    c = s["commit"]
    overview: list[Sequence[str]] = [
        ("location", s["location"]),
        ("format", f"version {s['format_version']}"),
        (
            "episodes",
            f"{s['episodes']:,}"
            + (f" (ids {s['first_episode']:,}..{s['end_episode'] - 1:,})" if s["episodes"] else ""),
        ),
        ("transitions", f"{s['transitions']:,}"),
        ("capacity", capacity),
        ("commit", f"generation {c['generation']:,}, next row {c['write_row']:,} of {c['array_rows']:,}"),
        ("bytes on disk", f"{_size(s['bytes_on_disk'])} (index {_size(s['index_bytes'])})"),
        ("apparent size", f"{_size(s['apparent_bytes'])} (the files' sizes, unwritten rows of chunk files counted)"),
    ]
    spaces: list[Sequence[str]] = [(f"observation.{k}", v) for k, v in s["spaces"]["observation"].items()]
    spaces.append(("action", s["spaces"]["action"]))
    spaces.append(("info keys", ", ".join(s["spaces"]["info_keys"]) or "-"))
    fields = [
        (f["name"], f["dtype"], str(tuple(f["shape"])), "T" if f["per_step"] else "T+1", f["array"],
         _size(f["bytes_on_disk"]), "-" if f["compression_ratio"] is None else f"{f['compression_ratio']:.2f}x")
        for f in s["fields"]
    ]
    st = s["statistics"]
    stats = [
        (name, _num(v["mean"]), _num(v["std"]), _num(v["min"]), _num(v["median"]), _num(v["max"]))
        for name, v in (("length", st["length"]), ("return", st["return"]))
    ]
    sc = st["success"]
    outcome: list[Sequence[str]] = [
        (
            "success rate",
            "-" if sc["rate"] is None else f"{sc['rate']:.1%} of {sc['known']:,} episodes with is_success",
        ),
        ("terminated", f"{st['terminated']:,}"),
        ("truncated", f"{st['truncated']:,}"),
    ]
    card: list[Sequence[str]] = [(_shown(k), _shown(v)) for k, v in s["card"].items()]
    sections: list[Section] = [
        ("store", None, overview),
        ("spaces", None, spaces),
        ("fields", ("field", "dtype", "shape", "rows", "array", "on disk", "ratio"), fields),
        ("episodes", ("", "mean", "std", "min", "median", "max"), stats),
        ("outcomes", None, outcome),
        ("dataset card", None, card or [("(empty)", "set fields with: her-store card STORE --set key=value")]),
    ]
    return sections, [_shown(w) for w in s["card_warnings"]]


def print_summary(s: Mapping[str, Any], out: TextIO | None = None) -> None:
    """Print a :func:`summary` as ``her-store inspect`` does: rich tables on a terminal (when rich is installed),
    plain aligned text otherwise, then a warning line for each odd field of the dataset card.

    Examples
    --------
    >>> print_summary(summary(store))  # doctest: +SKIP
    """
    out = sys.stdout if out is None else out
    _render(*_summary_sections(s), out, out.isatty())


def print_table(title: str, rows: list[tuple[str, str]], out: TextIO | None = None) -> None:
    """Print key-value rows under a title the way :func:`print_summary` prints its sections (a rich table on a
    terminal, plain aligned text otherwise).

    Examples
    --------
    >>> print_table("run", [("steps", "5,000"), ("success", "100 %")])
    run
      steps    5,000
      success  100 %
    """
    out = sys.stdout if out is None else out
    _render([(title, None, [tuple(map(str, r)) for r in rows])], [], out, out.isatty())


def _page_section(p: Mapping[str, Any]) -> Section:
    rows = [
        (f"{r['episode_id']}", f"{r['start_row']}", f"{r['length']}", f"{_num(r['return'])}",
         {1: "yes", 0: "no"}.get(r["success"], "-"), "yes" if r["terminated"] else "no",
         "yes" if r["truncated"] else "no", f"{r['env_index']}",
         "-" if r["created_at"] is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["created_at"])),
         f"{r['crc32']:08x}")
        for r in p["rows"]
    ]
    title = f"episodes {p['selection'] or 'all'}: page {p['page']} of {p['pages']} ({p['total']:,} episodes)"
    headers = ("id", "start row", "length", "return", "success", "terminated", "truncated", "env", "created (UTC)",
               "crc32")
    return title, headers, rows


def _render(sections: list[Section], warnings: list[str], out: TextIO, rich: bool) -> None:
    """Rich tables in a terminal (when rich is installed), else plain aligned text."""
    if rich:
        try:
            from rich.console import Console
            from rich.table import Table
            from rich.text import Text
        except ImportError:
            rich = False
    if rich:
        console = Console(file=out)
        for title, headers, rows in sections:
            # cells are Text, never markup: a card's "[...]" is shown as written
            table = Table(title=Text(title), show_header=headers is not None, title_justify="left")
            for h in headers or ("", ""):
                table.add_column(Text(h), overflow="fold")
            for row in rows:
                table.add_row(*(Text(cell) for cell in row))
            console.print(table)
        for w in warnings:
            console.print(Text.assemble(("warning: ", "yellow"), w))
        return
    for title, headers, rows in sections:
        print(title, file=out)
        body = [list(headers)] + [list(r) for r in rows] if headers else [list(r) for r in rows]
        widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))] if body else []
        for r in body:
            print("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip(), file=out)
    for w in warnings:
        print(f"warning: {w}", file=out)


# -- the commands ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Declare the arguments of ``her-store inspect`` or ``her-store card`` (``name``).

    Examples
    --------
    >>> p = argparse.ArgumentParser(); add_arguments(p, "inspect")
    >>> p.parse_args(["runs/fetch", "--episodes=-10:"]).episodes  # "=": argparse reads "-10:" alone as an option
    '-10:'
    """
    parser.add_argument("store", help="store path or URL (s3://bucket/name, https://host/name, ...)")
    parser.add_argument("--storage-options", type=json_object, default=None, metavar="JSON",
                        help="fsspec options for a URL, e.g. '{\"anon\": true}'")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    if name == "inspect":
        parser.add_argument("--episodes", nargs="?", const="", default=None, metavar="SELECTION",
                            help="list index rows instead: all, or a selection such as '0:100,250' (one that starts "
                                 "with '-' is written --episodes=-10:)")
        parser.add_argument("--page", type=int, default=None,
                            help="page of --episodes to show, from 1 (default 1; alone, it lists every episode)")
        parser.add_argument("--page-size", type=int, default=None, help=f"rows a page (default {PAGE_SIZE})")
        parser.add_argument("--no-sizes", action="store_true", help="skip listing files (bytes on disk, ratios)")
        return
    keys = ", ".join(CARD_FIELDS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help=f"set a field (the value is read as JSON when it is JSON, else a string); KEY= removes "
                             f"it. Fields: {keys}. The card is checked, then written atomically under the writer lock")


def run(args: argparse.Namespace) -> int:
    """Run ``her-store inspect`` or ``her-store card``; returns the exit status (0).

    Examples
    --------
    >>> run(argparse.Namespace(command="card", store="runs/fetch", set=["license=CC-BY-4.0"],
    ...                        storage_options=None, json=False))  # doctest: +SKIP
    0
    """
    rich = sys.stdout.isatty() and not args.json
    if args.command == "card":
        return _run_card(args, rich)
    with EpisodeStore.open(args.store, storage_options=args.storage_options) as store:
        paged = args.page is not None or args.page_size is not None
        if args.episodes is not None or paged:  # a page asked for alone is a page of every episode
            page = episode_page(store, args.episodes, 1 if args.page is None else args.page,
                                PAGE_SIZE if args.page_size is None else args.page_size)
            if args.json:
                print(json.dumps(page, allow_nan=False))
            else:
                _render([_page_section(page)], [], sys.stdout, rich)
            return 0
        s = summary(store, sizes=not args.no_sizes)
    if args.json:
        print(json.dumps(s, allow_nan=False))
    else:
        print_summary(s)
    return 0


def _run_card(args: argparse.Namespace, rich: bool) -> int:
    if args.set:
        entries = dict(parse_assignment(a) for a in args.set)
        # mode="a": the writer lock is held while zarr.json is replaced; fsync, since nothing else makes it last
        with EpisodeStore.open(args.store, mode="a", storage_options=args.storage_options, durability="fsync") as store:
            store.update_metadata(**entries)
            card = store.metadata
    else:
        with EpisodeStore.open(args.store, storage_options=args.storage_options) as store:
            card = store.metadata
    if args.json:
        print(json.dumps(_plain(card), allow_nan=False))
        return 0
    rows: list[Sequence[str]] = [(_shown(k), _shown(v)) for k, v in card.items()]
    _render([(f"dataset card of {args.store}", None, rows or [("(empty)", "")])],
            [_shown(w) for w in card_problems(card)], sys.stdout, rich)
    return 0
