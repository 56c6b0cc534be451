"""Image episodes for the benchmarks: 3x84x84 uint8 frames of two kinds, with 3-D float goals.

- "rendered": a simulator's render of a tabletop scene (shaded sky, checkered floor, a table, a moving gripper and
  a cube it pushes): smooth shading and hard edges, no sensor noise. About 6x smaller with LZ4: the primary workload.
- "camera": a moving blob under uniform sensor noise (0..3 per pixel): about 2.5x smaller with any lossless codec,
  the hard case.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

__all__ = ["FRAME_KINDS", "camera_episode_frames", "image_episode", "rendered_episode_frames"]

FrameKind = Literal["rendered", "camera"]
FRAME_KINDS: tuple[FrameKind, ...] = ("rendered", "camera")


def rendered_episode_frames(rng: np.random.Generator, T: int = 50, size: int = 84) -> np.ndarray:
    """The ``T + 1`` frames of one episode of a rendered tabletop scene, ``(T + 1, 3, size, size)`` uint8.

    Parameters
    ----------
    rng : numpy.random.Generator
        Draws where the gripper and the cube start and how they move.
    T : int
        Steps of the episode (frames are observations 0..T).
    size : int
        Height and width of a frame.

    Returns
    -------
    numpy.ndarray
        uint8 frames, channels first.

    Examples
    --------
    >>> rendered_episode_frames(np.random.default_rng(0), T=2).shape
    (3, 3, 84, 84)
    """
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    horizon = size * 0.45
    sky = np.stack([120 + 60 * yy / horizon, 160 + 50 * yy / horizon, 230 - 20 * yy / horizon])
    depth = np.maximum(yy - horizon, 1.0)
    checker = ((np.floor(xx / (4 + depth * 0.3)) + np.floor(60 / depth)) % 2).astype(np.float32)
    floor = np.stack([90 + 40 * checker, 90 + 40 * checker, 100 + 40 * checker]) * (0.6 + 0.4 * depth / size)
    scene = np.where(yy < horizon, sky, floor)
    table = (xx > 12) & (xx < 72) & (yy > 40) & (yy < 70)
    scene = np.where(table, np.stack([150 + 0 * xx, 110 + 0 * xx, 70 + 0 * xx]) * (1 - 0.3 * (yy - 40) / 30), scene)
    g0, c0 = rng.uniform(25, 60, 2), rng.uniform(25, 60, 2)
    v = rng.uniform(-0.4, 0.4, 2)
    frames = np.empty((T + 1, 3, size, size), np.uint8)
    for t in range(T + 1):
        gx, gy = g0 + v * t
        cx, cy = c0 + 0.5 * v * t
        cube = (np.abs(xx - cx) < 5) & (np.abs(yy - 10 - cy / 2) < 5)
        img = np.where(cube, np.stack([200 - 4 * (xx - cx), 40 + 0 * xx, 40 + 0 * xx]), scene)
        r2 = (xx - gx) ** 2 + (yy - 5 - gy / 2) ** 2
        shade = 1.0 - r2 / 60
        img = np.where(r2 < 36, np.stack([200 * shade, 200 * shade, 210 * shade]), img)
        frames[t] = np.clip(img, 0, 255)
    return frames


def camera_episode_frames(rng: np.random.Generator, T: int = 50, size: int = 84) -> np.ndarray:
    """The ``T + 1`` frames of one episode seen by a camera: a moving blob plus uniform sensor noise 0..3.

    Parameters
    ----------
    rng : numpy.random.Generator
        Draws the blob's start and the noise.
    T : int
        Steps of the episode (frames are observations 0..T).
    size : int
        Height and width of a frame.

    Returns
    -------
    numpy.ndarray
        ``(T + 1, 3, size, size)`` uint8 frames, channels first.

    Examples
    --------
    >>> camera_episode_frames(np.random.default_rng(0), T=2).dtype
    dtype('uint8')
    """
    yy, xx = np.mgrid[0:size, 0:size]
    cx, cy = rng.uniform(10, size - 10, 2)
    t = np.arange(T + 1)[:, None, None]
    blob = 200 * np.exp(-((xx - cx - t * 0.3) ** 2 + (yy - cy) ** 2) / 60.0)
    frames = np.stack([blob, 0.5 * blob + 30, 255 - blob], axis=1) + rng.integers(0, 4, (T + 1, 3, size, size))
    return np.clip(frames, 0, 255).astype(np.uint8)


def image_episode(rng: np.random.Generator, kind: FrameKind = "camera", T: int = 50) -> dict[str, np.ndarray]:
    """One episode in the form ``EpisodeStore.append_episode`` takes: 3x84x84 frames, 3-D goals, 4-D actions.

    Parameters
    ----------
    rng : numpy.random.Generator
        Draws the frames, goals and actions.
    kind : {"rendered", "camera"}
        Which frames (see the module's docstring).
    T : int
        Steps; the episode ends truncated.

    Returns
    -------
    dict of str to numpy.ndarray
        ``observation``, ``achieved_goal``, ``desired_goal`` (``T + 1`` rows), ``action``, ``reward``,
        ``terminated``, ``truncated`` (``T`` rows).

    Examples
    --------
    >>> ep = image_episode(np.random.default_rng(0), "rendered", T=5)
    >>> ep["observation"].shape, ep["action"].shape
    ((6, 3, 84, 84), (5, 4))
    """
    if kind not in FRAME_KINDS:
        raise ValueError(f"kind must be one of {FRAME_KINDS}, got {kind!r}")
    make = rendered_episode_frames if kind == "rendered" else camera_episode_frames
    ep = {"observation": make(rng, T)}
    ep.update({k: rng.standard_normal((T + 1, 3)).astype(np.float32) for k in ("achieved_goal", "desired_goal")})
    ep["action"] = rng.uniform(-1, 1, (T, 4)).astype(np.float32)
    ep["reward"] = -np.ones(T, np.float32)
    ep["terminated"] = np.zeros(T, bool)
    ep["truncated"] = np.arange(T) == T - 1
    return ep
