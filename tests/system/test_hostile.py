"""Stores someone else made: crafted attributes, commit records and array metadata give her_store errors only, in
bounded memory, without touching a file outside the store."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import struct
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import zarr
from gymnasium import spaces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from her_store import EpisodeStore, HerSampler, open_store
from her_store.errors import CorruptStoreError, NotAStoreError, SchemaMismatchError, StoreError
from her_store.format.layout import FORMAT_VERSION, INDEX_COLUMNS
from her_store.format.schema import MAX_ROW_BYTES, space_from_json
from her_store.store import frame_rows as reader_module
from tests.conftest import DATA, make_episode

GOAL = spaces.Box(-1, 1, (3,), np.float32)
OBS = spaces.Dict(
    {
        "observation": spaces.Box(-np.inf, np.inf, (5,), np.float32),
        "achieved_goal": GOAL,
        "desired_goal": GOAL,
        "pixels": spaces.Box(0, 255, (3, 4, 4), np.uint8),  # an image: compressed, in its own array
    }
)
ACT = spaces.Box(-1, 1, (2,), np.float32)
# Address space a hostile store may make the process take on top of what it holds already (room for the thread
# stacks and malloc arenas zarr's I/O threads may reserve): a crafted count that reached an allocation (the
# 10**9-episode index alone is 7.5 GiB per column) fails under it with MemoryError.
MEMORY_HEADROOM = 2 << 30


def reward_fn(achieved, desired, infos):
    return -(np.linalg.norm(np.asarray(achieved) - np.asarray(desired), axis=-1) > 0.05).astype(np.float32)


def _build(path: Path, capacity: int | None, lengths: list[int]) -> None:
    with EpisodeStore.create(path, OBS, ACT, capacity=capacity, chunk_rows=16, info_keys=["is_success"]) as store:
        for i, T in enumerate(lengths):
            store.append_episode(make_episode(OBS, ACT, T, seed=i, info_keys=("is_success",)))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    """Pristine small stores: unbounded, and a ring that has wrapped and evicted."""
    root = tmp_path_factory.mktemp("bases")
    _build(root / "unbounded", None, [3, 5, 2, 4])
    _build(root / "ring", 12, [3, 5, 2, 4, 5, 3, 4])
    return {"unbounded": root / "unbounded", "ring": root / "ring"}


@pytest.fixture
def store(bases, tmp_path) -> Path:
    """A copy of the unbounded base store in a directory of its own (siblings are outside the store)."""
    path = tmp_path / "case" / "store"
    shutil.copytree(bases["unbounded"], path)
    return path


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _edit_attrs(store: Path, edit) -> None:
    _edit_json(store / "zarr.json", lambda d: edit(d["attributes"]["her_store"]))


def _write_commit(store: Path, body: dict[str, Any]) -> None:
    """A commit record with a valid crc32 over whatever the body holds."""
    body = {k: v for k, v in body.items() if k != "crc32"}
    body["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
    (store / "commit.json").write_text(json.dumps(body, sort_keys=True))


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@contextlib.contextmanager
def bounded_memory() -> Iterator[None]:
    """Cap the process's address space at what it maps now plus MEMORY_HEADROOM (restored on exit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (limit if soft == resource.RLIM_INFINITY else min(limit, soft), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _use(path: Path, mode: str) -> None:
    """What a user does with a store: read every episode, refresh, sample HER batches, append (mode 'a')."""
    with EpisodeStore.open(path, mode) as store:
        for i in range(store.first_episode, store.end_episode):
            store.episode(i)
        store.refresh()
        if store.num_transitions:
            with HerSampler(store, 16, reward_fn=reward_fn, n_sampled_goal=4, seed=0) as sampler:
                sampler.sample()
        if mode == "a":
            store.append_episode(make_episode(OBS, ACT, 3, seed=99, info_keys=("is_success",)))


def _tree_state(root: Path, skip: Path) -> list[tuple[str, bytes | None]]:
    return sorted(
        (str(p.relative_to(root)), p.read_bytes() if p.is_file() else None)
        for p in root.rglob("*")
        if skip not in (p, *p.parents)
    )


# -- defect 7: each crash of a crafted store, now an error naming the file and the value ----------------------------
def test_index_slots_zero(bases, tmp_path):
    path = tmp_path / "ring"
    shutil.copytree(bases["ring"], path)
    _edit_attrs(path, lambda a: a.update(index_slots=0))
    with pytest.raises(CorruptStoreError, match=r"zarr\.json: her_store\.index_slots is 0"):
        EpisodeStore.open(path)


