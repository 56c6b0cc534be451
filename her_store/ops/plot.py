"""``her-store plot``: one PNG of what a store holds: success and return over episodes, lengths, final goals reached.

Only what the figure needs is read: the index columns (success, return, length) whole, and for up to
``max_goal_episodes`` episodes the final row of ``achieved_goal`` and ``desired_goal`` (row ``T``, the final
next-observation), gathered in one call of the store's :class:`~her_store.store.rows.ChunkReader`. matplotlib draws on
its Agg canvas directly (no pyplot, no global backend change).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, NamedTuple

import numpy as np

from her_store.checks import is_number
from her_store.extras import require
from her_store.storage.files import staged_output
from her_store.store.episode_store import EpisodeStore
from her_store.store.rows import ChunkReader

__all__ = ["PlotData", "add_arguments", "plot_data", "plot_store", "rolling_mean", "run"]

MAX_GOAL_EPISODES = 2_000  # episodes whose final goals are read and drawn
JOINED_EPISODES = 40  # of those, episodes whose achieved and desired goals are joined by a line
MAX_DRAWN_POINTS = 20_000  # points of a curve drawn; the rolling mean is computed over every episode first
FIGSIZE, DPI = (13.0, 9.0), 100


class PlotData(NamedTuple):
    """What the figure shows, computed from the store.

    Attributes
    ----------
    episode_ids : numpy.ndarray
        Live episode ids, oldest first.
    returns, lengths : numpy.ndarray
        Per episode.
    success : numpy.ndarray
        Per episode: 1, 0, or -1 when not recorded.
    window : int
        Width of the rolling means (episodes).
    success_ids, success_rate : numpy.ndarray
        Episodes whose success is recorded, and the rolling mean of their success.
    return_mean : numpy.ndarray
        Rolling mean of ``returns``.
    goal_ids : numpy.ndarray
        Episodes whose final goals were read (all, or an evenly spread sample of ``max_goal_episodes``).
    achieved, desired : numpy.ndarray
        Their final ``achieved_goal`` and ``desired_goal``, flattened to ``(len(goal_ids), goal size)``.
    """

    episode_ids: np.ndarray
    returns: np.ndarray
    lengths: np.ndarray
    success: np.ndarray
    window: int
    success_ids: np.ndarray
    success_rate: np.ndarray
    return_mean: np.ndarray
    goal_ids: np.ndarray
    achieved: np.ndarray
    desired: np.ndarray


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Mean of each value and the ``window - 1`` before it (fewer at the start), vectorised.

    Examples
    --------
    >>> rolling_mean(np.array([1.0, 2.0, 3.0, 4.0]), 2).tolist()
    [1.0, 1.5, 2.5, 3.5]
    """
    x = np.asarray(values, np.float64)
    window = max(1, min(int(window), len(x)))
    ok = np.isfinite(x)  # a NaN or an infinity is left out of its windows, not spread over the rest of the series

    def window_sums(v: np.ndarray) -> np.ndarray:
        # blocks of `window` values: a window is a whole block, or the tail of one plus the head of the next, so
        # its sum adds only its own values (one running sum over the series would lose every digit below a huge
        # value for the rest of it)
        n, w = len(v), window
        blocks = np.zeros((-(-n // w), w))
        blocks.reshape(-1)[:n] = v
        head = blocks.cumsum(axis=1).reshape(-1)  # a block's values up to each
        tail = blocks[:, ::-1].cumsum(axis=1)[:, ::-1].reshape(-1)  # a block's values from each on
        last = np.arange(n)
        start = np.maximum(last + 1 - w, 0)
        return np.where(start == last // w * w, head[last], tail[start] + head[last])

    sums, counts = window_sums(np.where(ok, x, 0.0)), window_sums(ok.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def default_window(n: int) -> int:
    """A rolling window of about a fiftieth of the episodes (at least 1)."""
    return max(1, n // 50)


def final_goals(store: EpisodeStore, episode_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The final ``achieved_goal`` and ``desired_goal`` (row ``T``) of live episodes, flattened to ``(n, size)``.

    One gather per array the goals live in (one in all, when both are in the same pack).

    Examples
    --------
    >>> achieved, desired = final_goals(store, store.episodes["episode_id"][-100:])  # doctest: +SKIP
    """
    view = store.snapshot()
    ids = np.asarray(episode_ids, np.int64)
    if np.any(ids < view.first) or np.any(ids >= view.end):
        raise ValueError(f"episode ids must be live ({view.first}..{view.end - 1})")
    rows = view.start_rows[ids - view.first] + view.lengths[ids - view.first]
    reader = ChunkReader(store, io_threads=0)
    try:
        reader.observe(view)
        out: dict[str, np.ndarray] = {}
        gathered: dict[str, np.ndarray] = {}
        for key in ("achieved_goal", "desired_goal"):
            spec, a, b = store.layout.fields[key]
            if spec.path not in gathered:
                gathered[spec.path] = reader.gather(spec.path, rows)
            part = gathered[spec.path]
            out[key] = (part[:, a:b] if spec.is_pack else part).reshape(len(ids), -1)
    finally:
        reader.close()
    return out["achieved_goal"], out["desired_goal"]


def plot_data(
    store: EpisodeStore, *, window: int | None = None, max_goal_episodes: int = MAX_GOAL_EPISODES
) -> PlotData:
    """The series and goals :func:`plot_store` draws.

    Raises
    ------
    ValueError
        The store holds no episode, or ``window`` is below 1.

    Examples
    --------
    >>> data = plot_data(store, window=10)  # doctest: +SKIP
    >>> data.success_rate[-1]  # doctest: +SKIP
    """
    table = store.episodes
    ids = np.asarray(table["episode_id"])
    if len(ids) == 0:
        raise ValueError(f"{store.url} holds no episode; there is nothing to plot")
    window = default_window(len(ids)) if window is None else int(window)
    if window < 1:
        raise ValueError(f"the rolling window is {window} episodes; it must be at least 1")
    if max_goal_episodes < 1:
        raise ValueError(f"max_goal_episodes is {max_goal_episodes}; it must be at least 1")
    success = np.asarray(table["success"])
    known = success >= 0
    returns = np.asarray(table["return"])
    n_goals = min(len(ids), max_goal_episodes)
    goal_ids = ids[np.unique(np.linspace(0, len(ids) - 1, n_goals).round().astype(np.int64))]
    achieved, desired = final_goals(store, goal_ids)
    return PlotData(
        episode_ids=ids,
        returns=returns,
        lengths=np.asarray(table["length"]),
        success=success,
        window=window,
        success_ids=ids[known],
        success_rate=rolling_mean(success[known], window),
        return_mean=rolling_mean(returns, window),
        goal_ids=goal_ids,
        achieved=achieved,
        desired=desired,
    )


def _thin(x: np.ndarray, *ys: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every k-th point, so a curve of a million episodes draws as fast as one of twenty thousand."""
    step = max(1, math.ceil(len(x) / MAX_DRAWN_POINTS))
    return (x[::step], *(y[::step] for y in ys))


def plot_store(
    store: EpisodeStore, out_path: str | os.PathLike[str], *, window: int | None = None,
    max_goal_episodes: int = MAX_GOAL_EPISODES,
) -> str:
    """Draw a store's episodes into one PNG at ``out_path``; returns its absolute path.

    Panels: success rate over episodes and return over episodes (rolling means over ``window`` episodes, default a
    fiftieth of them, the raw values faint behind), a histogram of episode lengths, and the final achieved goal
    against the desired goal of up to ``max_goal_episodes`` episodes: a scatter for 2-D goals (lines join the two for
    a few episodes), a 3-D axis for 3-D goals, a histogram of the final distance between them otherwise.

    Parameters
    ----------
    store : EpisodeStore
        Any open store.
    out_path : path
        A new file (nothing is overwritten; the PNG appears whole or not at all).
    window : int, optional
        Rolling window in episodes.
    max_goal_episodes : int
        Episodes whose final goals are read (evenly spread over the store).

    Raises
    ------
    ValueError
        The store holds no episode.
    FileExistsError
        ``out_path`` exists.

    Examples
    --------
    >>> with EpisodeStore.open("runs/point/store") as store:  # doctest: +SKIP
    ...     plot_store(store, "point.png")
    '/home/me/point.png'
    """
    require("matplotlib", "tools")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    data = plot_data(store, window=window, max_goal_episodes=max_goal_episodes)
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2)
    n = len(data.episode_ids)
    card = store.metadata
    name = card.get("dataset_id") or card.get("env_id") or os.path.basename(store.url.rstrip("/"))
    fig.suptitle(
        f"{name}: {n:,} episodes, {int(data.lengths.sum()):,} transitions (rolling mean over {data.window:,} episodes)"
    )
    _success_panel(fig.add_subplot(grid[0, 0]), data)
    _return_panel(fig.add_subplot(grid[1, 0]), data)
    _length_panel(fig.add_subplot(grid[0, 1]), data)
    _goal_panel(fig, grid[1, 1], data, card.get("success_threshold"))
    with staged_output(out_path) as tmp:
        fig.savefig(tmp, format="png")
    return os.path.abspath(os.fspath(out_path))


def _success_panel(ax: Any, data: PlotData) -> None:
    ax.set_title("success rate")
    ax.set_xlabel("episode")
    if len(data.success_ids) == 0:
        ax.text(0.5, 0.5, "success not recorded\n(no is_success info in this store)", ha="center", va="center",
                transform=ax.transAxes, fontsize=13, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])
        return
    x, raw, mean = _thin(data.success_ids, data.success[data.success >= 0].astype(np.float64), data.success_rate)
    ax.plot(x, raw, ".", color="tab:green", alpha=0.3, markersize=4, label="per episode")
    ax.plot(x, mean, color="tab:green", linewidth=2, label=f"rolling mean ({data.window})")
    ax.set_ylim(-0.05, 1.05)
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:.0%}")
    ax.grid(alpha=0.3)
    unknown = int((data.success < 0).sum())
    note = f", {unknown:,} episodes not recorded" if unknown else ""
    ax.legend(loc="best", title=f"overall {data.success[data.success >= 0].mean():.1%}{note}", fontsize=8,
              title_fontsize=8)


def _return_panel(ax: Any, data: PlotData) -> None:
    x, raw, mean = _thin(data.episode_ids, data.returns, data.return_mean)
    ax.plot(x, raw, color="tab:blue", alpha=0.2, linewidth=0.8, label="per episode")
    ax.plot(x, mean, color="tab:blue", linewidth=2, label=f"rolling mean ({data.window})")
    ax.set_title("return")
    ax.set_xlabel("episode")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)


def _length_panel(ax: Any, data: PlotData) -> None:
    from matplotlib.ticker import MaxNLocator

    lo, hi = int(data.lengths.min()), int(data.lengths.max())
    bins = np.arange(lo, hi + 2) - 0.5 if hi - lo < 60 else 60
    ax.hist(data.lengths, bins=bins, color="tab:gray")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if hi - lo < 10:
        ax.set_xlim(lo - 5, hi + 5)
    ax.set_title(f"episode length (mean {data.lengths.mean():.1f}, min {lo}, max {hi})")
    ax.set_xlabel("transitions")
    ax.set_ylabel("episodes")
    ax.grid(alpha=0.3)


def _goal_panel(fig: Any, cell: Any, data: PlotData, threshold: Any) -> None:
    dim, k = data.achieved.shape[1], len(data.goal_ids)
    what = f"final goals of {k:,} episodes" + (" (evenly spread)" if k < len(data.episode_ids) else "")
    if dim in (2, 3):
        ax = fig.add_subplot(cell, projection="3d" if dim == 3 else None)
        ach, des = data.achieved.astype(np.float64), data.desired.astype(np.float64)
        joined = np.unique(np.linspace(0, k - 1, min(k, JOINED_EPISODES)).round().astype(np.int64))
        segments = np.stack([des[joined], ach[joined]], axis=1)  # (m, 2 ends, dim)
        if dim == 2:
            from matplotlib.collections import LineCollection

            ax.add_collection(LineCollection(segments, colors="0.6", linewidths=0.7, label="same episode"))
            ax.set_aspect("equal", adjustable="datalim")
        else:
            from mpl_toolkits.mplot3d.art3d import Line3DCollection

            ax.add_collection3d(Line3DCollection(segments, colors="0.6", linewidths=0.7, label="same episode"))
            ax.set_zlabel("z")
        size = 14 if k <= 500 else 5  # thousands of points stay readable as a cloud
        ax.scatter(*des.T, s=size, marker="x", color="tab:red", alpha=0.7, label="desired")
        ax.scatter(*ach.T, s=size, color="tab:blue", alpha=0.6, label="achieved")
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)  # beside the points, not over them
        ax.set_title(what)
        return
    from matplotlib.ticker import MaxNLocator

    ax = fig.add_subplot(cell)
    dist = np.linalg.norm(data.achieved.astype(np.float64) - data.desired.astype(np.float64), axis=1)
    ax.hist(dist, bins=40, color="tab:purple")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if is_number(threshold):
        ax.axvline(threshold, color="tab:red", linestyle="--", label=f"success threshold {threshold:g}")
        ax.legend(fontsize=8)
    ax.set_title(f"{what}: distance achieved to desired ({dim}-D goals)")
    ax.set_xlabel("final distance")
    ax.set_ylabel("episodes")
    ax.grid(alpha=0.3)


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """Arguments of ``her-store plot``."""
    parser.add_argument("path", metavar="PATH_OR_URL", help="the store: a local path or a URL")
    parser.add_argument("-o", "--out", required=True, help="the PNG to write (a new file)")
    parser.add_argument("--window", type=int, default=None,
                        help="rolling mean window in episodes (default: a fiftieth)")
    parser.add_argument("--goal-episodes", type=int, default=MAX_GOAL_EPISODES,
                        help=f"episodes whose final goals are drawn, evenly spread (default {MAX_GOAL_EPISODES:,})")


def run(args: argparse.Namespace) -> int:
    """Run ``her-store plot``: open the store read-only, write the PNG, print where."""
    with EpisodeStore.open(args.path) as store:
        out = plot_store(store, args.out, window=args.window, max_goal_episodes=args.goal_episodes)
    print(f"wrote {out}")
    return 0
