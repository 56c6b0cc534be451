"""The energy of an episode's achieved-goal path: its priority at append (Energy-Based Prioritization).

Zhao & Tresp (2018) rank hindsight episodes by the work done on the goal object: the potential energy of its height
plus the kinetic energy of its motion, summed over the per-step increases, each clipped to ``[0, clip]`` so that a
jump (a reset, a teleport) does not dominate. No TD error is needed, so the priority is computed once, when the
episode is appended, and committed with it in the episode index.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from her_store.checks import check_int, check_number

__all__ = ["EnergyPriority", "PriorityFn"]

PriorityFn = Callable[[Mapping[str, np.ndarray]], float]


@dataclass(frozen=True)
class EnergyPriority:
    """An episode's trajectory energy, the sum over steps of ``clip(E_t - E_{t-1}, 0, clip)`` with
    ``E_t = w_potential * mass * gravity * (z_t - z_0) + w_kinetic * mass * |g_t - g_{t-1}|^2 / (2 * delta_t^2)``
    over the achieved goals ``g_0 .. g_T`` (``z`` their ``height_axis`` coordinate) and ``E_0 = 0``.

    The defaults are the paper's for the Fetch tasks; goals of fewer than ``height_axis + 1`` values (a point on a
    plane) have no potential term. Images as goals are taken as flat vectors. A step whose energy is not a number
    (a NaN in the goals) adds nothing.

    Parameters
    ----------
    clip : float
        The largest energy one step may add (0.5 in the paper for Fetch, 2.5 for the Shadow hand).
    delta_t, mass, gravity : float
        Seconds between steps, the object's mass and the gravity of the potential term.
    w_potential, w_kinetic : float
        Weights of the two terms.
    height_axis : int
        The goal coordinate that is height.

    Examples
    --------
    >>> ag = np.array([[0.0, 0.0], [0.01, 0.0], [0.03, 0.0]])
    >>> round(EnergyPriority()({"achieved_goal": ag}), 6)
    0.125
    """

    clip: float = 0.5
    delta_t: float = 0.04
    mass: float = 1.0
    gravity: float = 9.81
    w_potential: float = 1.0
    w_kinetic: float = 1.0
    height_axis: int = 2

    def __post_init__(self) -> None:
        for name in ("clip", "mass", "gravity", "w_potential", "w_kinetic"):
            check_number(getattr(self, name), name, low=0.0)
        check_number(self.delta_t, "delta_t", low=0.0, low_open=True)
        check_int(self.height_axis, "height_axis", low=0)

    def __call__(self, episode: Mapping[str, np.ndarray]) -> float:
        """The energy of ``episode["achieved_goal"]`` (``T + 1`` rows).

        It runs at every append, so it makes few numpy calls: a dozen for any length (about 10 us for 50 steps).
        """
        g = np.asarray(episode["achieved_goal"], np.float64)
        g = g.reshape(len(g), -1)
        if len(g) < 2:
            return 0.0
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf and huge squares: NaN and inf, handled below
            d = g[1:] - g[:-1]
            energy = (d * d).sum(axis=1)
            energy *= self.w_kinetic * 0.5 * self.mass / (self.delta_t * self.delta_t)
            if g.shape[1] > self.height_axis:
                energy += (self.w_potential * self.mass * self.gravity) * (
                    g[1:, self.height_axis] - g[0, self.height_axis]
                )
            steps = energy.copy()
            steps[1:] -= energy[:-1]
        steps[~(steps > 0)] = 0.0  # a fall adds nothing, and neither does a step whose energy is NaN
        np.minimum(steps, self.clip, out=steps)
        return float(steps.sum())