def test_capacity_as_a_string(bases, tmp_path):
    path = tmp_path / "ring"
    shutil.copytree(bases["ring"], path)
    _edit_attrs(path, lambda a: a.update(capacity="12"))
    with pytest.raises(CorruptStoreError, match=r"zarr\.json: her_store\.capacity is '12'"):
        _use(path, "a")


@pytest.mark.parametrize("end", [1e9, 10**9])
def test_a_commit_record_claiming_a_billion_episodes(store, end):
    body = json.loads((store / "commit.json").read_text())
    body["end_episode"] = end
    _write_commit(store, body)
    with bounded_memory(), pytest.raises(CorruptStoreError, match=r"commit\.json.*(1e\+?0?9|1000000000)"):
        EpisodeStore.open(store)


def _claim_a_billion_episodes(store: Path) -> None:
    """A commit record of 10**9 episodes with a valid crc32, and array metadata sized to agree with it."""
    n = 10**9
    for name in INDEX_COLUMNS:
        _edit_json(store / "episodes" / name / "zarr.json", lambda d: d["shape"].__setitem__(0, n))
    for array in ("packs/float32", "packs/bool", "steps/pixels"):
        _edit_json(store / array / "zarr.json", lambda d: d["shape"].__setitem__(0, 4 * n))
    body = json.loads((store / "commit.json").read_text())
    body.update(end_episode=n, num_transitions=n, write_row=2 * n + 1, array_rows=4 * n)
    body["generation"] += 1
    _write_commit(store, body)


def test_a_billion_episodes_in_record_and_array_metadata_fail_at_the_first_unwritten_index_piece(store):
    """Even when the array shapes agree with the record, the index is read piece by piece, each piece's
    episode ids checked before the next is read: memory stays bounded by one piece."""
    _claim_a_billion_episodes(store)
    with bounded_memory(), pytest.raises(CorruptStoreError, match="index row of episode 4 holds episode_id 0"):
        EpisodeStore.open(store)


@pytest.mark.parametrize("arrays_agree", [False, True])
def test_a_reader_refreshing_onto_a_crafted_record_raises_and_keeps_its_view(store, arrays_agree):
    with EpisodeStore.open(store) as reader:
        view = reader.episodes
        if arrays_agree:
            _claim_a_billion_episodes(store)
            msg = "index row of episode 4 holds episode_id 0"
        else:
            body = json.loads((store / "commit.json").read_text())
            n = 10**9
            body.update(generation=body["generation"] + 1, end_episode=n, num_transitions=n, array_rows=2 * n + 16)
            _write_commit(store, body)
            msg = r"commit\.json does not fit the store: array_rows 2000000016 exceeds"
        with bounded_memory(), pytest.raises(CorruptStoreError, match=msg):
            reader.refresh()
        assert {k: v.tolist() for k, v in reader.episodes.items()} == {k: v.tolist() for k, v in view.items()}
        reader.episode(3)


def test_garbage_root_zarr_json(store):
    (store / "zarr.json").write_text("{garbage")
    with pytest.raises(CorruptStoreError, match=r"store/zarr\.json is not Zarr v3 group metadata"):
        EpisodeStore.open(store)


def test_missing_array_zarr_json(store):
    (store / "packs" / "float32" / "zarr.json").unlink()
    with pytest.raises(CorruptStoreError, match=r"packs/float32/zarr\.json is missing"):
        EpisodeStore.open(store)


@pytest.mark.parametrize("mode", ["r", "a", "open_store"])
def test_a_plain_zarr_array_is_not_a_store(tmp_path, mode):
    path = tmp_path / "array"
    zarr.create_array(path, shape=(3,), dtype="f4")
    with pytest.raises(NotAStoreError, match="holds a Zarr array"):
        open_store(path, OBS, ACT) if mode == "open_store" else EpisodeStore.open(path, mode)


@pytest.mark.parametrize("call", ["create", "open_store", "open-r", "open-a"])
def test_a_path_that_is_a_file(tmp_path, call):
    path = tmp_path / "a-file"
    path.write_text("not a store")
    with pytest.raises(NotAStoreError, match="is a file, not a store directory"):
        if call == "create":
            EpisodeStore.create(path, OBS, ACT)
        elif call == "open_store":
            open_store(path, OBS, ACT)
        else:
            EpisodeStore.open(path, call[-1])
    assert path.read_text() == "not a store"


