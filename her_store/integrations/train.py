"""The training job: an SB3 off-policy agent with HER on a disk store, checkpointed and resumable (``her-store train``).

A run lives in a run directory (``--out``): ``run.json`` (the options that define the run, written with the first
checkpoint: a start that fails before leaves nothing it made, so the corrected command is accepted), ``checkpoints/``
(the model and the replay buffer's handle, each checkpoint written under a temporary name and renamed into place)
and, unless ``--store`` says otherwise, ``store/`` (the episodes). Running the same command again resumes: the
model of the last checkpoint (Ctrl-C and SIGTERM write one before the job exits), every episode the store
committed (even those newer than the checkpoint) and the steps still to go. Training starts once ``learning_starts`` steps are done and an episode has ended (HER samples
whole committed episodes); the default ``learning_starts`` covers one episode of every env when the env's spec
gives its ``max_episode_steps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from gymnasium import spaces

from her_store.errors import NotAStoreError, StoreError
from her_store.format.card import json_object
from her_store.integrations import require
from her_store.storage.files import fsync_file
from her_store.store.episode_store import EpisodeStore

__all__ = [
    "DEFAULT_ENV",
    "OFF_POLICY_ALGOS",
    "Terminated",
    "TrainConfig",
    "TrainResult",
    "build_parser",
    "evaluate",
    "latest_checkpoint",
    "main",
    "save_checkpoint",
    "train",
]

DEFAULT_ENV = "her_store/BitFlipping-v0"
"""SB3's BitFlippingEnv (discrete actions for DQN, the continuous variant for the others), registered on import."""

OFF_POLICY_ALGOS = {"dqn": "DQN", "sac": "SAC", "td3": "TD3", "ddpg": "DDPG"}
"""``--algo`` names and the stable-baselines3 classes they train (HER needs an off-policy algorithm)."""

MAX_THREADS = 256
"""The most ``--threads`` accepted (torch crashes on absurd counts)."""

_ON_POLICY = {"ppo", "a2c", "trpo", "recurrentppo", "ars"}
GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
DEFAULT_N_BITS = 10

# Defaults per algorithm, on top of SB3's own; --algo-kwargs overrides them. DQN's are those of SB3's HER test on
# BitFlippingEnv (train every step on small batches, short epsilon schedule, slow target updates).
_ALGO_DEFAULTS: dict[str, dict[str, Any]] = {
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

# The options that define a run: resuming with a different value would mix two runs in one directory.
_RUN_KEYS = ("env", "algo", "store", "capacity", "strategy", "n_sampled_goal", "seed", "n_envs", "algo_kwargs")


def _register_default_env() -> None:
    import gymnasium as gym

    if DEFAULT_ENV not in gym.registry:
        gym.register(
            DEFAULT_ENV,
            entry_point="stable_baselines3.common.envs:BitFlippingEnv",
            kwargs={"n_bits": DEFAULT_N_BITS},
            max_episode_steps=DEFAULT_N_BITS,  # the env's own limit, told to the spec
            disable_env_checker=True,
        )


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "store", _absolute_store(self.store))

    @property
    def store_location(self) -> str:
        """The store's path or URL."""
        return self.store if self.store is not None else os.path.join(self.out, "store")


@dataclass(frozen=True)
class TrainResult:
    """What a run reached, as its summary table shows it.

    Examples
    --------
    >>> result = train(TrainConfig(out="runs/bits"))  # doctest: +SKIP
    >>> result.success_rate >= 0.9  # doctest: +SKIP
    True
    """

    steps: int
    resumed_from: int | None
    success_rate: float
    success_rule: str | None
    train_success_rate: float | None
    episodes: int
    transitions: int
    store_bytes: int | None
    rss_bytes: int
    peak_rss_bytes: int
    seconds: float
    store: str
    checkpoint: str

    def rows(self) -> list[tuple[str, str]]:
        """The summary table's rows: label, value."""
        judged = [] if self.success_rule in (None, "is_success") else [
            ("success judged by (no is_success)", self.success_rule)]
        return [
            ("success rate (deterministic)", "n/a" if np.isnan(self.success_rate) else f"{self.success_rate:.1%}"),
            *judged,
            ("success rate (last 100 training episodes)",
             "n/a" if self.train_success_rate is None else f"{self.train_success_rate:.1%}"),
            ("steps", f"{self.steps:,}" + ("" if self.resumed_from is None else f" (resumed from {self.resumed_from:,})")),
            ("episodes stored", f"{self.episodes:,}"),
            ("transitions stored", f"{self.transitions:,}"),
            (_bytes_label(self.store), "n/a" if self.store_bytes is None else _mib(self.store_bytes)),
            ("process resident memory (now / peak)", f"{_mib(self.rss_bytes)} / {_mib(self.peak_rss_bytes)}"),
            ("wall time", f"{self.seconds:.1f} s"),
            ("store", self.store),
            ("last checkpoint", self.checkpoint),
        ]


