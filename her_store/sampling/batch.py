"""The batch a sampler returns (:class:`HerBatch`), and its assembly from the gathered rows.

Goals are relabelled and rewards recomputed on the gathered rows, then every field is handed to the device as a
tensor (page-locked and copied with ``non_blocking`` on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from her_store.sampling.drawn import Draw, transition_keys
from her_store.sampling.relabel import GoalChoice
from her_store.sampling.rewards import RewardRecompute

__all__ = ["DeviceTransfer", "HerBatch", "assemble_batch"]


class HerBatch(NamedTuple):
    """One sampled batch, as torch tensors on the sampler's device.

    Observations keep their stored dtype; rewards and flags are float32 with shape ``(B, 1)``. The first
    ``int(her_ratio * B)`` rows are the relabelled ones (``is_relabeled``). ``source`` is None from a
    :class:`~her_store.sampling.sampler.HerSampler`; from a :class:`~her_store.sampling.mixture.MixtureSampler` it is
    int64 ``(B,)``, the position of the store each row came from (``episode_ids`` are that store's ids).
    ``weights`` and ``indices`` are None unless the sampler prioritizes by TD error (``prioritize="td"``): then
    ``weights`` is float32 ``(B,)``, each sample's importance weight ``(N * P(i)) ** -beta`` over its largest value,
    and ``indices`` int64 ``(B,)``, the keys ``update_priorities`` takes.
    """

    observations: dict[str, torch.Tensor]
    actions: torch.Tensor
    rewards: torch.Tensor
    next_observations: dict[str, torch.Tensor]
    terminated: torch.Tensor
    truncated: torch.Tensor
    dones: torch.Tensor
    is_relabeled: torch.Tensor
    episode_ids: torch.Tensor
    steps: torch.Tensor
    infos: dict[str, torch.Tensor]
    source: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    indices: torch.Tensor | None = None


class DeviceTransfer:
    """Arrays to tensors on ``device``: on the CPU the array's own memory (no copy); elsewhere pinned first when
    ``pin_memory`` (default: on CUDA) and copied with ``non_blocking``. A tensor (a working set's rows gathered on
    the device) is returned as it is.

    Examples
    --------
    >>> to_device = DeviceTransfer("cpu")
    >>> a = np.arange(3)
    >>> to_device(a).data_ptr() == a.ctypes.data
    True
    """

    def __init__(self, device: str | torch.device, pin_memory: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self._cpu = self.device.type == "cpu"  # (read on every field of every batch)

    def __call__(self, a: Any) -> torch.Tensor:
        if isinstance(a, torch.Tensor):
            return a
        x = torch.from_numpy(a)
        if self._cpu:
            return x
        if self.pin_memory:  # pragma: no cover - page-locked memory needs a CUDA build and GPU, which CI lacks
            x = x.pin_memory()
        return x.to(self.device, non_blocking=self.pin_memory)


def assemble_batch(
    d: Draw,
    now: dict[str, Any],
    nxt: dict[str, Any],
    goals: Any,
    finish: Callable[[], None],
    *,
    goal_choice: GoalChoice,
    rewards: RewardRecompute,
    goals_at: Callable[[], Callable[[np.ndarray, np.ndarray], np.ndarray]],
    rng: np.random.Generator,
    obs_keys: tuple[str, ...],
    to_device: DeviceTransfer,
) -> HerBatch:
    """The batch of a draw and its gathered fields: the relabelled samples' goals written (:meth:`GoalChoice.relabel`)
    and rewards and terminations recomputed (:class:`RewardRecompute`) while the later arrays' gathers complete
    (``finish``, waited for whatever happens), then every field on the device.

    Parameters
    ----------
    d : Draw
        The samples, the first ``d.her.sum()`` relabelled.
    now, nxt, goals, finish
        What :class:`~her_store.sampling.gather.Gather` returned for ``d``.
    goal_choice, rewards, to_device
        The sampler's parts.
    goals_at : callable
        Makes a callable strategy's reader of achieved goals (called only for one).
    rng : numpy.random.Generator
        The sampler's generator, which a callable strategy draws with.
    obs_keys : tuple of str
        The observation fields.
    """
    B = len(d.rows)
    try:
        n = int(d.her.sum())
        if n:
            goals = goal_choice.relabel(d, n, now, nxt, goals, goals_at, rng)
        reward, terminated, infos = rewards(n, now, nxt, goals)
    finally:
        finish()
    relabeled = np.zeros(B, bool)
    relabeled[:n] = True
    t = to_device
    return HerBatch(
        observations={k: t(now[k]) for k in obs_keys},
        actions=t(now["action"]),
        rewards=t(reward.reshape(B, 1)),
        next_observations={k: t(nxt[k]) for k in obs_keys},
        terminated=t(terminated.reshape(B, 1)),
        truncated=t(now["truncated"].astype(np.float32).reshape(B, 1)),
        dones=t(terminated.reshape(B, 1)),  # a timeout does not stop bootstrapping
        is_relabeled=t(relabeled),
        episode_ids=t(d.episode_ids),
        steps=t(d.steps),
        infos={k: t(v) for k, v in infos.items()},
        weights=None if d.weights is None else t(d.weights.astype(np.float32)),
        indices=None if d.weights is None else t(transition_keys(d.episode_ids, d.steps)),
    )