# -- defect 6: a layout path that leads out of the store ------------------------------------------------------------
@pytest.mark.parametrize("mode", ["r", "a"])
@pytest.mark.parametrize("escape", ["absolute", "parent"])
def test_a_layout_path_out_of_the_store_is_refused_before_any_io(store, mode, escape):
    outside = store.parent / "outside"
    (outside / "c" / "0").mkdir(parents=True)
    (outside / "c" / "0" / "0").write_bytes(b"\x7f" * 16 * 21 * 4)  # rows a reader following the path would map
    before = _tree_state(outside, store)
    crafted = str(outside) if escape == "absolute" else "packs/../../outside"
    if escape == "absolute":  # zarr finds the array inside the store (as an attacker would ship it), I/O went outside
        shutil.copytree(store / "packs/float32", store / str(outside).lstrip("/"), ignore=shutil.ignore_patterns("c"))
    _edit_attrs(store, lambda a: a["layout"][0].update(path=crafted))
    with pytest.raises(CorruptStoreError, match=r"layout\[0\]\.path is .*outside', expected packs/<dtype> or steps/"):
        _use(store, mode)
    assert _tree_state(outside, store) == before


# -- spaces read from a store ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "d, msg",
    [
        ({"type": "Box", "shape": [1 << 20, 1 << 20], "dtype": "float32", "low": 0, "high": 1}, "exceed"),
        ({"type": "Box", "shape": [3], "dtype": "object", "low": 0, "high": 1}, "dtype 'object' is not one of"),
        ({"type": "Box", "shape": [0], "dtype": "float32", "low": 0, "high": 1}, "not a list of positive integers"),
        ({"type": "Box", "shape": [3], "dtype": "float32", "low": [0, 1], "high": 1}, "not a number or 3 numbers"),
        ({"type": "Box", "shape": [3], "dtype": "float32", "low": 2, "high": 1}, "low values must be less"),
        ({"type": "Discrete", "n": "3"}, "must be integers"),
        ({"type": "Discrete", "n": 0}, "positive"),
        ({"type": "MultiBinary", "n": [1 << 20, 1 << 20]}, "exceed"),
        ({"type": "MultiDiscrete", "nvec": [10**30], "start": [0]}, "not a nested list of integers"),
        ({"type": "Dict", "spaces": [1]}, "needs 'spaces'"),
        ([1, 2], "unknown space type"),
    ],
)
def test_crafted_spaces_are_refused_before_allocating(d, msg):
    with bounded_memory(), pytest.raises(SchemaMismatchError, match=msg):
        space_from_json(d)


def test_row_size_bound_applies_on_create_too(tmp_path):
    big = spaces.Dict({**OBS.spaces, "frame": spaces.Box(0, 255, (MAX_ROW_BYTES + 1,), np.uint8)})
    with pytest.raises(SchemaMismatchError, match="field 'frame'.*exceed"):
        EpisodeStore.create(tmp_path / "s", big, ACT)
    with pytest.raises(SchemaMismatchError, match="backslash or NUL"):
        EpisodeStore.create(tmp_path / "s", spaces.Dict({**OBS.spaces, "a\\b": GOAL}), ACT)


# -- the fuzz test ----------------------------------------------------------------------------------------------------
DELETE = object()


