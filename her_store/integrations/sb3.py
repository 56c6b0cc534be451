"""ZarrHerReplayBuffer: stable-baselines3's HerReplayBuffer, with the episodes in a disk-backed her_store store.

Pass it as ``replay_buffer_class`` to any SB3 off-policy algorithm (SAC, TD3, DDPG, DQN): steps go through a
:class:`~her_store.writer.StepWriter`, batches come from a :class:`~her_store.sampler.HerSampler` with SB3's
relabelling (her_ratio split, future/final/episode formulas, rewards from the env's ``compute_reward``), and
``save_replay_buffer`` writes a small handle to the store instead of the data.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces

from her_store.errors import NotAStoreError, StoreError
from her_store.integrations import require
from her_store.relabel import GoalSelectionStrategy, GoalStrategy, parse_strategy
from her_store.store import EpisodeStore, open_store

_her = require("stable_baselines3.her", "sb3")
_types = require("stable_baselines3.common.type_aliases", "sb3")
_utils = require("stable_baselines3.common.utils", "sb3")
_preprocessing = require("stable_baselines3.common.preprocessing", "sb3")

__all__ = ["ZarrHerReplayBuffer"]

_GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
# info entries SB3 and gymnasium use for their own bookkeeping: never stored as info keys
_RESERVED_INFO = ("TimeLimit.truncated", "terminal_observation", "episode", "_final_observation", "_final_info")
_HANDLE_VERSION = 1
_NO_EPISODE = (
    "Unable to sample before the end of the first episode. We recommend choosing a value for learning_starts that is "
    "greater than the maximum number of timesteps in the environment."
)


class _Resources:
    """What a buffer owns outside Python: the store, its sampler and (for ``path=None``) a temporary directory.

    Held apart from the buffer so that a finalizer can release them when the buffer is garbage collected (SB3's
    ``load_replay_buffer`` drops the old buffer before the new one opens the store).
    """

    def __init__(self) -> None:
        self.store: EpisodeStore | None = None
        self.sampler: Any = None
        self.tmpdir: str | None = None
        self.keep_tmpdir = False

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        if self.store is not None:
            self.store.close()
            self.store = None
        if self.tmpdir is not None and not self.keep_tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


def _env_method(ref: weakref.ref, method: str) -> Callable[[np.ndarray, np.ndarray, Any], np.ndarray]:
    """``fn(achieved, desired, infos)`` calling ``method`` of the buffer's env 0 as SB3 does (one call per batch).

    Reads the env at call time (SB3 sets it after loading) through a weak reference, so the sampler holding the
    function does not keep the buffer alive.
    """

    def call(achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
        buffer = ref()
        env = None if buffer is None else buffer.env
        if env is None:
            raise ValueError(
                f"ZarrHerReplayBuffer needs a VecEnv to call {method}() for relabelled transitions; pass env=... or "
                "call set_env(env) (SB3 does both)"
            )
        return np.asarray(env.env_method(method, achieved, desired, infos, indices=[0])[0])

    return call


class ZarrHerReplayBuffer(_her.HerReplayBuffer):
    """SB3's HerReplayBuffer with the transitions in a persistent her_store store on disk or object storage.

    A drop-in: ``SAC(..., replay_buffer_class=ZarrHerReplayBuffer, replay_buffer_kwargs=dict(path="runs/rb",
    n_sampled_goal=4, goal_selection_strategy="future"))``. No RAM arrays are allocated; RAM use does not grow
    with ``buffer_size``.

    Parameters
    ----------
    buffer_size : int
        Capacity in transitions (the store's FIFO ring of whole episodes), as SB3's ``buffer_size``.
    observation_space : gymnasium.spaces.Dict
        With ``observation``, ``achieved_goal`` and ``desired_goal``.
    action_space : gymnasium.spaces.Space
    env : VecEnv, optional
        Set by SB3; its env 0's ``compute_reward`` (and ``compute_terminated``) relabel sampled transitions.
    device : torch.device or str
        Where batches go; may be reassigned after construction.
    n_envs : int
        Environments stepped together.
    optimize_memory_usage : bool
        Must be False (SB3's HerReplayBuffer refuses it too).
    handle_timeout_termination : bool
        True: a truncation (``infos[i]["TimeLimit.truncated"]``) does not stop bootstrapping
        (``dones = done * (1 - timeout)``); False: every episode end is a terminal ``done``.
    n_sampled_goal : int
        Virtual transitions per real one: ``her_ratio = 1 - 1 / (n_sampled_goal + 1)``.
    goal_selection_strategy : str, SB3's or her_store's GoalSelectionStrategy, or callable
        "future", "final", "episode" (SB3), "random" (a goal from anywhere in the buffer, as stable-baselines v2),
        or a callable taking a :class:`~her_store.relabel.GoalContext`.
    copy_info_dict : bool
        Store numeric info entries (e.g. ``is_success``) and pass them to ``compute_reward`` as one dict per
        transition. Only the stored keys are passed (SB3 passes whole info dicts).
    path : str or PathLike, optional
        Local directory or fsspec URL of the store: created if absent, resumed if present (its spaces, capacity
        and info keys must match). None: a fresh temporary directory, removed at close unless a handle of the
        buffer was saved (``save_replay_buffer``/pickle), which keeps it for the handle to reopen.
    storage_options : mapping, optional
        fsspec options for URLs (saved in the handle, like SB3 saves replay_buffer_kwargs with a model).
    relabel_terminated : bool
        Mark a relabelled transition done when its goal is reached: the env's ``compute_terminated(achieved,
        desired, infos)`` (called vectorised, one call per batch) if it has one, else ``compute_reward`` reaching
        its maximum. False (default) keeps SB3's dones.
    prefetch : int
        Batches prepared ahead in a background thread (0: none).
    io_threads : int
        Threads a gather is split across (8-32 for a store larger than RAM).
    info_keys : sequence of str, optional
        With ``copy_info_dict``: the info entries to store. Default: the numeric scalar entries of the first
        ``add``'s infos (SB3's ``TimeLimit.truncated`` and ``terminal_observation`` excluded); the store is then
        created at the first ``add``.

    Attributes
    ----------
    store : EpisodeStore or None
        The open store (None before the first ``add`` when its info keys are inferred, and after :meth:`close`).

    Notes
    -----
    ``save_replay_buffer``/pickle write a handle (store URL, spaces, configuration, unfinished episodes), not the
    data; loading it reopens the store, needing no env. ``copy.deepcopy`` copies a local store into a fresh
    temporary directory (an independent buffer, removed at close); a store on object storage is not copied.
    ``reset()`` restarts ``pos``/``size()`` as SB3's does and keeps the stored episodes (SB3's HER buffer
    still samples them too).

    Examples
    --------
    >>> from stable_baselines3 import SAC  # doctest: +SKIP
    >>> model = SAC("MultiInputPolicy", env, replay_buffer_class=ZarrHerReplayBuffer,  # doctest: +SKIP
    ...             replay_buffer_kwargs=dict(path="runs/rb", n_sampled_goal=4, goal_selection_strategy="future"))
    >>> model.learn(10_000)  # doctest: +SKIP
    >>> model.save_replay_buffer("rb_handle")  # a few KB, milliseconds  # doctest: +SKIP
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        env: Any = None,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        n_sampled_goal: int = 4,
        goal_selection_strategy: Any = "future",
        copy_info_dict: bool = False,
        *,
        path: str | os.PathLike[str] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        relabel_terminated: bool = False,
        prefetch: int = 0,
        io_threads: int = 0,
        info_keys: Sequence[str] | None = None,
    ) -> None:
        _check_spaces(observation_space, action_space)
        if optimize_memory_usage:
            raise ValueError(
                "ZarrHerReplayBuffer does not support optimize_memory_usage=True (SB3's HerReplayBuffer refuses it "
                "too); pass optimize_memory_usage=False"
            )
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
            raise ValueError(f"buffer_size must be a positive int (transitions), got {buffer_size!r}")
        if isinstance(n_envs, bool) or not isinstance(n_envs, (int, np.integer)) or n_envs < 1:
            raise ValueError(f"n_envs must be a positive int, got {n_envs!r}")
        if isinstance(n_sampled_goal, bool) or not isinstance(n_sampled_goal, (int, np.integer)) or n_sampled_goal < 0:
            raise ValueError(f"n_sampled_goal must be an int >= 0, got {n_sampled_goal!r}")
        if info_keys is not None and not copy_info_dict:
            raise ValueError("info_keys is only used with copy_info_dict=True; pass copy_info_dict=True or drop it")
        # BaseBuffer's attributes, set here because super().__init__ (which allocates the RAM arrays) is skipped
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = {k: s.shape for k, s in observation_space.spaces.items()}
        self.action_dim = _preprocessing.get_action_dim(action_space)
        self.total_capacity = int(buffer_size)
        self.buffer_size = max(int(buffer_size) // int(n_envs), 1)
        self.n_envs = int(n_envs)
        self.device = _utils.get_device(device)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = bool(handle_timeout_termination)
        self.env = env
        self.copy_info_dict = bool(copy_info_dict)
        self.n_sampled_goal = int(n_sampled_goal)
        self.her_ratio = 1 - (1.0 / (self.n_sampled_goal + 1))
        self.goal_selection_strategy = _strategy(goal_selection_strategy)
        self.path = None if path is None else os.fspath(path)
        self.storage_options = None if storage_options is None else dict(storage_options)
        self.relabel_terminated = bool(relabel_terminated)
        self.prefetch = int(prefetch)
        self.io_threads = int(io_threads)
        self.info_keys = None if info_keys is None else tuple(info_keys)
        # SB3 seeds numpy's global generator (set_random_seed); the sampler's seed is drawn from it, so a seeded
        # model samples the same batches
        self._seed = int(np.random.randint(0, 2**31 - 1))
        self._added = 0
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._writer: Any = None
        if self.path is None:
            self._res.tmpdir = tempfile.mkdtemp(prefix="her_store_sb3_")
            self.url = os.path.join(self._res.tmpdir, "store")
        else:
            self.url = self.path
        if not self.copy_info_dict or self.info_keys is not None:
            self._open(self.info_keys or ())
        elif self.path is not None:
            self._resume_if_present()

    # -- the store -----------------------------------------------------------------------------------------
    @property
    def store(self) -> EpisodeStore | None:
        return self._res.store

    def _open(self, info_keys: Sequence[str] | None) -> EpisodeStore:
        """Create or resume the store (``info_keys=None``: the stored ones), then a writer for ``n_envs``."""
        kwargs: dict[str, Any] = {"capacity": self.total_capacity}
        if info_keys is not None:
            kwargs["info_keys"] = list(info_keys)
        if self.storage_options is not None:
            kwargs["storage_options"] = self.storage_options
        store = open_store(self.url, self.observation_space, self.action_space, **kwargs)
        self._res.store = store
        self._writer = store.writer(self.n_envs)
        self.info_keys = store.info_keys
        if self._added == 0:  # a resumed store: SB3's row counter as if its transitions had been added here
            self._added = -(-len(store) // self.n_envs)
        return store

    def _resume_if_present(self) -> None:
        """With inferred info keys: resume an existing store now (its info keys are known), else wait for add."""
        try:
            EpisodeStore.open(self.url, mode="r", storage_options=self.storage_options).close()
        except NotAStoreError:
            return
        self._open(None)

    def _require_store(self) -> EpisodeStore:
        store = self._res.store
        if store is None:
            if self._writer is not None:
                raise StoreError(f"the buffer's store {self.url} is closed")
            return self._open(self.info_keys)
        return store

    def close(self) -> None:
        """Commit what is staged and release the store (and remove a temporary one). Unfinished episodes are lost
        unless :meth:`truncate_last_trajectory` ended them first or a saved handle holds them."""
        self._finalizer()

    # -- SB3's interface -----------------------------------------------------------------------------------
    def add(  # type: ignore[override]
        self,
        obs: dict[str, np.ndarray],
        next_obs: dict[str, np.ndarray],
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        """Stage one step of every env (SB3's call); an episode is appended to the store when its env is done.

        ``done`` is SB3's (terminated or truncated); ``infos[i]["TimeLimit.truncated"]`` tells a truncation.
        """
        writer = self._writer
        if writer is None:
            self._open(self.info_keys if self.info_keys is not None else _numeric_info_keys(infos))
            writer = self._writer
        done = np.asarray(done)
        if done.dtype != bool:
            done = done.astype(bool)
        if self.n_envs == 1:
            timeout = bool(done[0]) and bool(infos[0].get("TimeLimit.truncated", False))
            truncated = np.array([timeout])
            terminated = done & ~truncated
        else:
            truncated = done & np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
            terminated = done & ~truncated
        writer.add(obs, next_obs, action, reward, terminated, truncated, infos if self.info_keys else None)
        self._added += 1

    def sample(self, batch_size: int, env: Any = None) -> Any:  # type: ignore[override]
        """A batch as SB3's DictReplayBufferSamples; ``env`` (a VecNormalize) normalises observations and rewards.

        The first ``int(her_ratio * batch_size)`` rows are relabelled (SB3 puts them last; the order carries no
        meaning for training).
        """
        sampler = self._sampler(batch_size)
        try:
            batch = sampler.sample(batch_size)
        except StoreError as e:
            store = self._res.store
            if store is not None and store.num_transitions == 0:
                raise RuntimeError(_NO_EPISODE) from e
            raise
        dones = batch.dones if self.handle_timeout_termination else th.maximum(batch.dones, batch.truncated)
        if env is None:
            dev = self.device
            obs = {k: v.to(dev) for k, v in batch.observations.items()}
            next_obs = {k: v.to(dev) for k, v in batch.next_observations.items()}
            rewards = batch.rewards.to(dev)
        else:
            norm_obs = self._normalize_obs({k: v.numpy() for k, v in batch.observations.items()}, env)
            norm_next = self._normalize_obs({k: v.numpy() for k, v in batch.next_observations.items()}, env)
            obs = {k: self.to_torch(v) for k, v in norm_obs.items()}
            next_obs = {k: self.to_torch(v) for k, v in norm_next.items()}
            rewards = self.to_torch(self._normalize_reward(batch.rewards.numpy(), env))
        return _types.DictReplayBufferSamples(
            observations=obs,
            actions=batch.actions.reshape(batch_size, self.action_dim).to(self.device),
            next_observations=next_obs,
            dones=dones.to(self.device),
            rewards=rewards,
        )

    def _sampler(self, batch_size: int) -> Any:
        sampler = self._res.sampler
        if sampler is not None:
            return sampler
        store = self._require_store()
        from her_store.sampler import HerSampler

        ref = weakref.ref(self)
        success_fn = None
        if self.relabel_terminated and self.env is not None and self.env.has_attr("compute_terminated"):
            terminated_fn = _env_method(ref, "compute_terminated")

            def success_fn(achieved: np.ndarray, desired: np.ndarray, infos: Any) -> np.ndarray:
                out = np.asarray(terminated_fn(achieved, desired, infos), bool)
                if out.size == 1:  # a non-vectorised compute_terminated answers once for the batch
                    return np.broadcast_to(out.reshape(()), (len(achieved),))
                return out

        sampler = HerSampler(
            store,
            batch_size,
            n_sampled_goal=self.n_sampled_goal,
            goal_selection_strategy=self.goal_selection_strategy,
            reward_fn=_env_method(ref, "compute_reward"),
            seed=self._seed,
            copy_info_dict=self.copy_info_dict,
            prefetch=self.prefetch,
            relabel_terminated=self.relabel_terminated,
            success_fn=success_fn,
            io_threads=self.io_threads,
        )
        self._res.sampler = sampler
        return sampler

    @property
    def pos(self) -> int:  # type: ignore[override]
        """SB3's insert position: add() calls since the start (or :meth:`reset`), modulo ``buffer_size``."""
        return self._added % self.buffer_size

    @property
    def full(self) -> bool:  # type: ignore[override]
        """SB3's flag: ``buffer_size`` add() calls since the start (or :meth:`reset`)."""
        return self._added >= self.buffer_size

    def size(self) -> int:
        """SB3's size: ``buffer_size`` when full, else ``pos`` (rows of ``n_envs`` transitions)."""
        return self.buffer_size if self.full else self.pos

    def reset(self) -> None:
        """Restart ``pos`` and ``full`` as SB3's reset does; the stored episodes are kept."""
        self._added = 0

    def set_env(self, env: Any) -> None:
        """Set the VecEnv whose ``compute_reward`` relabels (SB3 calls it after loading a saved buffer)."""
        if self.env is not None:
            raise ValueError("Trying to set env of already initialized environment.")
        self.env = env

    def truncate_last_trajectory(self) -> None:
        """End every unfinished episode as truncated at its last step and append it, warning as SB3 does.

        With ``handle_timeout_termination`` its last transition still bootstraps (SB3 marks it a timeout);
        without, it is terminal.
        """
        if self._writer is None:  # no add yet
            return
        self._require_store()
        if self._writer.pending_steps.any():
            warnings.warn(
                "The last trajectory in the replay buffer will be truncated.\n"
                "If you are in the same episode as when the replay buffer was saved,\n"
                "you should use `truncate_last_trajectory=False` to avoid that issue.",
                stacklevel=2,
            )
            self._writer.flush_partial()


def _check_spaces(observation_space: Any, action_space: Any) -> None:
    """Refuse what no goal-conditioned store can hold before anything is created on disk."""
    if not isinstance(observation_space, spaces.Dict):
        raise TypeError(
            "ZarrHerReplayBuffer needs a gymnasium.spaces.Dict observation space with keys "
            f"{list(_GOAL_KEYS)} (a goal env), got {type(observation_space).__name__}"
        )
    missing = [k for k in _GOAL_KEYS if k not in observation_space.spaces]
    if missing:
        raise ValueError(
            f"the observation space has no {missing} key(s); a HER buffer needs {list(_GOAL_KEYS)}, got "
            f"{list(observation_space.spaces)}"
        )
    ag, dg = observation_space["achieved_goal"], observation_space["desired_goal"]
    if ag.shape != dg.shape or ag.dtype != dg.dtype:
        raise ValueError(
            f"achieved_goal {ag} and desired_goal {dg} must have the same shape and dtype (goals replace each other)"
        )
    if not isinstance(action_space, spaces.Space):
        raise TypeError(f"action_space must be a gymnasium space, got {type(action_space).__name__}")


def _strategy(strategy: Any) -> GoalStrategy:
    """SB3's GoalSelectionStrategy members by name; names, her_store members and callables as the sampler takes."""
    if isinstance(strategy, _her.GoalSelectionStrategy):
        return GoalSelectionStrategy(strategy.name.lower())
    return parse_strategy(strategy)


def _numeric_info_keys(infos: Sequence[Mapping[str, Any]]) -> list[str]:
    """The info entries of env 0 that are numeric scalars (bool, int, float), minus SB3's bookkeeping."""
    keys = []
    for k, v in infos[0].items():
        if k in _RESERVED_INFO or not isinstance(k, str):
            continue
        if isinstance(v, (bool, int, float, np.bool_, np.integer, np.floating)) or (
            isinstance(v, np.ndarray) and v.ndim == 0 and v.dtype.kind in "biuf"
        ):
            keys.append(k)
    return keys
