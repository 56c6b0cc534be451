"""her-store plot: the series and final goals it draws, the PNG it writes, and its refusals."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.cli.main import main

pytest.importorskip("matplotlib", reason='pip install "her_store[tools]"')

from her_store.ops.plot import DPI, FIGSIZE, default_window, plot_data, plot_store, rolling_mean  # noqa: E402
from tests.conftest import ROOT

TOOL = os.path.join(ROOT, "tools", "store_plot.py")


def _goal_store(path, n, goal_shape=(2,), success=True, capacity=None, card=None):
    """Episode i: length 3 + i % 4, reward -1 per step but the last (so return 1 - T), final achieved goal all i,
    final desired goal all -i, is_success at the end when i % 3 == 0."""
    g = spaces.Box(-np.inf, np.inf, goal_shape, np.float32)
    obs = spaces.Dict({"observation": spaces.Box(-1, 1, (3,), np.float32), "achieved_goal": g, "desired_goal": g})
    with EpisodeStore.create(path, obs, spaces.Box(-1, 1, (2,), np.float32), capacity=capacity,
                             info_keys=["is_success"] if success else [], metadata=card) as store:
        for i in range(n):
            T = 3 + i % 4
            ep = {"observation": np.zeros((T + 1, 3), np.float32),
                  "achieved_goal": np.zeros((T + 1, *goal_shape), np.float32),
                  "desired_goal": np.full((T + 1, *goal_shape), 7.0, np.float32),
                  "action": np.zeros((T, 2), np.float32), "reward": -np.ones(T, np.float32),
                  "terminated": np.zeros(T, bool), "truncated": np.eye(1, T, T - 1, dtype=bool)[0]}
            ep["achieved_goal"][-1], ep["desired_goal"][-1], ep["reward"][-1] = i, -i, 0
            if success:
                ep["is_success"] = np.zeros(T, np.float32)
                ep["is_success"][-1] = float(i % 3 == 0)
            store.append_episode(ep)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_rolling_mean_is_the_mean_of_each_window():
    x = np.random.default_rng(0).standard_normal(200)
    for w in (1, 2, 7, 50, 500):
        want = [x[max(0, i - w + 1) : i + 1].mean() for i in range(len(x))]
        np.testing.assert_allclose(rolling_mean(x, w), want, rtol=1e-12, atol=1e-12)
    assert rolling_mean(np.array([]), 3).shape == (0,)
    assert default_window(10) == 1 and default_window(5_000) == 100


def test_plot_data_on_known_values(tmp_path):
    _goal_store(tmp_path / "s", 10)
    with EpisodeStore.open(tmp_path / "s") as store:
        data = plot_data(store, window=3)
        few = plot_data(store, window=3, max_goal_episodes=4)
    ids = np.arange(10)
    lengths = 3 + ids % 4
    np.testing.assert_array_equal(data.episode_ids, ids)
    np.testing.assert_array_equal(data.lengths, lengths)
    np.testing.assert_array_equal(data.returns, 1.0 - lengths)
    np.testing.assert_array_equal(data.success, (ids % 3 == 0).astype(np.int8))
    np.testing.assert_array_equal(data.success_ids, ids)
    np.testing.assert_allclose(data.success_rate[:4], [1, 0.5, 1 / 3, 1 / 3])
    np.testing.assert_allclose(data.return_mean[:3], [-2, -2.5, -3])
    np.testing.assert_array_equal(data.goal_ids, ids)
    np.testing.assert_array_equal(data.achieved, np.repeat(ids[:, None], 2, 1))  # row T, the final next-observation
    np.testing.assert_array_equal(data.desired, -np.repeat(ids[:, None], 2, 1))
    np.testing.assert_array_equal(few.goal_ids, [0, 3, 6, 9])  # evenly spread over the store
    np.testing.assert_array_equal(few.achieved[:, 0], [0, 3, 6, 9])


def test_final_goals_of_a_ring_after_evictions(tmp_path):
    _goal_store(tmp_path / "s", 40, capacity=60)
    with EpisodeStore.open(tmp_path / "s") as store:
        first = store.first_episode
        data = plot_data(store)
    assert first > 0
    np.testing.assert_array_equal(data.episode_ids, np.arange(first, 40))
    np.testing.assert_array_equal(data.achieved[:, 0], data.goal_ids)
    np.testing.assert_array_equal(data.desired[:, 1], -data.goal_ids)


@pytest.mark.slow
@pytest.mark.parametrize("goal_shape", [(2,), (3,), (8,), (2, 2)], ids=["2d", "3d", "8d", "2x2"])
def test_png_for_each_kind_of_goal(tmp_path, goal_shape):
    _goal_store(tmp_path / "s", 30, goal_shape, card={"success_threshold": 0.05})
    with EpisodeStore.open(tmp_path / "s") as store:
        out = plot_store(store, tmp_path / "out.png", window=5)
        data = plot_data(store)
    assert out == str(tmp_path / "out.png")
    assert _png_size(out) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
    assert os.path.getsize(out) > 20_000  # four drawn panels, not a blank canvas
    assert data.achieved.shape == (30, int(np.prod(goal_shape)))
    assert sorted(os.listdir(tmp_path)) == ["out.png", "s"]


def test_unknown_success_is_drawn_as_not_recorded(tmp_path):
    _goal_store(tmp_path / "s", 12, success=False)
    with EpisodeStore.open(tmp_path / "s") as store:
        data = plot_data(store)
        plot_store(store, tmp_path / "out.png")
    assert (data.success == -1).all() and len(data.success_ids) == 0 and len(data.success_rate) == 0
    assert _png_size(tmp_path / "out.png") == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))


def test_command_writes_the_png_and_refuses_to_overwrite(tmp_path, capsys):
    _goal_store(tmp_path / "s", 8)
    assert main(["plot", str(tmp_path / "s"), "-o", str(tmp_path / "a.png"), "--window", "2"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'a.png'}"
    before = (tmp_path / "a.png").read_bytes()
    assert main(["plot", str(tmp_path / "s"), "-o", str(tmp_path / "a.png")]) == 2
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "a.png").read_bytes() == before
    assert main(["plot", str(tmp_path / "s"), "-o", str(tmp_path / "b.png"), "--window", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err and not (tmp_path / "b.png").exists()


@pytest.mark.slow
def test_empty_store_exits_2_with_one_line(tmp_path):
    _goal_store(tmp_path / "s", 0)
    r = subprocess.run([sys.executable, TOOL, str(tmp_path / "s"), "-o", str(tmp_path / "e.png")],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == f"her-store plot: {tmp_path / 's'} holds no episode; there is nothing to plot"
    assert not (tmp_path / "e.png").exists()


def test_rolling_mean_leaves_out_what_is_not_finite_and_keeps_digits_after_a_huge_value():
    x = np.array([1.0, 1.0, np.nan, 1.0, np.inf, 1.0, 1.0])
    assert rolling_mean(x, 2).tolist() == [1.0] * 7  # a NaN or an infinity spoils no window
    assert rolling_mean(np.array([1e17, 1.0, 1.0, 1.0, 1.0]), 2).tolist() == [1e17, 5e16, 1.0, 1.0, 1.0]
    assert rolling_mean(np.array([1.0, 2.0, 3.0]), 10**20).tolist() == [1.0, 1.5, 2.0]  # longer than the series
    assert np.isnan(rolling_mean(np.array([np.nan, np.nan, 2.0]), 2)).tolist() == [True, True, False]
