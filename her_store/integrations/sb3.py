"""ZarrHerReplayBuffer: stable-baselines3's HerReplayBuffer, with the episodes in a disk-backed her_store store.

Pass it as ``replay_buffer_class`` to any SB3 off-policy algorithm (SAC, TD3, DDPG, DQN): steps go through a
:class:`~her_store.store.step_writer.StepWriter`, batches come from a :class:`~her_store.sampling.sampler.HerSampler`
with SB3's relabelling (her_ratio split, future/final/episode formulas, rewards from the env's ``compute_reward``), and
``save_replay_buffer`` writes a small handle to the store instead of the data.

The buffer's parts live beside it: its saved handle (:mod:`~her_store.integrations.sb3_handle`), relabelling through
its VecEnv (:mod:`~her_store.integrations.sb3_relabel`), SB3's batches (:mod:`~her_store.integrations.sb3_samples`),
SB3's infos (:mod:`~her_store.integrations.sb3_infos`), its store and resources
(:mod:`~her_store.integrations.sb3_resources`) and SB3's arrays rebuilt for inspection
(:mod:`~her_store.integrations.sb3_layout`). The class itself is defined here: a saved handle names it
``her_store.integrations.sb3.ZarrHerReplayBuffer``, the path by which pickle finds it when the handle is loaded.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces

from her_store.checks import ArgumentTypeError, check_bool, check_bounds, check_int
from her_store.errors import StoreError, short_repr
from her_store.format.schema import Schema
from her_store.integrations import require
from her_store.integrations.sb3_handle import (
    HANDLE_VERSION,
    check_handle,
    check_picklable,
    copy_to_temporary,
    restore_unfinished,
)
from her_store.integrations.sb3_infos import BOOKKEEPING_KEYS, end_flags, numeric_info_keys, warn_unstored_info
from her_store.integrations.sb3_layout import SB3Arrays, env_columns, sb3_arrays
from her_store.integrations.sb3_relabel import buffer_sampler, her_strategy, sb3_strategy
from her_store.integrations.sb3_resources import TEMP_PREFIX, BufferResources, holds_store, open_buffer_store
from her_store.integrations.sb3_samples import sb3_samples
from her_store.sampling.relabel import GoalStrategy, her_ratio, parse_strategy
from her_store.storage import Backend, open_backend
from her_store.store.creation import MAX_CAPACITY
from her_store.store.episode_store import EpisodeStore

_her = require("stable_baselines3.her", "sb3")
_utils = require("stable_baselines3.common.utils", "sb3")
_preprocessing = require("stable_baselines3.common.preprocessing", "sb3")

__all__ = ["ZarrHerReplayBuffer"]

_NO_EPISODE = (
    "Unable to sample before the end of the first episode. We recommend choosing a value for learning_starts that is "
    "greater than the maximum number of timesteps in the environment."
)


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
        or a callable taking a :class:`~her_store.sampling.relabel.GoalContext`.
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
        Batches prepared ahead in a background thread (0: none), with a DummyVecEnv (maybe wrapped, e.g. in a
        VecNormalize), whose envs' ``compute_reward`` the thread calls. With envs in other processes (a
        SubprocVecEnv) it is ignored, with a warning: their ``compute_reward`` is reached through the pipes the
        training loop's ``env.step()`` uses, which carry one caller's request at a time.
    io_threads : int, optional
        Threads a gather is split across (8-32 for a store larger than RAM). Default: one per core decoding
        compressed image frames, none for other fields (see :class:`her_store.HerSampler`).
    info_keys : sequence of str, optional
        With ``copy_info_dict``: the info entries to store. Default: the numeric scalar entries of the first
        ``add``'s infos (SB3's ``TimeLimit.truncated`` and ``terminal_observation`` excluded); the store is then
        created at the first ``add``, and numeric entries that appear only later (e.g. an ``is_success`` reported
        at an episode's end) are not stored: a warning names them, once per key. Pass them here.
    prioritize : {None, "energy"}
        "energy" draws episodes by the energy of their achieved-goal path (energy-based prioritization, see
        :class:`her_store.HerSampler`); SB3's algorithms need no change for it. "td" is refused: SB3's algorithms
        do not hand TD errors to their buffer (use :class:`her_store.HerSampler` directly for PER).

    Raises
    ------
    SchemaMismatchError
        Spaces a store cannot hold (no Dict, a goal key missing, goals of different shapes), or a store at
        ``path`` made with other spaces, capacity or info keys (it is left as it was).
    StoreLockedError
        Another buffer (in this or another live process) is writing the store at ``path``.
    ValueError
        ``optimize_memory_usage=True``, an unknown strategy, a non-positive ``buffer_size`` (or one above a store's
        largest capacity, 2**52 - 1) or ``n_envs``, a negative ``n_sampled_goal``, ``prefetch`` or ``io_threads``.
    ArgumentTypeError
        An option of the wrong type, named with what it must be and what was given: a bool, float or str where an
        int belongs (numpy integers are ints), anything but True or False (numpy's too) where a bool belongs, a str
        as ``info_keys``. It is a TypeError and a ValueError.

    Attributes
    ----------
    store : EpisodeStore or None
        The open store (None before the first ``add`` when its info keys are inferred, and after :meth:`close`).

    Notes
    -----
    ``save_replay_buffer``/pickle write a handle (store URL, spaces, configuration, unfinished episodes), not the
    data; loading it reopens the store at first use, needing no env (a removed store is an error, never replaced
    by an empty one). The unfinished episodes saved in the handle are staged again, but for those the store holds
    already: an env's episode that the run which saved the handle went on to end is not staged twice (and nothing
    is said); one whose env has episodes after the save that do not continue it (another writer's) is dropped with
    a warning. A buffer holds its store's writer lock until it is closed or dropped: SB3's documented flows work
    as written (``del model`` then ``SAC.load(..., env=env)`` and ``load_replay_buffer``, or
    ``load_replay_buffer`` into the model that saved the handle), as a store locked while this process holds
    buffers is opened again after one garbage collection; a buffer still in use here, e.g. of a second live model,
    must be ``close()``-d first. ``copy.deepcopy`` copies a local store into a fresh temporary directory (an
    independent buffer, removed at close); a store on object storage is not copied.
    ``reset()`` restarts ``pos``/``size()`` as SB3's does and keeps the stored episodes (SB3's HER buffer
    still samples them too). Episodes are committed by the store's group commit and before a ``sample`` that
    follows an episode end (one commit, about a millisecond): as with SB3's buffer, a batch may hold every
    finished episode, and a seeded run draws the same batches.

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
        io_threads: int | None = None,
        info_keys: Sequence[str] | None = None,
        prioritize: str | None = None,
    ) -> None:
        Schema(observation_space, action_space)  # spaces a store cannot hold are refused before anything is made
        if check_bool(optimize_memory_usage, "optimize_memory_usage"):
            raise ValueError(
                "ZarrHerReplayBuffer does not support optimize_memory_usage=True (SB3's HerReplayBuffer refuses it "
                "too); pass optimize_memory_usage=False"
            )
        if info_keys is not None and (isinstance(info_keys, (str, bytes)) or not isinstance(info_keys, Iterable)):
            raise ArgumentTypeError(
                f"info_keys must be a sequence of str (e.g. ['is_success']) or None, got {short_repr(info_keys)}"
            )
        self._configure(
            buffer_size, observation_space, action_space, n_envs, device, handle_timeout_termination, n_sampled_goal,
            her_strategy(goal_selection_strategy), copy_info_dict, storage_options, relabel_terminated, prefetch,
            io_threads, None if info_keys is None else tuple(info_keys), prioritize,
        )
        if info_keys is not None and not self.copy_info_dict:
            raise ValueError("info_keys is only used with copy_info_dict=True; pass copy_info_dict=True or drop it")
        self.env = env
        self._keys_given = info_keys is not None
        # SB3 seeds numpy's global generator (set_random_seed); the sampler's seed is drawn from it, so a seeded
        # model samples the same batches
        self._seed = int(np.random.randint(0, 2**31 - 1))
        if path is None:
            self._res.tmpdir = tempfile.mkdtemp(prefix=TEMP_PREFIX)
            self.url = os.path.join(self._res.tmpdir, "store")
        else:
            self.url = os.fspath(path)
        if not self.copy_info_dict or self.info_keys is not None:
            self._open()
        elif path is not None:
            self._resume_if_present()

    def _configure(
        self,
        buffer_size: int,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        n_envs: int,
        device: th.device | str,
        handle_timeout_termination: bool,
        n_sampled_goal: int,
        goal_selection_strategy: GoalStrategy,
        copy_info_dict: bool,
        storage_options: Mapping[str, Any] | None,
        relabel_terminated: bool,
        prefetch: int,
        io_threads: int | None,
        info_keys: tuple[str, ...] | None,
        prioritize: str | None = None,
    ) -> None:
        """Check and set the configuration (BaseBuffer's attributes too: super().__init__, which allocates the RAM
        arrays, is skipped) and the state of a buffer that has not opened its store yet."""
        # every option is checked here, for a new buffer and a loaded handle alike, before the store is opened
        self.total_capacity = check_bounds(
            check_int(buffer_size, "buffer_size", low=1), "buffer_size", high=MAX_CAPACITY, kind="an int"
        )
        self.n_envs = check_int(n_envs, "n_envs", low=1)
        self.handle_timeout_termination = check_bool(handle_timeout_termination, "handle_timeout_termination")
        self.copy_info_dict = check_bool(copy_info_dict, "copy_info_dict")
        self.n_sampled_goal = check_int(n_sampled_goal, "n_sampled_goal", low=0)
        self.relabel_terminated = check_bool(relabel_terminated, "relabel_terminated")
        self.prefetch = check_int(prefetch, "prefetch", low=0)
        self.io_threads = check_int(io_threads, "io_threads", low=0, or_none=True)
        if prioritize not in (None, "energy"):
            raise ValueError(
                f"prioritize must be None or 'energy', got {short_repr(prioritize)}: SB3's algorithms do not pass TD "
                "errors to their replay buffer, so 'td' cannot be updated (sample with her_store.HerSampler("
                "prioritize='td') and call its update_priorities for PER)"
            )
        self.prioritize = prioritize
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise ArgumentTypeError(f"storage_options must be a mapping or None, got {short_repr(storage_options)}")
        self.storage_options = None if storage_options is None else dict(storage_options)
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_shape = _preprocessing.get_obs_shape(observation_space)
        self.action_dim = _preprocessing.get_action_dim(action_space)
        # SB3's batches: actions in its buffer's dtype (float64 cast to float32), observations in SB3's shapes
        self._action_dtype = th.from_numpy(np.zeros(0, self._maybe_cast_dtype(action_space.dtype))).dtype
        self.buffer_size = max(self.total_capacity // self.n_envs, 1)
        self.device = _utils.get_device(device)
        self.optimize_memory_usage = False
        self.her_ratio = her_ratio(parse_strategy(goal_selection_strategy), self.n_sampled_goal)
        self._goal_strategy = goal_selection_strategy  # the sampler's (her_store's enum for named ones)
        self.goal_selection_strategy = sb3_strategy(goal_selection_strategy)  # what code written for SB3 compares
        self.info_keys = info_keys
        self._backend: Backend | None = None  # of the store's place, built once (_place)
        self._added = 0  # add() calls over the store's life: SB3's row counter before it wraps
        self._reset_at = 0  # the value of _added at the last reset()
        self._res = BufferResources()
        self._finalizer = weakref.finalize(self, self._res.close)
        self._writer: Any = None
        self._layout: SB3Arrays | None = None
        # from a loaded handle, applied when the store opens: (unfinished episodes, store's end_episode at save)
        self._restore: tuple[list[dict[str, np.ndarray]], int] | None = None
        self._sampler_state: dict[str, Any] | None = None
        self._ended = False  # an episode was appended since the last sample
        self._must_exist = False  # a loaded handle of a store that existed: never create an empty one in its place
        self._keys_given = False  # info_keys were passed (else inferred: info keys seen later are warned about)
        self._keys_seen: set[Any] = set(BOOKKEEPING_KEYS)  # info keys checked by add()

    # -- the store -----------------------------------------------------------------------------------------
    @property
    def store(self) -> EpisodeStore | None:
        """The open store (None until it is opened or created, and after :meth:`close`)."""
        return self._res.store

    def _place(self) -> Backend:
        """The backend of the store's place, built at its first use; whether a store is there and the store's
        opening are asked of it."""
        if self._backend is None:
            self._backend = open_backend(self.url, self.storage_options)
        return self._backend

    def _open(self) -> EpisodeStore:
        """Create or resume the store, then a writer for ``n_envs`` (with the saved unfinished episodes, if any).

        Without ``copy_info_dict`` a resumed store keeps its info keys (missing entries are stored as 0); with it and
        info keys still unknown (:meth:`_resume_if_present`) the store is resumed with the info keys it holds.
        """
        kwargs: dict[str, Any] = {"capacity": self.total_capacity}
        if self.copy_info_dict and self.info_keys is not None:
            kwargs["info_keys"] = list(self.info_keys)
        store = open_buffer_store(
            self._place(), self.observation_space, self.action_space, must_exist=self._must_exist, **kwargs
        )
        self._must_exist = False
        self._res.store = store
        self._writer = store.writer(self.n_envs)
        if self.copy_info_dict:
            self.info_keys = store.info_keys
        if self._added == 0:  # a resumed store: SB3's row counter as if its episodes had been added here
            self._added = int(env_columns(store, self.n_envs)[1].max())
        if self._restore is not None:
            pending, end_episode = self._restore
            self._restore = None
            restore_unfinished(store, self._writer, pending, end_episode)
        return store

    def _resume_if_present(self) -> None:
        """With inferred info keys: resume an existing store now, with its info keys; else wait for the first add."""
        if holds_store(self._place()):
            self._open()

    def _require_store(self) -> EpisodeStore:
        """The open store; opened now if it was deferred (a loaded handle), RuntimeError if it does not exist yet
        and waits for the first add to learn its info keys."""
        store = self._res.store
        if store is not None:
            return store
        if self._writer is not None:
            raise StoreError(f"the buffer's store {self.url} is closed")
        if self.copy_info_dict and self.info_keys is None:
            self._resume_if_present()
            if self._res.store is None:
                raise RuntimeError(_NO_EPISODE)
            return self._res.store
        return self._open()

    def close(self) -> None:
        """Commit what is staged and release the store (and remove a temporary one).

        Unfinished episodes are not appended (call :meth:`truncate_last_trajectory` first to keep them). Idempotent.

        Examples
        --------
        >>> model.replay_buffer.close()  # doctest: +SKIP
        """
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

        ``done`` is SB3's (terminated or truncated); ``infos[i]["TimeLimit.truncated"]`` tells a truncation. An env
        whose ``obs`` is not the ``next_obs`` of its last step was reset in between (SB3 resets at the start of every
        ``learn()`` by default; ``set_env`` brings new envs): its unfinished episode ends there, truncated, rather than
        run on into the reset one (the store keeps a step's next observation as the following row). Observation keys
        outside the observation space are ignored, as SB3's buffer ignores them.
        """
        known = self.observation_space.spaces
        if len(obs) > len(known):
            obs = {k: v for k, v in obs.items() if k in known}
        if len(next_obs) > len(known):
            next_obs = {k: v for k, v in next_obs.items() if k in known}
        writer = self._writer
        if writer is None or self._res.store is None:
            if self.copy_info_dict and self.info_keys is None and writer is None:
                self._resume_if_present()
                if self._res.store is None:
                    self.info_keys = tuple(numeric_info_keys(infos))
            self._require_store()
            writer = self._writer
        if not isinstance(infos, (list, tuple)) or len(infos) != self.n_envs:
            raise ValueError(
                f"infos must be a list of {self.n_envs} dicts (one per env, as SB3 passes), got {infos!r:.80}"
            )
        if not isinstance(done, np.ndarray) or done.dtype != bool:
            done = np.asarray(done).astype(bool)
        terminated, truncated = end_flags(done, infos)
        if self.copy_info_dict and not self._keys_given:
            warn_unstored_info(infos, self._keys_seen, self.info_keys)
        # an env reset since its last step (SB3 resets at the start of every learn(), by default, or a new env): its
        # episode ends there (cut_resets)
        if writer.add(obs, next_obs, action, reward, terminated, truncated, infos if self.info_keys else None,
                      cut_resets=True):
            self._ended = True
        self._added += 1
        self._layout = None

    def sample(self, batch_size: int, env: Any = None) -> Any:  # type: ignore[override]
        """A batch as SB3's DictReplayBufferSamples; ``env`` (a VecNormalize) normalises observations and rewards.

        The first ``int(her_ratio * batch_size)`` rows are relabelled (SB3 puts them last; the order carries no
        meaning for training). Fields have the dtypes and shapes of SB3's batches: actions float32 for a float64
        action space, a Discrete observation or goal shaped ``(batch_size, 1)`` (the store keeps it as a scalar;
        ``compute_reward`` gets goals shaped ``(n, 1)`` too).

        Examples
        --------
        >>> batch = model.replay_buffer.sample(256)  # doctest: +SKIP
        >>> batch.observations["desired_goal"].shape, batch.rewards.shape  # doctest: +SKIP
        (torch.Size([256, 3]), torch.Size([256, 1]))
        """
        sampler = self._sampler(batch_size)
        if self._ended:  # as SB3, a batch may hold every finished episode: commit them (and the run is reproducible)
            self._ended = False
            self._require_store().flush()
        try:
            batch = sampler.sample(batch_size)
        except StoreError as e:
            if self.store is not None and self.store.num_transitions == 0:
                raise RuntimeError(_NO_EPISODE) from e
            raise
        return sb3_samples(
            batch, self.obs_shape, self.action_dim, self._action_dtype, self.device, self.handle_timeout_termination,
            env,
        )

    def _sampler(self, batch_size: int) -> Any:
        sampler = self._res.sampler
        if sampler is not None:
            return sampler
        sampler = buffer_sampler(self, self._require_store(), batch_size, self._goal_strategy, self._seed)
        if self._sampler_state is not None:
            sampler.load_state_dict(self._sampler_state)
            self._sampler_state = None
        self._res.sampler = sampler
        return sampler

    @property
    def pos(self) -> int:  # type: ignore[override]
        """SB3's insert row: add() calls since the start (or :meth:`reset`) modulo ``buffer_size``; a resumed
        store counts as many calls as its longest env column of live episodes (``sb3_layout.env_columns``)."""
        return (self._added - self._reset_at) % self.buffer_size

    @property
    def full(self) -> bool:  # type: ignore[override]
        """SB3's flag: at least ``buffer_size`` add() calls since the start (or :meth:`reset`)."""
        return self._added - self._reset_at >= self.buffer_size

    def size(self) -> int:
        """SB3's size: ``buffer_size`` when full, else ``pos`` (rows of ``n_envs`` transitions).

        Examples
        --------
        >>> model.replay_buffer.size()  # doctest: +SKIP
        1000
        """
        return self.buffer_size if self.full else self.pos

    def reset(self) -> None:
        """Restart ``pos``, ``full`` and ``size()`` as SB3's reset does; the stored episodes stay (and are sampled,
        as SB3's HER buffer still samples its old episodes after a reset).

        SB3's arrays (``actions``, ``ep_length``, ...) then hold the steps added since the reset at rows
        ``0..pos - 1``, as SB3's do; the older steps lie in the rows before them, wrapping round from the last row
        (SB3 leaves them at the rows they had, where the new steps have not overwritten them).

        Examples
        --------
        >>> rb.reset(); rb.size()  # doctest: +SKIP
        0
        """
        self._reset_at = self._added
        self._layout = None

    def set_env(self, env: Any) -> None:
        """Set the VecEnv whose ``compute_reward`` relabels (SB3 calls it after loading a saved buffer).

        Examples
        --------
        >>> rb = pickle.load(open("rb_handle.pkl", "rb")); rb.set_env(vec_env)  # doctest: +SKIP
        """
        if self.env is not None:
            raise ValueError("Trying to set env of already initialized environment.")
        self.env = env
        sampler = self._res.sampler
        if sampler is not None:  # made without an env: made again, to prefetch only if this env allows it
            self._sampler_state = sampler.state_dict()
            sampler.close()
            self._res.sampler = None

    def truncate_last_trajectory(self) -> None:
        """End every unfinished episode as truncated at its last step and append it, warning as SB3 does.

        With ``handle_timeout_termination`` its last transition still bootstraps (SB3 marks it a timeout);
        without, it is terminal. SB3 calls it after loading a saved buffer.

        Examples
        --------
        >>> model.replay_buffer.truncate_last_trajectory()  # doctest: +SKIP
        """
        if self._writer is None and self._restore is None:  # nothing added, nothing saved
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
            self._layout = None
            self._ended = True

    # -- SB3's arrays, for inspection ---------------------------------------------------------------------
    def _arrays(self) -> SB3Arrays:
        """SB3's arrays built from the store (a full read of the ring: inspection only), kept until the next add."""
        if self._layout is None:
            store = self._require_store()
            pending = [self._writer.pending(e) for e in range(self.n_envs)]
            # steps such that the newest step lands at row pos - 1 (after a reset, the steps since it at rows 0..)
            steps = self._added + (-self._reset_at) % self.buffer_size
            self._layout = sb3_arrays(
                store, self.buffer_size, self.n_envs, pending,
                handle_timeout_termination=self.handle_timeout_termination, steps=steps,
            )
        return self._layout

    observations = property(lambda self: self._arrays().observations, doc="SB3's ``observations`` arrays (read).")
    next_observations = property(lambda self: self._arrays().next_observations, doc="SB3's ``next_observations``.")
    actions = property(lambda self: self._arrays().actions, doc="SB3's ``actions``: (buffer_size, n_envs, dim).")
    rewards = property(lambda self: self._arrays().rewards, doc="SB3's ``rewards``: (buffer_size, n_envs).")
    dones = property(lambda self: self._arrays().dones, doc="SB3's ``dones``: (buffer_size, n_envs).")
    timeouts = property(lambda self: self._arrays().timeouts, doc="SB3's ``timeouts``: (buffer_size, n_envs).")
    ep_start = property(lambda self: self._arrays().ep_start, doc="SB3's ``ep_start``: (buffer_size, n_envs).")
    ep_length = property(lambda self: self._arrays().ep_length, doc="SB3's ``ep_length``: (buffer_size, n_envs).")
    _current_ep_start = property(lambda self: self._arrays().current_ep_start, doc="SB3's ``_current_ep_start``.")

    # -- the handle ----------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """The handle: where the store is, the configuration, the unfinished episodes, counters; never the data."""
        store = self._res.store
        restore = self._restore
        if store is not None:
            store.flush()
            writer = self._writer
            pending = [writer.pending(e) for e in range(self.n_envs)] if writer.pending_steps.any() else None
            restore = None if pending is None else (pending, store.end_episode)
        sampler = self._res.sampler
        return {
            "her_store_handle": HANDLE_VERSION,
            "url": self.url,
            "config": {
                "buffer_size": self.total_capacity,
                "observation_space": self.observation_space,
                "action_space": self.action_space,
                "n_envs": self.n_envs,
                "device": str(self.device),
                "handle_timeout_termination": self.handle_timeout_termination,
                "n_sampled_goal": self.n_sampled_goal,
                "goal_selection_strategy": self._goal_strategy,
                "copy_info_dict": self.copy_info_dict,
                "storage_options": self.storage_options,
                "relabel_terminated": self.relabel_terminated,
                "prefetch": self.prefetch,
                "io_threads": self.io_threads,
                "info_keys": self.info_keys,
                "prioritize": self.prioritize,
            },
            "restore": restore,
            "exists": store is not None or self._must_exist,
            "added": self._added,
            "reset_at": self._reset_at,
            "info_keys_given": self._keys_given,
            "seed": self._seed,
            "sampler": sampler.state_dict() if sampler is not None else self._sampler_state,
        }

    def __getstate__(self) -> dict[str, Any]:
        """The pickle of the buffer is its handle (SB3's save_replay_buffer pickles the buffer): a few KB.

        Staged episodes are committed first. A temporary store (``path=None``) is kept on disk from then on, so
        that the handle can reopen it; not when the handle cannot be pickled.

        Raises
        ------
        pickle.PicklingError
            A part of the handle cannot be pickled, e.g. a ``goal_selection_strategy`` that is a lambda or a
            local function (the message names it; a function defined at module level can be).
        """
        state = self._state()
        check_picklable(state, self._goal_strategy)
        self._res.keep_tmpdir = True
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild from a handle; the store is opened at first use (SB3 calls set_env, then
        truncate_last_trajectory), with ``env`` None as SB3's HerReplayBuffer after unpickling."""
        check_handle(state)
        self._configure(**state["config"])
        self.env = None
        self.url = state["url"]
        self._seed = state["seed"]
        self._restore = state["restore"]
        self._must_exist = state["exists"]
        self._added = state["added"]
        self._reset_at = state["reset_at"]
        self._keys_given = state.get("info_keys_given", False)
        self._sampler_state = state["sampler"]

    def __deepcopy__(self, memo: dict[int, Any]) -> ZarrHerReplayBuffer:
        """An independent buffer: the store copied into a fresh temporary directory (removed at close), the
        unfinished episodes and counters copied, ``env`` None as after SB3's deepcopy (call set_env).

        Raises
        ------
        StoreError
            The store is on object storage (copy it with the storage's own tools and open a buffer on the copy).
        """
        state = copy.deepcopy(self._state(), memo)
        tmpdir, state["url"] = copy_to_temporary(self.url)
        new = type(self).__new__(type(self))
        new.__setstate__(state)
        new._res.tmpdir = tmpdir
        return new

