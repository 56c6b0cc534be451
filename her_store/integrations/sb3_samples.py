"""SB3's batches from her_store's: a HerBatch as DictReplayBufferSamples, in SB3's dtypes, shapes and device.

Observations and goals take SB3's shapes (a Discrete one, which the store keeps as a scalar, is ``(B, 1)``), actions
the dtype of SB3's buffer (float32 for a float64 action space), and ``dones`` SB3's meaning: with
``handle_timeout_termination`` a truncation does not stop bootstrapping, without it every episode end does. A
VecNormalize normalises observations and rewards as SB3's buffers do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch as th

from her_store.integrations import require
from her_store.sampling.sampler import HerBatch

_types = require("stable_baselines3.common.type_aliases", "sb3")

__all__ = ["sb3_samples"]


def sb3_samples(
    batch: HerBatch,
    obs_shape: Mapping[str, tuple[int, ...]],
    action_dim: int,
    action_dtype: th.dtype,
    device: th.device,
    handle_timeout_termination: bool,
    env: Any = None,
) -> Any:
    """``batch`` as SB3's DictReplayBufferSamples on ``device``, normalised by ``env`` (a VecNormalize) if given.

    Parameters
    ----------
    batch : HerBatch
        The sampler's batch (on the CPU).
    obs_shape : mapping
        SB3's shape of each observation key (``get_obs_shape`` of the observation space).
    action_dim : int
        SB3's ``action_dim``: actions are ``(B, action_dim)``.
    action_dtype : torch.dtype
        The dtype of the actions in SB3's buffer.
    device : torch.device
        Where the batch goes.
    handle_timeout_termination : bool
        False: a truncated transition is ``done`` too.
    env : VecNormalize, optional
        Normalises the observations and the rewards (``normalize_obs``, ``normalize_reward``).
    """
    size = len(batch.actions)
    dones = batch.dones if handle_timeout_termination else th.maximum(batch.dones, batch.truncated)
    if env is None:
        obs = {k: v.to(device) for k, v in batch.observations.items()}
        next_obs = {k: v.to(device) for k, v in batch.next_observations.items()}
        rewards = batch.rewards.to(device)
    else:
        norm_obs = env.normalize_obs({k: v.numpy() for k, v in batch.observations.items()})
        norm_next = env.normalize_obs({k: v.numpy() for k, v in batch.next_observations.items()})
        obs = {k: th.tensor(v, device=device) for k, v in norm_obs.items()}
        next_obs = {k: th.tensor(v, device=device) for k, v in norm_next.items()}
        rewards = th.tensor(env.normalize_reward(batch.rewards.numpy()).astype(np.float32), device=device)
    return _types.DictReplayBufferSamples(
        observations={k: v.reshape(size, *obs_shape[k]) for k, v in obs.items()},
        actions=batch.actions.reshape(size, action_dim).to(device, action_dtype),
        next_observations={k: v.reshape(size, *obs_shape[k]) for k, v in next_obs.items()},
        dones=dones.to(device),
        rewards=rewards,
    )