def _bytes_label(store: str) -> str:
    """Where the store's bytes are: on disk, in this process's memory, or at a remote filesystem."""
    if store.startswith("memory://"):
        return "store bytes in memory (gone at exit)"
    if "://" in store and not store.startswith("file://"):
        return f"store bytes at {store.split('://', 1)[0]}://"
    return "store bytes on disk"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


# -- checking the options ----------------------------------------------------------------------------------------
def _algo_class(name: str) -> type:
    key = name.lower()
    if key in _ON_POLICY:
        raise ValueError(
            f"--algo {name} is an on-policy algorithm; HER replays past transitions, so it needs an off-policy one: "
            f"{', '.join(OFF_POLICY_ALGOS)}"
        )
    if key not in OFF_POLICY_ALGOS:
        raise ValueError(f"--algo {name} is not an algorithm this job trains; expected one of {', '.join(OFF_POLICY_ALGOS)}")
    sb3 = require("stable_baselines3", "train")
    return getattr(sb3, OFF_POLICY_ALGOS[key])


@dataclass(frozen=True)
class _EnvFacts:
    """What the job learns of ``--env`` by making one: how to make it, its episode step limit (None when its spec
    does not say), whether its infos carry ``is_success`` (then stored, for the store's success figures) and its
    spec."""

    make: Callable[[], Any]
    max_episode_steps: int | None
    reports_success: bool
    spec: Any


def _env_factory(cfg: TrainConfig) -> _EnvFacts:
    """The facts of ``--env``, after checking once that it is a goal env the algorithm can drive (and taking one step
    of it, to see its infos)."""
    import gymnasium as gym

    _register_default_env()
    kwargs: dict[str, Any] = {}
    if cfg.env == DEFAULT_ENV and cfg.algo.lower() != "dqn":
        kwargs["continuous"] = True

    def make() -> Any:
        return gym.make(cfg.env, **kwargs)

    try:
        with _doing(f"making --env {cfg.env}"):
            env = make()
    except (gym.error.Error, ImportError) as e:  # NameNotFound, VersionNotFound, a module:name that cannot import
        raise ValueError(f"--env {cfg.env}: {e}") from None
    try:
        obs_space, act_space = env.observation_space, env.action_space
        missing = [k for k in GOAL_KEYS if not isinstance(obs_space, spaces.Dict) or k not in obs_space.spaces]
        if missing:
            raise ValueError(
                f"--env {cfg.env} is not a goal env: HER needs Dict observations with keys {', '.join(GOAL_KEYS)}; "
                f"its observation space is {obs_space} (missing {', '.join(missing)})"
            )
        if not callable(getattr(env.unwrapped, "compute_reward", None)):
            raise TypeError(f"--env {cfg.env} is not a goal env: it has no compute_reward(achieved_goal, desired_goal, info)")
        discrete = cfg.algo.lower() == "dqn"
        if discrete and not isinstance(act_space, spaces.Discrete):
            raise ValueError(f"--algo dqn needs a Discrete action space; --env {cfg.env} has {act_space} (try --algo sac)")
        if not discrete and not isinstance(act_space, spaces.Box):
            raise ValueError(f"--algo {cfg.algo} needs a Box action space; --env {cfg.env} has {act_space} (try --algo dqn)")
        from her_store.integrations.sb3 import _numeric

        with _doing(f"taking a first step of --env {cfg.env}"):
            _, info = env.reset(seed=cfg.seed)
            act_space.seed(cfg.seed)
            step_info = env.step(act_space.sample())[4]
        reports = any(isinstance(i, dict) and _numeric(i.get("is_success")) for i in (info, step_info))
    finally:
        env.close()
    return _EnvFacts(make, getattr(env.spec, "max_episode_steps", None), reports, env.spec)


