"""The env a training run drives: the default env's registration, and the checks and facts of ``--env``.

The job makes one env of ``--env`` before anything else: it must be a goal env (Dict observations with
``observation``, ``achieved_goal`` and ``desired_goal``, and ``compute_reward``) whose action space the algorithm
can drive; one step of it tells whether its infos report ``is_success``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gymnasium import spaces

from her_store.format.schema import GOAL_KEYS
from her_store.integrations.sb3_infos import is_numeric_scalar
from her_store.integrations.train_errors import doing

__all__ = ["DEFAULT_ENV", "DEFAULT_N_BITS", "EnvFacts", "env_factory", "register_default_env"]

DEFAULT_ENV = "her_store/BitFlipping-v0"
"""SB3's BitFlippingEnv (discrete actions for DQN, the continuous variant for the others), registered on import."""

DEFAULT_N_BITS = 10
"""The bits of the default env (and its episode step limit)."""


def register_default_env() -> None:
    """Register :data:`DEFAULT_ENV` with gymnasium (once): SB3's BitFlippingEnv of :data:`DEFAULT_N_BITS` bits."""
    import gymnasium as gym

    if DEFAULT_ENV not in gym.registry:
        gym.register(
            DEFAULT_ENV,
            entry_point="stable_baselines3.common.envs:BitFlippingEnv",
            kwargs={"n_bits": DEFAULT_N_BITS},
            max_episode_steps=DEFAULT_N_BITS,  # the env's own limit, told to the spec
            disable_env_checker=True,
        )


@dataclass(frozen=True)
class EnvFacts:
    """What the job learns of ``--env`` by making one: how to make it, its episode step limit (None when its spec
    does not say), whether its infos carry ``is_success`` (then stored, for the store's success figures) and its
    spec."""

    make: Callable[[], Any]
    max_episode_steps: int | None
    reports_success: bool
    spec: Any


def env_factory(env_id: str, algo: str, seed: int) -> EnvFacts:
    """The facts of ``--env`` ``env_id``, after checking once that it is a goal env ``--algo`` ``algo`` can drive (and
    taking one step of it, seeded with ``seed``, to see its infos).

    Raises
    ------
    ValueError, TypeError
        An env that cannot be made, is not a goal env, or has an action space the algorithm cannot drive.
    """
    import gymnasium as gym

    register_default_env()
    kwargs: dict[str, Any] = {}
    if env_id == DEFAULT_ENV and algo.lower() != "dqn":
        kwargs["continuous"] = True

    def make() -> Any:
        return gym.make(env_id, **kwargs)

    try:
        with doing(f"making --env {env_id}"):
            env = make()
    except (gym.error.Error, ImportError) as e:  # NameNotFound, VersionNotFound, a module:name that cannot import
        raise ValueError(f"--env {env_id}: {e}") from None
    try:
        obs_space, act_space = env.observation_space, env.action_space
        missing = [k for k in GOAL_KEYS if not isinstance(obs_space, spaces.Dict) or k not in obs_space.spaces]
        if missing:
            raise ValueError(
                f"--env {env_id} is not a goal env: HER needs Dict observations with keys {', '.join(GOAL_KEYS)}; "
                f"its observation space is {obs_space} (missing {', '.join(missing)})"
            )
        if not callable(getattr(env.unwrapped, "compute_reward", None)):
            raise TypeError(
                f"--env {env_id} is not a goal env: it has no compute_reward(achieved_goal, desired_goal, info)"
            )
        discrete = algo.lower() == "dqn"
        if discrete and not isinstance(act_space, spaces.Discrete):
            raise ValueError(
                f"--algo dqn needs a Discrete action space; --env {env_id} has {act_space} (try --algo sac)"
            )
        if not discrete and not isinstance(act_space, spaces.Box):
            raise ValueError(f"--algo {algo} needs a Box action space; --env {env_id} has {act_space} (try --algo dqn)")
        with doing(f"taking a first step of --env {env_id}"):
            _, info = env.reset(seed=seed)
            act_space.seed(seed)
            step_info = env.step(act_space.sample())[4]
        reports = any(isinstance(i, dict) and is_numeric_scalar(i.get("is_success")) for i in (info, step_info))
    finally:
        env.close()
    return EnvFacts(make, getattr(env.spec, "max_episode_steps", None), reports, env.spec)