def _tree_paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON document (interior nodes included)."""
    out = [prefix] if prefix else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in children:
        out.extend(_tree_paths(v, (*prefix, k)))
    return out


def _apply(doc: Any, path: tuple, value: Any) -> None:
    """Set (or delete) ``doc[path]``; a path an earlier mutation removed is skipped."""
    try:
        *parents, last = path
        node = doc
        for k in parents:
            node = node[k]
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    except (KeyError, IndexError, TypeError):
        pass


def _values(outside: str) -> st.SearchStrategy:
    paths = [outside, f"{outside}/x", "../x", "packs/../../x", "/", ".", "..", "", "packs/float32", "steps/pixels",
             "episodes/length", "a\\b", "a\x00b", "__x", ".x", "object", "float32", "<f4", "|O", "U3", "-inf", "Box"]
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.sampled_from([0, 1, 2, 3, -1, 4, 12, 15, 16, 17, 64, 2**31, 2**53 - 1, 2**53, 2**63, 10**9]),
        st.floats(),
        st.sampled_from([0.5, 1e9, 16.0]),
        st.sampled_from(paths),
        st.text(max_size=6),
    )
    containers = st.lists(scalars, max_size=3) | st.dictionaries(st.text(max_size=3), scalars, max_size=2)
    return st.just(DELETE) | scalars | containers


class _Watch:
    """Records every file operation under ``root`` but outside ``allowed`` (an audit hook: it sees opens, mkdirs,
    renames, removes and listings by path, whatever library makes them)."""

    EVENTS = frozenset({"open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "os.listdir",
                        "os.scandir", "os.link", "os.symlink", "os.chmod", "os.utime", "shutil.copyfile"})
    root: str | None = None
    allowed = ""
    hits: ClassVar[list[tuple[str, str]]] = []
    installed = False

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.root is None or event not in cls.EVENTS:
            return
        for a in args:
            if isinstance(a, (str, bytes, os.PathLike)):
                p = os.path.abspath(os.fsdecode(a)) + os.sep
                if p.startswith(cls.root) and not p.startswith(cls.allowed):
                    cls.hits.append((event, p))

    @classmethod
    @contextlib.contextmanager
    def watching(cls, root: Path, allowed: Path) -> Iterator[list[tuple[str, str]]]:
        if not cls.installed:
            sys.addaudithook(cls.hook)
            cls.installed = True
        cls.root, cls.allowed, cls.hits = str(root) + os.sep, str(allowed) + os.sep, []
        try:
            yield cls.hits
        finally:
            cls.root = None


def _plausible_records(path: Path) -> list[dict[str, Any]]:
    """Commit records that agree with the store's index but drop its oldest or newest episodes: crafted records
    a store accepts, so that the rest of a fuzz example reaches reading, sampling and appending."""
    with EpisodeStore.open(path) as s:
        c, lengths = s.commit_record, s.episodes["length"]
        out = []
        for k in (1, 2):
            out.append({**vars(c), "end_episode": c.end_episode - k, "num_transitions": int(lengths[:-k].sum()),
                        "write_row": c.write_row if s.capacity else c.write_row - int(lengths[-k:].sum()) - k})
            out.append({**vars(c), "first_episode": c.first_episode + k, "num_transitions": int(lengths[k:].sum())})
    return [{**r, "generation": c.generation + 1, "format_version": 1} for r in out]


ARRAY_DOCS = ("packs/float32/zarr.json", "steps/pixels/zarr.json", "episodes/start_row/zarr.json")


@pytest.fixture(scope="module")
def arena(bases, tmp_path_factory) -> dict[str, Any]:
    """Where fuzz examples run (``case/store``), an ``outside/`` tree that crafted paths point at, and per base
    store: its JSON documents, the key paths into each (grouped by top-level attribute) and plausible records."""
    root = tmp_path_factory.mktemp("arena")
    (root / "outside" / "c" / "0").mkdir(parents=True)
    (root / "outside" / "c" / "0" / "0").write_bytes(b"\x7f" * 4096)
    bases_info = {}
    for name, base in bases.items():
        docs = {f: json.loads((base / f).read_text()) for f in ("zarr.json", "commit.json", *ARRAY_DOCS)}
        groups: dict[str, list[tuple]] = {}
        for f, doc in docs.items():
            for p in _tree_paths(doc):
                key = p[2] if p[:2] == ("attributes", "her_store") and len(p) > 2 else p[0]
                groups.setdefault(f"{f}:{key}", []).append((f, p))
        # a compressed array's codecs say how its chunk bytes decode: changing them is damage to chunk contents,
        # which reading reports when it decodes a chunk, not a crafted name or number checked at open
        del groups["steps/pixels/zarr.json:codecs"]
        bases_info[name] = {"docs": docs, "groups": groups, "records": _plausible_records(base)}
    with EpisodeStore.open(bases["unbounded"]) as s, HerSampler(s, 16, reward_fn=reward_fn, seed=0) as sampler:
        sampler.sample()  # torch, zarr and their thread pools are loaded before memory is capped
    return {"root": root, "bases": bases_info}


def _draw_mutations(data: st.DataObject, info: dict[str, Any], values: st.SearchStrategy) -> dict[str, Any]:
    """A base store's JSON documents with 0-3 mutations: each of a key (picked evenly among top-level attributes,
    commit record keys and array metadata keys) to a hostile value, or of the whole record to a plausible one."""
    docs = json.loads(json.dumps(info["docs"]))
    if data.draw(st.booleans(), label="plausible record"):
        docs["commit.json"] = dict(data.draw(st.sampled_from(info["records"]), label="record"))
    for _ in range(data.draw(st.integers(0, 3), label="mutations")):
        group = data.draw(st.sampled_from(sorted(info["groups"])), label="group")
        file, path = data.draw(st.sampled_from(info["groups"][group]), label="target")
        old = docs[file].get(path[0]) if file == "commit.json" else None
        choice = values
        if isinstance(old, int):  # near misses of a count: the record stays plausible
            choice = st.one_of(values, st.sampled_from([-1, 1, 2, 16, 10**9]).map(lambda d, old=old: old + d))
        _apply(docs[file], path, data.draw(choice, label="value"))
    return docs


def _write_docs(store: Path, docs: dict[str, Any], valid_crc: bool) -> None:
    for file, doc in docs.items():
        if file == "commit.json" and valid_crc:
            _write_commit(store, doc)
        else:
            (store / file).write_text(json.dumps(doc))


@pytest.mark.slow
@settings(max_examples=110, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_stores_give_store_errors_only(bases, arena, data):
    """Mutated root attributes, commit records (mostly with a valid crc32) and array metadata: opening, reading,
    refreshing, sampling and appending raise her_store errors only, within bounded memory, and no file outside the
    store is opened, created, renamed, removed or changed."""
    root = arena["root"]
    base = data.draw(st.sampled_from(sorted(bases)), label="base")
    docs = _draw_mutations(data, arena["bases"][base], _values(str(root / "outside")))
    valid_crc = data.draw(st.integers(0, 9), label="crc") > 0

    case = root / "case"
    shutil.rmtree(case, ignore_errors=True)
    store = case / "store"
    shutil.copytree(bases[base], store)
    before = _tree_state(root, store)
    with _Watch.watching(root, store) as hits, bounded_memory():
        with EpisodeStore.open(store) as reader, HerSampler(reader, 16, reward_fn=reward_fn, seed=0) as sampler:
            sampler.sample()
            _write_docs(store, docs, valid_crc)
            with contextlib.suppress(StoreError):  # a reader that was open when the store changed under it
                sampler.refresh()
                for i in range(reader.first_episode, reader.end_episode):
                    reader.episode(i)
                sampler.sample()
        for mode in ("r", "a"):
            with contextlib.suppress(StoreError):
                _use(store, mode)
    assert hits == [], f"files outside the store were touched: {hits[:5]}"
    assert _tree_state(root, store) == before


# -- crafted shard files ----------------------------------------------------------------------------------------------
EMPTY_ENTRY = (1 << 64) - 1  # an index entry's offset and nbytes for a row never written


@pytest.fixture(scope="module")
def shard_bases(bases, tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Stores whose image rows are sharded, with their rows per shard: LZ4 (decoded in C by the sampler), and zstd
    (decoded row by row in Python)."""
    root = tmp_path_factory.mktemp("shard_bases")
    with EpisodeStore.create(root / "zstd", OBS, ACT, capacity=12, chunk_rows=16, info_keys=["is_success"],
                             compressors={"pixels": "zstd"}) as store:
        for i, T in enumerate([3, 5, 2, 4, 5]):
            store.append_episode(make_episode(OBS, ACT, T, seed=i, info_keys=("is_success",)))
    out = {}
    for name, path in {**bases, "zstd": root / "zstd"}.items():
        with EpisodeStore.open(path) as s:
            spec = s.layout.arrays[-1]
            assert spec.sharded and spec.path == "steps/pixels"
            out[name] = (path, spec.chunk_rows)
    return out