def _check_numbers(cfg: TrainConfig) -> None:
    for name, least in (("steps", 1), ("capacity", 1), ("n_envs", 1), ("checkpoint_every", 1), ("n_sampled_goal", 0),
                        ("eval_episodes", 0), ("threads", 0)):
        if getattr(cfg, name) < least:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(cfg, name)}")
    if cfg.threads > MAX_THREADS:
        raise ValueError(f"--threads must be at most {MAX_THREADS} (0: torch's default), got {cfg.threads}")
    if cfg.strategy not in ("future", "final", "episode", "random"):
        raise ValueError(f"--strategy {cfg.strategy} is not a goal selection strategy; expected future, final, episode or random")


def _check_device(device: str) -> None:
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


@contextmanager
def _doing(what: str) -> Iterator[None]:
    """Name the step of the job an exception came from (a note on it), for the one-line error of :func:`main`."""
    try:
        yield
    except Exception as e:
        if not getattr(e, "__notes__", None):
            e.add_note(what)
        raise


# -- the run directory -------------------------------------------------------------------------------------------
def _run_record(cfg: TrainConfig) -> dict[str, Any]:
    record = {k: getattr(cfg, k) for k in _RUN_KEYS}
    record["store"] = cfg.store_location
    return record


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with _doing(f"writing {path}"), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _check_run_dir(cfg: TrainConfig) -> None:
    """Refuse options that would make the run recorded in ``run.json`` (if any) another run."""
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ValueError(f"--out {cfg.out} is a file; the run directory must be a directory (or a new path)")
    with _doing(f"creating the run directory --out {cfg.out}"):
        os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "run.json")
    if not os.path.exists(path):
        return
    record = _run_record(cfg)
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a run record of her-store train ({e}); pick another --out") from None
    if not isinstance(saved, dict):
        raise TypeError(f"{path} is not a run record of her-store train; pick another --out")
    for k in _RUN_KEYS:
        if saved.get(k) != record[k]:
            raise ValueError(
                f"{cfg.out} holds a run with --{k.replace('_', '-')} {saved.get(k)!r}, not {record[k]!r}; "
                f"run it with the same options to resume, or pick another --out"
            )


def _checkpoint(model: Any, cfg: TrainConfig) -> str:
    """Save a checkpoint of the run; the first one also writes ``run.json``, from when on the run exists.

    A start that fails before (a bad option the algorithm refuses, a store it cannot use) leaves no record, so the
    corrected command is accepted.
    """
    path = os.path.join(cfg.out, "run.json")
    if not os.path.exists(path):
        _write_atomic(path, json.dumps(_run_record(cfg), indent=1).encode())
    return save_checkpoint(model, cfg.out)


def _checkpoint_dir(out: str) -> str:
    return os.path.join(out, "checkpoints")


def latest_checkpoint(out: str) -> tuple[int, str] | None:
    """The step and directory of the newest complete checkpoint of a run directory, or None.

    Checkpoints are written as ``checkpoints/.step-<N>.tmp`` and renamed to ``checkpoints/step-<N>`` when complete,
    so a directory without the temporary prefix is whole (leftovers of a killed write are ignored here and removed
    by the next :func:`save_checkpoint`).

    Examples
    --------
    >>> latest_checkpoint("runs/bits")  # doctest: +SKIP
    (5000, 'runs/bits/checkpoints/step-000005000')
    """
    root = _checkpoint_dir(out)
    if not os.path.isdir(root):
        return None
    best: tuple[int, str] | None = None
    for name in os.listdir(root):
        if name.startswith("step-") and name[5:].isdigit() and (best is None or int(name[5:]) > best[0]):
            best = (int(name[5:]), os.path.join(root, name))
    return best


