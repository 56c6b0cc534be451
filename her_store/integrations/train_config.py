"""What a training run is: TrainConfig, the algorithms it trains with their defaults, and the checks of its options.

Every field of :class:`TrainConfig` is a command-line option of ``her-store train``; :data:`RUN_KEYS` are those that
define a run (a resumed run must have the same).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from her_store.integrations import require
from her_store.integrations.train_env import DEFAULT_ENV

__all__ = [
    "ALGO_DEFAULTS",
    "MAX_THREADS",
    "OFF_POLICY_ALGOS",
    "RUN_KEYS",
    "TrainConfig",
    "algo_class",
    "check_device",
    "check_numbers",
]

OFF_POLICY_ALGOS = {"dqn": "DQN", "sac": "SAC", "td3": "TD3", "ddpg": "DDPG"}
"""``--algo`` names and the stable-baselines3 classes they train (HER needs an off-policy algorithm)."""

MAX_THREADS = 256
"""The most ``--threads`` accepted (torch crashes on absurd counts)."""

_ON_POLICY = {"ppo", "a2c", "trpo", "recurrentppo", "ars"}

# Defaults per algorithm, on top of SB3's own; --algo-kwargs overrides them. DQN's are those of SB3's HER test on
# BitFlippingEnv (train every step on small batches, short epsilon schedule, slow target updates).
ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
    "dqn": {
        "learning_rate": 5e-4,
        "train_freq": 1,
        "learning_starts": 100,
        "batch_size": 32,
        "exploration_final_eps": 0.02,
        "target_update_interval": 500,
    },
    "sac": {"learning_starts": 200, "batch_size": 256},
    "td3": {"learning_starts": 200, "batch_size": 256},
    "ddpg": {"learning_starts": 200, "batch_size": 256},
}

RUN_KEYS = (
    "env", "algo", "store", "capacity", "strategy", "n_sampled_goal", "seed", "n_envs", "algo_kwargs", "prioritize",
)
"""The options that define a run: resuming with a different value would mix two runs in one directory."""


def _absolute_store(store: str | None) -> str | None:
    """A local store path, or ``file://`` URL, as an absolute path; other URLs (and None) as given."""
    if store is None or ("://" in store and not store.startswith("file://")):
        return store
    return os.path.abspath(os.path.expanduser(store.removeprefix("file://")))


@dataclass(frozen=True)
class TrainConfig:
    """What a training run does; every field is a command-line option of ``her-store train``.

    Parameters
    ----------
    env : str
        A registered gymnasium goal env id (Dict observations with ``observation``, ``achieved_goal`` and
        ``desired_goal``, and ``compute_reward``). Default: SB3's BitFlippingEnv, continuous for SAC/TD3/DDPG.
    algo : str
        ``dqn``, ``sac``, ``td3`` or ``ddpg``.
    out : str
        The run directory (checkpoints, ``run.json`` and, by default, the store).
    store : str or None
        Where the episodes go: a path or an fsspec URL (a ``memory://`` store does not outlive the process, so a
        resumed run starts with it empty). None: ``<out>/store``. A local path (or ``file://`` URL) is
        made absolute, so the run's record names the same store from any working directory.
    steps : int
        Total environment steps of the run (resumed runs count the steps already done).
    capacity : int
        Replay capacity in transitions (the store is a ring of whole episodes that size).
    strategy : str
        Goal selection strategy: ``future``, ``final``, ``episode`` or ``random``.
    n_sampled_goal : int
        Relabelled goals per real transition (her_ratio = 1 - 1/(n_sampled_goal + 1)).
    seed : int
        Seed of the run; a resumed run reseeds with ``seed + steps done`` so it does not replay the same draws.
    n_envs : int
        Environments stepped together (a DummyVecEnv).
    eval_episodes : int
        Episodes of the deterministic policy run at the end to measure the success rate.
    checkpoint_every : int
        Steps between checkpoints (one is also written at the end, and on Ctrl-C).
    algo_kwargs : dict
        Extra constructor arguments of the algorithm (override the job's defaults). The default ``learning_starts``
        is at least ``n_envs`` times the env's ``max_episode_steps`` (when its spec has one), so that every env has
        committed an episode before the first sample.
    storage_options : dict or None
        fsspec options of a store URL (credentials, endpoint).
    device : str
        Torch device of the model and of sampled batches.
    threads : int
        Torch intra-op threads (the small networks of HER tasks run fastest on one; 0 leaves torch's default).
    progress : bool
        Show a progress bar.
    prioritize : str or None
        ``"energy"``: the buffer draws episodes by the energy of their achieved-goal path (energy-based
        prioritization); None draws uniformly.

    Examples
    --------
    >>> cfg = TrainConfig(out="runs/bits", steps=20_000)
    >>> cfg.algo, cfg.strategy
    ('dqn', 'future')
    """

    env: str = DEFAULT_ENV
    algo: str = "dqn"
    out: str = "her_store_run"
    store: str | None = None
    steps: int = 5_000
    capacity: int = 1_000_000
    strategy: str = "future"
    n_sampled_goal: int = 4
    seed: int = 0
    n_envs: int = 1
    eval_episodes: int = 50
    checkpoint_every: int = 1_000
    algo_kwargs: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None
    device: str = "auto"
    threads: int = 1
    progress: bool = True
    prioritize: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", _absolute_store(self.store))

    @property
    def store_location(self) -> str:
        """The store's path or URL."""
        return self.store if self.store is not None else os.path.join(self.out, "store")


def algo_class(name: str) -> type:
    key = name.lower()
    if key in _ON_POLICY:
        raise ValueError(
            f"--algo {name} is an on-policy algorithm; HER replays past transitions, so it needs an off-policy one: "
            f"{', '.join(OFF_POLICY_ALGOS)}"
        )
    if key not in OFF_POLICY_ALGOS:
        raise ValueError(
            f"--algo {name} is not an algorithm this job trains; expected one of {', '.join(OFF_POLICY_ALGOS)}"
        )
    sb3 = require("stable_baselines3", "train")
    return getattr(sb3, OFF_POLICY_ALGOS[key])


def check_numbers(cfg: TrainConfig) -> None:
    for name, least in (("steps", 1), ("capacity", 1), ("n_envs", 1), ("checkpoint_every", 1), ("n_sampled_goal", 0),
                        ("eval_episodes", 0), ("threads", 0)):
        if getattr(cfg, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(cfg, name)}")
    if cfg.threads > MAX_THREADS:
        raise ValueError(f"--threads must be at most {MAX_THREADS} (0: torch's default), got {cfg.threads}")
    if cfg.prioritize not in (None, "energy"):
        raise ValueError(f"--prioritize {cfg.prioritize} is not a prioritization this job trains with; expected energy")
    if cfg.strategy not in ("future", "final", "episode", "random"):
        raise ValueError(
            f"--strategy {cfg.strategy} is not a goal selection strategy; expected future, final, episode or random"
        )


def check_device(device: str) -> None:
    import torch

    if device == "auto":
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device} is not a torch device; expected e.g. auto, cpu, cuda, cuda:1") from None
    available = {"cpu": lambda: True, "cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}
    if not available.get(dev.type, lambda: True)():
        raise ValueError(f"--device {device}: no {dev.type} device is available here (try --device cpu)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} cuda devices")