def _craft_shard(data: st.DataObject, raw: bytes, rows: int) -> bytes:
    """One change to a shard's bytes: an index entry (with a valid crc32c, mostly), the crc32c, a row's bytes or
    its LZ4 size header, or the file's length."""
    import google_crc32c

    raw = bytearray(raw)
    need = 16 * rows + 4
    data_end = max(0, len(raw) - need)
    kind = data.draw(st.sampled_from(["entry", "crc", "frame", "header", "truncate", "extend"]), label="change")
    if kind == "entry" and len(raw) >= need:
        i = data.draw(st.integers(0, rows - 1), label="row")
        counts = st.one_of(
            st.sampled_from([0, 1, 3, 4, data_end - 1, data_end, data_end + 1, EMPTY_ENTRY, EMPTY_ENTRY - 1, 1 << 63]),
            st.integers(0, (1 << 64) - 1),
        )
        for k in data.draw(st.sampled_from([(0,), (1,), (0, 1)]), label="fields"):
            struct.pack_into("<Q", raw, data_end + 16 * i + 8 * k, data.draw(counts, label="value"))
        if data.draw(st.integers(0, 4), label="crc") > 0:
            struct.pack_into("<I", raw, len(raw) - 4, google_crc32c.value(bytes(raw[data_end : len(raw) - 4])))
    elif kind == "crc" and raw:
        raw[data.draw(st.integers(max(0, len(raw) - need), len(raw) - 1), label="at")] ^= 1 << data.draw(
            st.integers(0, 7), label="bit"
        )
    elif kind == "frame" and data_end:
        at = data.draw(st.integers(0, data_end - 1), label="at")
        patch = data.draw(st.binary(min_size=1, max_size=8), label="bytes")
        raw[at : min(at + len(patch), data_end)] = patch[: data_end - at]
    elif kind == "header" and data_end >= 4:
        at = data.draw(st.integers(0, data_end - 4), label="at")  # where a row's declared size might be
        size = data.draw(st.sampled_from([0, -1, 47, 48, 49, 1 << 30, -(1 << 31)]), label="size")
        struct.pack_into("<i", raw, at, size)
    elif kind == "truncate":
        del raw[data.draw(st.integers(0, max(0, len(raw) - 1)), label="length") :]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=64), label="tail")
    return bytes(raw)


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_crafted_shard_files_give_store_errors_only(shard_bases, arena, data):
    """Shard files of the image array with crafted index entries, crc32c, row bytes and lengths: reading every
    episode, sampling (LZ4 rows decoded in C, zstd rows in Python) and appending raise her_store errors only, within
    bounded memory."""
    base = data.draw(st.sampled_from(sorted(shard_bases)), label="base")
    path, rows = shard_bases[base]
    store = arena["root"] / "shard-case" / "store"
    shutil.rmtree(store.parent, ignore_errors=True)
    shutil.copytree(path, store)
    shards = sorted((store / "steps" / "pixels").glob("c.*"))
    for _ in range(data.draw(st.integers(1, 3), label="changes")):
        shard = data.draw(st.sampled_from(shards), label="shard")
        shard.write_bytes(_craft_shard(data, shard.read_bytes(), rows))
    # read with pread, or mapped
    warm = data.draw(st.sampled_from([reader_module.WARM_GATHERS, 0]), label="warm gathers")
    with bounded_memory(), _warm_gathers(warm):
        for mode in ("r", "a"):
            with contextlib.suppress(StoreError):
                _use(store, mode)