def save_checkpoint(model: Any, out: str) -> str:
    """Save ``model`` and its replay buffer's handle as the run's newest checkpoint, atomically; return its directory.

    Both files go to a temporary directory, are fsynced, and the directory is renamed into place: a process killed
    at any moment leaves the previous checkpoint whole. A write that fails (a full disk) removes its temporary
    directory and raises with a note naming the checkpoint. Older checkpoints and leftovers of killed writes are removed
    afterwards (the caller's buffer holds the store's writer lock, so no other run of this directory is writing).

    Examples
    --------
    >>> save_checkpoint(model, "runs/bits")  # doctest: +SKIP
    'runs/bits/checkpoints/step-000001000'
    """
    root = _checkpoint_dir(out)
    os.makedirs(root, exist_ok=True)
    name = f"step-{model.num_timesteps:09d}"
    final = os.path.join(root, name)
    if os.path.isdir(final):
        return final
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    try:
        with _doing(f"writing the checkpoint {final}"):
            os.makedirs(tmp)
            model.save(os.path.join(tmp, "model.zip"))
            model.save_replay_buffer(os.path.join(tmp, "replay_buffer.pkl"))
            for f in os.listdir(tmp):
                fsync_file(os.path.join(tmp, f))
            fsync_file(tmp)
            os.rename(tmp, final)
            fsync_file(root)
    except BaseException:  # a full disk, Ctrl-C: the previous checkpoint is whole, the partial one goes
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for other in os.listdir(root):
        if other.startswith((".step-", "step-")) and other != name:
            shutil.rmtree(os.path.join(root, other), ignore_errors=True)
    return final


# -- measuring ---------------------------------------------------------------------------------------------------
def _store_contents(cfg: TrainConfig) -> tuple[int, int, str, tuple[str, ...]] | None:
    """(episodes, transitions, url, info keys) committed in the run's store, or None when there is no store yet."""
    try:
        with EpisodeStore.open(cfg.store_location, "r", cfg.storage_options) as store:
            return store.num_episodes, store.num_transitions, store.url, store.info_keys
    except NotAStoreError:
        return None


def _bytes_on_disk(cfg: TrainConfig) -> int | None:
    loc = cfg.store_location
    if "://" not in loc or loc.startswith("file://"):
        path = loc.removeprefix("file://")
        # allocated blocks, not apparent sizes: chunk files are sparse until rows are written
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(loc, **(cfg.storage_options or {}))
        return int(fs.du(root))
    except (OSError, NotImplementedError, ValueError):
        return None


def _unmaker(url: str, storage_options: dict[str, Any] | None = None) -> Callable[[], None]:
    """A function removing what is made at ``url`` (a local path or an fsspec URL) from now on: all of it, with the
    local parent directories made for it, when nothing is there now; else what a directory there holds then and not
    now. Nothing that is there now is ever removed (where that cannot be read, nothing is)."""
    if "://" not in url or url.startswith("file://"):
        path = os.path.abspath(url.removeprefix("file://"))
        if not os.path.lexists(path):
            top = path
            while not os.path.lexists(os.path.dirname(top)):
                top = os.path.dirname(top)
            return lambda: shutil.rmtree(top, ignore_errors=True)
        if not os.path.isdir(path) or os.path.islink(path):
            return lambda: None
        held = set(os.listdir(path))

        def remove_new_entries() -> None:
            for name in set(os.listdir(path)) - held:
                entry = os.path.join(path, name)
                if os.path.isdir(entry) and not os.path.islink(entry):
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    os.remove(entry)

        return remove_new_entries
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        there = fs.exists(root)
        listed = set(fs.ls(root, detail=False)) if there and fs.isdir(root) else set()
    except Exception:  # noqa: BLE001 -- unreachable, no credentials: what is there is unknown, so nothing is removed
        return lambda: None

    def remove_new_objects() -> None:
        fs.invalidate_cache()
        if not there:
            if fs.exists(root):
                fs.rm(root, recursive=True)
            return
        for entry in set(fs.ls(root, detail=False)) - listed:
            fs.rm(entry, recursive=True)

    return remove_new_objects


def _card(cfg: TrainConfig, spec: Any) -> dict[str, Any]:
    """The dataset card of the run's store (:mod:`her_store.format.card`): the env, the algorithm, and the versions of the
    code that trained it (``requirements``: the pip requirements of the env, where its package is installed)."""
    import gymnasium
    import stable_baselines3
    import torch

    import her_store

    algo = f"{OFF_POLICY_ALGOS[cfg.algo.lower()]}+HER ({cfg.strategy})"
    modules = {"her_store": her_store, "stable_baselines3": stable_baselines3, "gymnasium": gymnasium, "torch": torch,
               "numpy": np}
    card: dict[str, Any] = {
        "env_id": cfg.env,
        "algorithm_name": algo,
        "description": f"the replay buffer of her-store train ({algo}, seed {cfg.seed})",
        "versions": {name: str(m.__version__) for name, m in modules.items()},
    }
    try:
        card["env_spec"] = spec.to_json()
    except (AttributeError, TypeError, ValueError):  # an entry point or kwargs that are not JSON
        pass
    entry = getattr(spec, "entry_point", None)
    module = entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
    requirements = [_requirement(m) for m in ("gymnasium", module)]
    card["requirements"] = list(dict.fromkeys(r for r in requirements if r is not None))
    return card


