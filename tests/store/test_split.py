"""her_store/balance.py: the pool's share of split work, moved by who finishes first."""

from __future__ import annotations

import pytest

from her_store.store.split import MAX_SHARE, MIN_SHARE, STEP, Balance


def test_the_split_starts_even_and_every_row_is_in_one_piece():
    b = Balance()
    for n, threads in ((100, 1), (101, 3), (7, 1), (1000, 31)):
        edges = Balance().edges(n, threads, min_rows=2)
        assert edges[0] == 0 and edges[-1] == n and edges == sorted(edges)
        assert len(edges) - 2 <= threads
    assert b.edges(100, 3, 1) == [0, 25, 50, 75, 100]  # three threads and the caller: a quarter each


def test_too_few_rows_for_a_thread_stay_with_the_caller():
    assert Balance().edges(10, 1, min_rows=8) == [0, 10]
    assert Balance().edges(10, 0, min_rows=1) == [0, 10]
    assert Balance().edges(0, 2, min_rows=1) == [0, 0]


def test_the_share_moves_a_step_each_time_and_stays_within_its_bounds():
    b = Balance()
    b.observe(True)  # nothing split yet: nothing to move
    assert b.share is None
    b.edges(100, 1, 1)
    b.observe(True)
    assert b.share == pytest.approx(0.5 + STEP) and b.edges(100, 1, 1) == [0, 52, 100]
    b.observe(False)
    b.observe(False)
    assert b.share == pytest.approx(0.5 - STEP)
    for _ in range(100):
        b.observe(True)
    assert b.share == MAX_SHARE and b.edges(100, 1, 1) == [0, 95, 100]
    for _ in range(100):
        b.observe(False)
    assert b.share == MIN_SHARE and b.edges(100, 1, 1) == [0, 10, 100]


def test_a_share_at_its_floor_still_gives_a_thread_its_minimum_so_it_can_grow_back():
    b = Balance()
    b.edges(20, 1, 8)
    for _ in range(100):
        b.observe(False)
    assert b.share == MIN_SHARE and b.edges(20, 1, 8) == [0, 8, 20]  # not [0, 20]: the threads stay observed
    b.observe(True)
    assert b.share > MIN_SHARE
