"""PriorityTree: sums, minimums and walks against brute force, the compiled kernels and their pure twins alike."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from her_store import _kernels
from her_store._kernels import pure
from her_store.sampling.sum_tree import PriorityTree


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 1000, 5000])
def test_sums_minimums_and_draws_match_brute_force(n):
    rng = np.random.default_rng(n)
    tree = PriorityTree(n)
    v = rng.random(n) * (rng.random(n) < 0.7)
    tree.set(np.arange(n), v)  # bulk build
    for _ in range(20):  # small updates, repeated leaves among them (the last wins)
        leaves, values = rng.integers(0, n, 9), rng.random(9) * (rng.random(9) < 0.8)
        tree.set(leaves, values)
        for i, x in zip(leaves, values, strict=True):
            v[i] = x
    assert tree.total == pytest.approx(v.sum(), rel=1e-12)
    assert tree.min == (v[v > 0].min() if (v > 0).any() else np.inf)
    np.testing.assert_array_equal(tree.leaves, v)
    tree.grow(n + 3)
    np.testing.assert_array_equal(tree.leaves[:n], v)
    if (v > 0).sum() > 1:
        found = tree.find(rng.random(200_000) * tree.total)
        assert (v[found] > 0).all()  # never a leaf of 0
        counts = np.bincount(found, minlength=n)[v > 0]
        assert chisquare(counts, v[v > 0] / v.sum() * 200_000).pvalue > 1e-3


def test_the_walk_never_ends_on_a_zero_leaf_even_at_the_total():
    tree = PriorityTree(8)
    tree.set(np.array([2]), np.array([0.1]))
    tree.set(np.array([5]), np.array([0.2]))
    assert set(tree.find(np.array([0.0, 0.1, 0.29999999, 0.3, 1e9])).tolist()) <= {2, 5}


@pytest.mark.skipif(not _kernels.COMPILED, reason="the C extension is not built")
def test_compiled_and_pure_kernels_give_the_same_tree_and_walks():
    got = []
    for kernels in (_kernels, pure):
        s, m = np.zeros(2 * 1024), np.full(2 * 1024, np.inf)
        r = np.random.default_rng(1)
        for _ in range(50):
            kernels.tree_set(s, m, 1024 + r.integers(0, 1000, 33), r.random(33) * (r.random(33) < 0.9))
        out = np.empty(5000, np.int64)
        kernels.tree_find(s, r.random(5000) * s[1], out)
        got.append((s, m, out))
    for a, b in zip(*got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernels", [pure, *([_kernels] if _kernels.COMPILED else [])])
def test_the_kernels_refuse_arguments_that_do_not_fit(kernels):
    s, m = np.zeros(16), np.full(16, np.inf)
    with pytest.raises(ValueError, match="power of two"):
        kernels.tree_set(np.zeros(12), np.zeros(12), np.array([6]), np.array([1.0]))
    with pytest.raises(ValueError, match="leaf nodes"):
        kernels.tree_set(s, m, np.array([3]), np.array([1.0]))
    with pytest.raises(ValueError, match="leaf nodes"):
        kernels.tree_set(s, m, np.array([9]), np.array([np.nan]))
    with pytest.raises(ValueError, match="one float64 value per node"):
        kernels.tree_set(s, m, np.array([9, 10]), np.array([1.0]))
    with pytest.raises(ValueError, match="one int64 out per value"):
        kernels.tree_find(s, np.array([0.5]), np.empty(2, np.int64))
    assert not s.any()


def test_a_tree_refuses_leaves_past_its_size_and_negative_values():
    tree = PriorityTree(5)
    with pytest.raises(ValueError, match="leaf"):
        tree.set(np.array([5]), np.array([1.0]))
    with pytest.raises(ValueError, match="values >= 0"):
        tree.set(np.array([1]), np.array([-1.0]))
    assert tree.total == 0