@contextlib.contextmanager
def _warm_gathers(n: int) -> Iterator[None]:
    """Samplers decode local LZ4 frames from the mapped shards after ``n`` warm gathers (0: from the first)."""
    kept, reader_module.WARM_GATHERS = reader_module.WARM_GATHERS, n
    try:
        yield
    finally:
        reader_module.WARM_GATHERS = kept


# -- files that are not files: each would hang or grow without bound if opened and read as one ---------------------
SHARD = Path("steps") / "pixels" / "c.0.0.0.0"


def _replace_with(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:  # a symbolic link to a device that never ends
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero"])
@pytest.mark.parametrize("where", [str(SHARD), "commit.json", "zarr.json", "steps/pixels/zarr.json"])
@pytest.mark.parametrize("mode", ["r", "a"])
def test_a_file_that_is_a_fifo_a_directory_or_a_link_to_dev_zero(store, kind, where, mode):
    """A FIFO blocked open() forever, /dev/zero behind a link grew a read until memory ran out, a directory raised
    IsADirectoryError: each is a CorruptStoreError naming the file, within bounded memory."""
    _replace_with(store / where, kind)
    with bounded_memory(), pytest.raises(CorruptStoreError, match=r"regular file|symbolic link"):
        _use(store, mode)


LINKED = ["writer.lock", "commit.json", "steps", "steps/pixels", str(SHARD), "packs/float32", "packs/float32/c/0",
          "episodes/length/c"]


@pytest.mark.parametrize("where", LINKED)
@pytest.mark.parametrize("mode", ["r", "a"])
def test_a_link_out_of_the_store_is_never_followed(store, where, mode):
    """A store from elsewhere whose file or directory is a symbolic link out of it, to a copy of what it replaced (so
    that what is read through it would pass for the store's own): opening it for writing truncated the file the lock's
    link named, and appends wrote rows through a linked directory. Each is now a CorruptStoreError naming the link,
    and nothing outside the store changes."""
    target, outside = store / where, store.parent / "outside" / where.replace("/", "_")
    outside.parent.mkdir()
    if target.is_dir():
        shutil.copytree(target, outside)
        shutil.rmtree(target)
    else:  # the lock's record names a pid, as any file of the user's could hold
        shutil.copy2(target, outside)
        target.unlink()
    target.symlink_to(outside, target_is_directory=outside.is_dir())
    before = _tree_state(store.parent, skip=store)
    if mode == "r" and where == "writer.lock":  # a reader never opens the lock
        _use(store, mode)
    else:
        with pytest.raises(CorruptStoreError, match="symbolic link"):
            _use(store, mode)
    assert _tree_state(store.parent, skip=store) == before


def test_a_commit_record_of_another_format_version_than_the_store(store):
    body = json.loads((store / "commit.json").read_text())
    _write_commit(store, {**body, "format_version": 1})  # the store's attributes say FORMAT_VERSION
    with pytest.raises(CorruptStoreError, match=f"format version 1, the store's attributes {FORMAT_VERSION}"):
        EpisodeStore.open(store)


@pytest.mark.parametrize(
    "edit, msg",
    [
        (lambda c: c.update(acceleration="fast"), "numcodecs.lz4 configuration"),
        (lambda c: c.update(acceleration=2**40), "numcodecs.lz4 configuration"),
        (lambda c: c.update(acceleration=1.5), "numcodecs.lz4 configuration"),
        (lambda c: c.update(extra=1), "numcodecs.lz4 configuration"),
    ],
)
def test_a_crafted_lz4_configuration(store, edit, msg):
    def change(doc):
        edit(doc["codecs"][0]["configuration"]["codecs"][1]["configuration"])

    _edit_json(store / "steps" / "pixels" / "zarr.json", change)
    with pytest.raises(CorruptStoreError, match=msg):
        EpisodeStore.open(store)


@pytest.mark.parametrize("key, value", [("fill_value", 7), ("storage_transformers", [{"name": "evil"}])])
def test_a_fill_value_or_storage_transformer_the_format_does_not_have(store, key, value):
    _edit_json(store / "steps" / "pixels" / "zarr.json", lambda d: d.update({key: value}))
    with pytest.raises(CorruptStoreError):
        EpisodeStore.open(store)


@contextlib.contextmanager
def _no_hang(seconds: int = 120) -> Iterator[None]:
    """A call that blocks (on a FIFO) fails the test rather than hanging the suite."""
    import signal

    def stop(*_: Any) -> None:
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("kind", ["link", "fifo"])
def test_a_version_1_store_with_a_link_or_a_fifo_at_an_image_chunk(tmp_path, kind):
    """Version 1 image chunks are read and written through zarr, which follows links and blocks on a FIFO: a
    linked chunk directory was read, verified clean and appended through (a file outside the store rewritten), and a
    FIFO hung reads and verify. Each is now a CorruptStoreError, a damaged chunk to verify, and nothing outside
    changes."""
    from her_store.ops.verify import verify

    store = tmp_path / "case" / "store"
    shutil.copytree(Path(DATA) / "v1_store", store)
    chunk = store / "steps" / "pixels" / "c" / "0"
    outside = tmp_path / "case" / "outside"
    if kind == "link":
        shutil.copytree(chunk, outside)  # the chunk's own bytes: read through the link, they would pass for it
        shutil.rmtree(chunk)
        chunk.symlink_to(outside, target_is_directory=True)
    else:
        outside.mkdir()
        (chunk / "0" / "0" / "0").unlink()
        os.mkfifo(chunk / "0" / "0" / "0")
    before = _tree_state(store.parent, skip=store)
    with _no_hang():
        with pytest.raises(CorruptStoreError, match="symbolic link|not a directory|regular file"):
            _use(store, "r")
        with pytest.raises(CorruptStoreError, match="symbolic link|not a directory|regular file"):
            _use(store, "a")
        report = verify(store)
    assert any(p.kind == "file" and "steps/pixels/c/0" in p.what for p in report.problems), report.summary()
    assert _tree_state(store.parent, skip=store) == before


@pytest.mark.parametrize("where", ["writer.lock", "past the commit"])
def test_a_file_of_the_store_with_another_name_is_not_written_in_place(store, where):
    """A hard link shares its file: the lock's record and a raw chunk's rows, written in place, changed a file
    outside the store. A file the writer would write in place with another name is a CorruptStoreError."""
    with EpisodeStore.open(store) as s:
        spec, w = s.layout.arrays[0], s.commit_record.write_row
    key = "writer.lock" if where == "writer.lock" else spec.chunk_key(w // spec.chunk_rows + 1)
    outside = store.parent / "outside"
    outside.mkdir()
    (outside / "file").write_bytes(b"a file of the user's")
    (store / key).parent.mkdir(parents=True, exist_ok=True)
    (store / key).unlink(missing_ok=True)
    os.link(outside / "file", store / key)
    before = _tree_state(store.parent, skip=store)
    with pytest.raises(CorruptStoreError, match="hard link"), EpisodeStore.open(store, "a") as s:
        for i in range(40):
            s.append_episode(make_episode(OBS, ACT, 5, seed=i, info_keys=("is_success",)))
    assert _tree_state(store.parent, skip=store) == before


def test_a_create_where_a_link_leads_out_changes_nothing(tmp_path):
    """A directory to create a store in, holding a link where one of the store's directories goes: the create made
    directories and removed temp-file look-alikes in the link's target. Now it is refused before anything of the
    store is made, or anything removed."""
    outside = tmp_path / "outside"
    (outside / "float32").mkdir(parents=True)
    (outside / "float32" / "zarr.json.1234.tmp").write_bytes(b"the user's")
    path = tmp_path / "store"
    path.mkdir()
    (path / "packs").symlink_to(outside, target_is_directory=True)
    before = _tree_state(outside, skip=outside / "nothing")
    with pytest.raises(CorruptStoreError, match="packs is not a directory"):
        EpisodeStore.create(path, OBS, ACT)
    assert _tree_state(outside, skip=outside / "nothing") == before
    assert sorted(os.listdir(path)) == ["packs", "writer.lock"]  # the lock the create took, and nothing of a store


@pytest.mark.parametrize("tool", ["copy", "repair"])
def test_a_link_where_a_tool_keeps_its_work_beside_a_store_is_refused(bases, tmp_path, tool):
    """A copy builds its destination in ``.DEST.copy-partial``, a repair keeps the episodes it moves in
    ``.NAME.repair``: a link planted there had a copy write the whole store into (and over) its target, and a repair
    fail with an error naming no path. Both are refused naming the path, and nothing outside changes."""
    from her_store.errors import StoreExistsError
    from her_store.ops.copy import copy_store
    from her_store.ops.repair import repair

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "zarr.json").write_bytes(b"the user's")
    store = tmp_path / "store"
    shutil.copytree(bases["unbounded"], store)
    name = ".copy.copy-partial" if tool == "copy" else ".store.repair"
    (tmp_path / name).symlink_to(outside, target_is_directory=True)
    before = _tree_state(outside, skip=outside / "nothing")
    if tool == "copy":
        with pytest.raises(StoreExistsError, match=re.escape(name)):
            copy_store(store, tmp_path / "copy")
    else:
        with EpisodeStore.open(store, "a") as s:  # an episode's bytes flipped: a repair must move the ones after it
            row = int(s.episodes["start_row"][1])
            spec = s.layout.arrays[0]
        data = store / spec.chunk_key(row // spec.chunk_rows)
        raw = bytearray(data.read_bytes())
        raw[(row % spec.chunk_rows) * spec.row_nbytes] ^= 0xFF
        data.write_bytes(bytes(raw))
        with pytest.raises(CorruptStoreError, match=re.escape(name)):
            repair(store, log=lambda line: None)
    assert _tree_state(outside, skip=outside / "nothing") == before