def _requirement(module: str) -> str | None:
    """``name==version`` of the installed distribution of ``module``'s top-level package, or None."""
    from importlib import metadata

    try:
        dist = metadata.distribution(module.partition(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None
    return f"{dist.metadata['Name']}=={dist.version}"


def _memory() -> tuple[int, int]:
    """Resident memory of this process now and at its peak, in bytes."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return peak, peak


SUCCESS_BY_REWARD = "reward of reaching the goal"
"""The success rule of an env whose infos have no ``is_success`` (the sampler's default ``success_fn`` rule): the
``compute_reward(ag, g, info)`` of the last achieved goal ``ag`` and the desired goal ``g`` is the reward of reaching
the goal, ``compute_reward(ag, ag, info)``."""


def _episode_succeeded(env: Any, obs: dict[str, Any], info: dict[str, Any]) -> tuple[bool, str]:
    """Whether an episode ending with ``obs`` and ``info`` reached its goal, and the rule that said so.

    ``info["is_success"]`` when the env reports it; otherwise the reward of the last achieved goal for the desired
    goal is that of reaching it (:data:`SUCCESS_BY_REWARD`), as the sampler's default ``success_fn`` decides.
    """
    if "is_success" in info:
        return bool(info["is_success"]), "is_success"
    compute_reward = env.unwrapped.compute_reward
    achieved, desired = np.asarray(obs["achieved_goal"]), np.asarray(obs["desired_goal"])
    reward = np.asarray(compute_reward(achieved, desired, info), np.float64)
    reached = np.asarray(compute_reward(achieved, achieved, info), np.float64)
    return bool(np.all(reward >= reached)), SUCCESS_BY_REWARD


def _evaluate(model: Any, make_env: Callable[[], Any], episodes: int, seed: int) -> tuple[float, str | None]:
    """:func:`evaluate`, and the success rule it used (None when no episode ran)."""
    if episodes == 0:
        return float("nan"), None
    env = make_env()
    successes, rules = [], set()
    try:
        for i in range(episodes):
            obs, info = env.reset(seed=seed + i)
            done = False
            while not done:
                action, _ = model.predict(obs, deterministic=True)
                obs, _, terminated, truncated, info = env.step(action)
                done = terminated or truncated
            success, rule = _episode_succeeded(env, obs, info)
            successes.append(float(success))
            rules.add(rule)
    finally:
        env.close()
    return float(np.mean(successes)), " / ".join(sorted(rules))


def evaluate(model: Any, make_env: Callable[[], Any], episodes: int, seed: int) -> float:
    """Success rate of the deterministic policy over ``episodes`` episodes (NaN when ``episodes`` is 0).

    An episode succeeded when its last info says ``is_success``; an env whose infos have no ``is_success`` is judged
    by its reward instead: the episode succeeded when ``compute_reward`` of the last achieved goal and the desired
    goal is the reward of reaching the goal, ``compute_reward(ag, ag, info)`` (the sampler's default success rule).

    Examples
    --------
    >>> evaluate(model, lambda: gym.make("her_store/PointGoal-v0"), 20, seed=0)  # doctest: +SKIP
    0.95
    """
    return _evaluate(model, make_env, episodes, seed)[0]


# -- the job -----------------------------------------------------------------------------------------------------
def _checkpoint_callback(cfg: TrainConfig, has_episodes: bool) -> Any:
    """Checkpoints every ``cfg.checkpoint_every`` steps; and no training before an episode has ended (HER samples
    committed episodes only), whatever ``learning_starts`` says: an env without a known episode limit may run
    longer episodes than ``learning_starts`` steps."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Checkpoints(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last = 0
            self.ended = False

        def _on_training_start(self) -> None:
            self.last = self.num_timesteps
            self.ended = has_episodes

        def _on_step(self) -> bool:
            self.ended = self.ended or bool(np.any(self.locals["dones"]))
            if self.num_timesteps - self.last >= cfg.checkpoint_every:
                _checkpoint(self.model, cfg)
                self.last = self.num_timesteps
            return True

        def _on_rollout_end(self) -> None:
            if not self.ended:  # called before the algorithm decides whether to train
                self.model.learning_starts = max(self.model.learning_starts, self.num_timesteps)

    return Checkpoints()


def _final_checkpoint(model: Any, cfg: TrainConfig) -> str:
    """The last checkpoint of a run that stops: its unfinished episodes end here, as truncated (closing the buffer
    would end them anyway), so that the store holds nothing newer than the checkpoint and a resumed run starts from
    both as they were."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SB3's truncation warning speaks of a buffer being loaded
        model.replay_buffer.truncate_last_trajectory()
    return _checkpoint(model, cfg)


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes; return what it reached.

    The store records ``is_success`` when the env's infos carry it (a store that exists keeps its own info keys),
    and a new store's dataset card names the env, the algorithm and the versions of the code that trained it. A
    first attempt that fails before its first checkpoint removes what it made: the run directory, the store, the
    parent directories they needed (never anything that was there before).

    Parameters
    ----------
    cfg : TrainConfig
        The run.
    log : callable
        Where the job's messages go (one line each).

    Raises
    ------
    ValueError
        An option the job cannot use (an unknown or non-goal env, an on-policy algorithm, a run directory that
        holds another run, ...), named in the message.
    StoreError
        The store cannot be used (another writer holds it, its spaces are not the env's, ...).

    Examples
    --------
    >>> result = train(TrainConfig(out="runs/bits"))  # doctest: +SKIP
    >>> print(f"{result.success_rate:.0%}")  # doctest: +SKIP
    100%
    """
    t0 = time.perf_counter()
    _check_numbers(cfg)
    algo_cls = _algo_class(cfg.algo)
    env_facts = _env_factory(cfg)
    from torch import set_num_threads

    _check_device(cfg.device)
    if cfg.threads:
        set_num_threads(cfg.threads)
    record = os.path.join(cfg.out, "run.json")
    first = not os.path.exists(record)
    unmake_out = _unmaker(cfg.out)
    unmake_store = _unmaker(cfg.store_location, cfg.storage_options)
    _check_run_dir(cfg)
    store_is_new = False
    try:
        with _doing(f"reading the store {cfg.store_location}"):
            before = _store_contents(cfg)
        store_is_new = before is None
        return _train(cfg, log, algo_cls, env_facts, before, t0)
    except BaseException:
        if first and not os.path.exists(record):  # no run was recorded: this attempt leaves nothing it made
            if store_is_new:
                unmake_store()
            unmake_out()
        raise


def _train(
    cfg: TrainConfig, log: Callable[[str], None], algo_cls: type, env_facts: _EnvFacts,
    before: tuple[int, int, str, tuple[str, ...]] | None, t0: float,
) -> TrainResult:
    """:func:`train` once the options are checked, the run directory made and the store's contents read."""
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import DummyVecEnv

    from her_store.integrations.sb3 import ZarrHerReplayBuffer

    if cfg.store_location.startswith("memory://"):
        log(f"note: --store {cfg.store_location} is held in this process's memory: it does not outlive the run, "
            "so a resumed run starts with an empty store")
    ckpt = latest_checkpoint(cfg.out)
    env = DummyVecEnv([env_facts.make] * cfg.n_envs)
    resumed_from = None
    if ckpt is not None:
        with _doing(f"loading the checkpoint {ckpt[1]}"):
            model = algo_cls.load(os.path.join(ckpt[1], "model.zip"), env=env, device=cfg.device)
            # load() built a buffer on the store from the saved kwargs; the checkpoint's handle replaces it (sampler
            # state, unfinished episodes), and it must release the store's writer lock first
            model.replay_buffer.close()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.load_replay_buffer(os.path.join(ckpt[1], "replay_buffer.pkl"))
        for w in caught:  # what became of the checkpoint's unfinished episodes: a line each, not a warning dump
            log(f"note: {str(w.message).splitlines()[0]}")
        resumed_from = model.num_timesteps
        model.set_random_seed(cfg.seed + model.num_timesteps)
        episodes = 0 if before is None else before[0]
        log(f"resuming from step {model.num_timesteps:,}, {episodes:,} episodes in the store")
        if episodes == 0:  # the store was removed or replaced: collect learning_starts steps again before training
            model.learning_starts += model.num_timesteps
            log(f"the store is empty: training starts again after {model.learning_starts:,} steps")
    else:
        if before is not None and before[0]:
            log(f"starting at step 0 (no checkpoint yet); the store already holds {before[0]:,} episodes, kept")
        kwargs = {**_ALGO_DEFAULTS[cfg.algo.lower()], **cfg.algo_kwargs}
        if env_facts.max_episode_steps and "learning_starts" not in cfg.algo_kwargs:
            # HER samples whole committed episodes: let every env finish one before training starts
            kwargs["learning_starts"] = max(kwargs["learning_starts"], cfg.n_envs * env_facts.max_episode_steps)
        # infos stored: is_success when the env reports it (success figures of inspect and plot); a store that
        # exists keeps its own info keys
        info_keys = list(before[3]) if before is not None else ["is_success"] if env_facts.reports_success else []
        with _doing(f"building the {OFF_POLICY_ALGOS[cfg.algo.lower()]} model"):
            model = algo_cls(
                "MultiInputPolicy",
                env,
                buffer_size=cfg.capacity,
                replay_buffer_class=ZarrHerReplayBuffer,
                replay_buffer_kwargs={
                    "path": cfg.store_location,
                    "storage_options": cfg.storage_options,
                    "n_sampled_goal": cfg.n_sampled_goal,
                    "goal_selection_strategy": cfg.strategy,
                    **({"copy_info_dict": True, "info_keys": info_keys} if info_keys else {}),
                },
                seed=cfg.seed,
                device=cfg.device,
                **kwargs,
            )
    # SB3's default logger makes a directory per learn() that nothing writes to; the job's own summary is its log
    model.set_logger(Logger(folder=None, output_formats=[]))
    remaining = cfg.steps - model.num_timesteps
    try:
        if ckpt is None:  # the card's fields the store lacks: a store made before keeps what its card says
            with _doing(f"writing the dataset card of {cfg.store_location}"):
                store = model.replay_buffer.store
                card = store.metadata
                store.update_metadata(**{k: v for k, v in _card(cfg, env_facts.spec).items() if k not in card})
        if remaining > 0:
            with _doing(f"training from step {model.num_timesteps:,}"):
                model.learn(
                    remaining,
                    callback=_checkpoint_callback(cfg, before is not None and before[0] > 0),
                    reset_num_timesteps=False,
                    progress_bar=cfg.progress,
                )
        else:
            log(f"the run already did {model.num_timesteps:,} of its {cfg.steps:,} steps; evaluating only")
        checkpoint = _final_checkpoint(model, cfg)
        with _doing("evaluating the policy"):
            success, rule = _evaluate(model, env_facts.make, cfg.eval_episodes, cfg.seed + 1_000_000)
    except KeyboardInterrupt as e:
        _final_checkpoint(model, cfg)
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        log(f"{how} at step {model.num_timesteps:,}; checkpoint saved, run the same command to resume")
        raise
    finally:
        failing = sys.exc_info()[1] is not None
        try:
            with _doing(f"committing to the store {cfg.store_location}"):
                model.replay_buffer.close()  # commits what is staged and releases the store's writer lock
        except Exception:
            if not failing:  # else the error that stopped the run is the one to report
                raise
        finally:
            env.close()
    train_success = float(np.mean(model.ep_success_buffer)) if len(model.ep_success_buffer) else None
    episodes, transitions, url, _ = _store_contents(cfg) or (0, 0, cfg.store_location, ())
    rss, peak = _memory()
    return TrainResult(
        steps=model.num_timesteps,
        resumed_from=resumed_from,
        success_rate=success,
        success_rule=rule,
        train_success_rate=train_success,
        episodes=episodes,
        transitions=transitions,
        store_bytes=_bytes_on_disk(cfg),
        rss_bytes=rss,
        peak_rss_bytes=peak,
        seconds=time.perf_counter() - t0,
        store=url,
        checkpoint=checkpoint,
    )


# -- command line ------------------------------------------------------------------------------------------------
def build_parser(prog: str = "her-store train") -> argparse.ArgumentParser:
    """The options of ``her-store train`` (and ``tools/train.py``).

    Examples
    --------
    >>> build_parser().parse_args(["--algo", "sac", "--steps", "5000"]).algo
    'sac'
    """
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train an SB3 off-policy agent with HER on a disk-backed episode store; run again to resume.",
        allow_abbrev=False,
    )
    p.add_argument("--env", default=d.env,
                   help="registered gymnasium goal env id (default: SB3's BitFlippingEnv, "
                        f"{DEFAULT_N_BITS} bits, continuous actions for sac/td3/ddpg)")
    p.add_argument("--algo", default=d.algo, help=f"off-policy algorithm: {', '.join(OFF_POLICY_ALGOS)} (default: dqn)")
    p.add_argument("--out", default=d.out, help=f"run directory: checkpoints, run.json, the store (default: ./{d.out})")
    p.add_argument("--store", default=None, help="store path or fsspec URL (default: <out>/store)")
    p.add_argument("--storage-options", type=json_object, default=None, help="fsspec options of a store URL, as JSON")
    p.add_argument("--steps", type=int, default=d.steps, help=f"total environment steps (default: {d.steps:,})")
    p.add_argument("--capacity", type=int, default=d.capacity, help="replay capacity in transitions (default: 1,000,000)")
    p.add_argument("--strategy", default=d.strategy, help="goal selection: future, final, episode, random (default: future)")
    p.add_argument("--n-sampled-goal", type=int, default=d.n_sampled_goal, help="relabelled goals per transition (default: 4)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--n-envs", type=int, default=d.n_envs, help="environments stepped together (default: 1)")
    p.add_argument("--eval-episodes", type=int, default=d.eval_episodes,
                   help=f"episodes of the deterministic policy measuring the success rate (default: {d.eval_episodes})")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help=f"steps between checkpoints (default: {d.checkpoint_every:,})")
    p.add_argument("--algo-kwargs", type=json_object, default={},
                   help="extra algorithm arguments as JSON, e.g. '{\"learning_rate\": 0.001}'")
    p.add_argument("--device", default=d.device, help="torch device (default: auto)")
    p.add_argument("--threads", type=int, default=d.threads,
                   help="torch intra-op threads (default: 1, fastest for small networks; 0: torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's or ``docker stop``'s), raised where the job runs so that it stops as on Ctrl-C.

    :func:`main` raises it from its SIGTERM handler: the run writes its checkpoint and ``main`` returns 143.

    Examples
    --------
    >>> issubclass(Terminated, KeyboardInterrupt)
    True
    """


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


# errors whose message says what was wrong by itself (the job's own checks, the store's)
_CLEAR_ERRORS = (ValueError, TypeError, ImportError, StoreError, OSError)


def _one_line(e: BaseException) -> str:
    """``<what failed>: <Type>: <message>`` (an error of the job's own checks: its message alone), on one line."""
    message = " ".join(str(e).split())
    notes = getattr(e, "__notes__", None)
    if not notes:
        return message if isinstance(e, _CLEAR_ERRORS) else f"{type(e).__name__}: {message}"
    return f"{notes[0]}: {type(e).__name__}: {message}".rstrip(": ")


def main(argv: Sequence[str] | None = None, prog: str = "her-store train") -> int:
    """Run ``her-store train`` with ``argv``; print the summary table; return the exit status.

    Every failure prints one line, never a traceback: the job's own checks their message, other errors
    ``her-store train: error: <what failed>: <Type>: <message>``. Bad options and unusable stores or files
    (ValueError, TypeError, ImportError, StoreError, OSError) return 2, any other error 1. Ctrl-C saves a
    checkpoint and returns 130; SIGTERM does the same and returns 143.

    Examples
    --------
    >>> main(["--steps", "5000", "--out", "runs/bits"])  # doctest: +SKIP
    0
    """
    from her_store.ops.inspect import print_table

    args = build_parser(prog).parse_args(argv)
    cfg = TrainConfig(
        env=args.env, algo=args.algo.lower(), out=args.out, store=args.store, steps=args.steps,
        capacity=args.capacity, strategy=args.strategy, n_sampled_goal=args.n_sampled_goal, seed=args.seed,
        n_envs=args.n_envs, eval_episodes=args.eval_episodes, checkpoint_every=args.checkpoint_every,
        algo_kwargs=args.algo_kwargs, storage_options=args.storage_options, device=args.device,
        threads=args.threads, progress=not args.quiet,
    )
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        result = train(cfg, log=lambda msg: print(msg, flush=True))
    except Terminated:
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 -- one line, never a traceback: what failed, and the error
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, _CLEAR_ERRORS) else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_table(f"her-store train: {cfg.env}, {cfg.algo.upper()}+HER ({cfg.strategy})", result.rows())
    return 0
