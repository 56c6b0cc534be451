"""EpisodeIndex against a plain list model: appends, evictions, locate, ring positions, extend and load."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from her_store.store.index import EpisodeIndex


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.one_of(st.tuples(st.just("append"), st.integers(1, 30)), st.tuples(st.just("evict"), st.integers(1, 3))),
        min_size=1,
        max_size=300,
    ),
    slots=st.one_of(st.none(), st.integers(8, 64)),
)
def test_index_matches_a_list_model(ops, slots):
    idx = EpisodeIndex(slots)
    model: list[tuple[int, int]] = []  # (id, length) of live episodes
    next_id = row = 0
    for op, n in ops:
        if op == "append":
            assert idx.append({"start_row": row, "length": n}) == next_id
            model.append((next_id, n))
            next_id += 1
            row += n + 1
        else:
            for _ in range(min(n, len(model))):
                idx.first += 1
                model.pop(0)
        assert len(idx) == len(model)
        assert idx.num_transitions == sum(n for _, n in model)
        np.testing.assert_array_equal(idx.column("episode_id"), [i for i, _ in model])
    if model:
        flat = [(i, t) for i, n in model for t in range(n)]
        k = np.arange(len(flat))
        ids, steps = idx.locate(k)
        np.testing.assert_array_equal(ids, [i for i, _ in flat])
        np.testing.assert_array_equal(steps, [t for _, t in flat])
        segs = idx.positions(idx.first, idx.end)
        covered = np.concatenate([np.arange(p, p + b - a) for p, a, b in segs])
        expect = np.arange(idx.first, idx.end) % slots if slots else np.arange(idx.first, idx.end)
        np.testing.assert_array_equal(covered, expect)


def test_extend_and_load_agree_with_append():
    a = EpisodeIndex(None)
    for n in (3, 1, 7, 2):
        a.append({"start_row": 0, "length": n})
    cols = a.table()
    b = EpisodeIndex(None)
    b.load({k: v[:2] for k, v in cols.items()}, 0, 2)
    b.extend({k: v[2:] for k, v in cols.items()})
    for k in cols:
        np.testing.assert_array_equal(b.column(k), cols[k])
    assert b.num_transitions == 13
    np.testing.assert_array_equal(b.locate(np.array([0, 3, 4, 11, 12]))[0], [0, 1, 2, 3, 3])


def test_memory_stays_bounded_by_live_episodes_in_a_long_ring():
    idx = EpisodeIndex(slots=100)
    for _ in range(100_000):
        idx.append({"start_row": 0, "length": 1})
        if len(idx) > 50:
            idx.first += 1
    assert len(idx) == 50 and idx.num_transitions == 50
    assert len(idx._cum) <= 4096


def test_snapshots_survive_growth_and_reloads():
    idx = EpisodeIndex(None)
    for n in (3, 4):
        idx.append({"start_row": 0, "length": n})
    snap = idx.snapshot()
    for _ in range(5000):  # grows (new arrays) many times
        idx.append({"start_row": 0, "length": 9})
    np.testing.assert_array_equal(snap.lengths, [3, 4])
    late = idx.snapshot()
    cols = {k: v.copy() for k, v in idx.table().items()}
    cols["length"][:] = 1
    idx.load(cols, 0, len(cols["length"]))  # a reader's reload: the same size, other contents
    assert late.num_transitions == 7 + 9 * 5000
    np.testing.assert_array_equal(late.lengths[:3], [3, 4, 9])
    np.testing.assert_array_equal(snap.locate(np.array([0, 2, 3, 6]))[1], [0, 2, 0, 3])
