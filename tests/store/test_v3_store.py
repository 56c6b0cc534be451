"""A store made by the format version 3 code before the layer packages (tests/data/v3_store) reads back, and samples
with the same seeds, bit for bit what that code read and sampled from it (tests/data/v3_store_expected.npz); it
verifies clean and takes appends. tests/data/make_old_store.py made both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from her_store import EpisodeStore, HerSampler
from her_store.ops.verify import verify
from her_store.store.frame_rows import FrameArray
from tests.conftest import DATA, assert_episode_equal
from tests.data import make_old_store as old

V3_STORE = Path(DATA) / "v3_store"
EXPECTED = Path(DATA) / "v3_store_expected.npz"
LIVE = range(4, 9)  # the ring of 30 transitions evicted episodes 0..3


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    with np.load(EXPECTED, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _assert_bit_exact(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The same names, and under each an array of the same dtype, shape and bytes (-0.0 is not 0.0, NaN is its bits)."""
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), (k, g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(g, w, err_msg=k)
        assert g.tobytes() == w.tobytes(), k


def _pixel_shards(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "steps" / "pixels").iterdir() if p.name != "zarr.json")


def test_the_v3_store_reads_back_and_samples_bit_exact_what_its_code_did(expected):
    before = _files(V3_STORE)
    with EpisodeStore.open(V3_STORE) as store:
        assert store.layout.version == 3 and store.capacity == old.CAPACITY
        assert (store.first_episode, store.end_episode) == (LIVE.start, LIVE.stop)
        assert (np.diff(store.episodes["start_row"]) < 0).any(), "the ring has wrapped"
        spec = store.layout.arrays[-1]
        assert (spec.path, spec.compressed, spec.sharded, spec.separator) == ("steps/pixels", True, True, ".")
        for i in LIVE:
            assert_episode_equal(store.episode(i), old.episode(i, old.LENGTHS[i]))
        with HerSampler(store, 8, reward_fn=old.reward, seed=0) as sampler:
            assert type(sampler.reader.arrays["steps/pixels"]) is FrameArray  # LZ4 frames, decoded by the C kernel
        got = old.record(store)
    assert any(k.startswith("batch/mixture/") for k in expected) and any(k.endswith("/infos/is_success") for k in got)
    _assert_bit_exact(got, expected)
    assert _files(V3_STORE) == before  # a reader wrote nothing


def test_the_v3_store_verifies_clean():
    before = _files(V3_STORE)
    report = verify(V3_STORE)
    assert report.clean and report.episodes == len(LIVE), report.summary()
    assert report.transitions == sum(old.LENGTHS[i] for i in LIVE)
    assert _files(V3_STORE) == before


def test_appending_to_a_copy_of_the_v3_store_keeps_what_it_held(tmp_path, expected):
    path = tmp_path / "v3_store"
    shutil.copytree(V3_STORE, path)
    shards = _pixel_shards(path)
    lengths = dict(enumerate(old.LENGTHS))
    with EpisodeStore.open(path, "a") as store:
        for i, T in ((9, 5), (10, 9), (11, 12)):  # the ring evicts the oldest episodes
            assert store.append_episode(old.episode(i, T)) == i
            lengths[i] = T
        first = store.first_episode
    assert LIVE.start < first < LIVE.stop and json.loads((path / "commit.json").read_text())["format_version"] == 3
    assert set(_pixel_shards(path)) >= set(shards) and all(s.startswith("c.") for s in _pixel_shards(path))
    report = verify(path)
    assert report.clean and report.episodes == 12 - first, report.summary()
    with EpisodeStore.open(path) as store:
        assert (store.first_episode, store.end_episode) == (first, 12)
        for i in range(first, 12):
            got = store.episode(i)
            assert_episode_equal(got, old.episode(i, lengths[i]))
            if i < LIVE.stop:  # kept from the old store: still the recorded bytes
                prefix = f"episode/{i}/"
                _assert_bit_exact(
                    {prefix + k: np.asarray(v) for k, v in got.items()},
                    {k: v for k, v in expected.items() if k.startswith(prefix)},
                )
