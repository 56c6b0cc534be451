"""rllte's HerReplayStorage over the disk store: the same constructor, add, sample and update, episodes on disk.

Steps go to a :class:`~her_store.store.step_writer.StepWriter` (an episode is appended when its env reports
terminated or truncated, or cut as truncated at ``segment_steps``), batches come from a
:class:`~her_store.sampling.sampler.HerSampler`. rllte itself need not be installed.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Self

import numpy as np
import torch
from gymnasium import spaces

from her_store.checks import check_bool, check_bounds, check_callable, check_int, check_number
from her_store.datasets.opening import open_store
from her_store.errors import StoreError
from her_store.format.schema import Schema
from her_store.integrations.inputs import as_flags, as_numpy, checked_device
from her_store.sampling.config import SamplerConfig
from her_store.sampling.relabel import GoalStrategy, parse_strategy
from her_store.sampling.sampler import HerSampler, RewardFn
from her_store.storage import Backend
from her_store.store.creation import MAX_CAPACITY
from her_store.store.episode_store import EpisodeStore
from her_store.store.opening import check_creation_options
from her_store.store.step_writer import StepWriter

__all__ = ["HerReplayBatch", "HerReplayStorage", "NoEpisodeError", "PrioritizedHerReplayBatch"]


class NoEpisodeError(StoreError, RuntimeError):
    """:meth:`HerReplayStorage.sample` before any episode ended: a RuntimeError, as rllte raises then, and a
    StoreError, as every her_store error."""


class HerReplayBatch(NamedTuple):
    """One batch, with the fields of rllte's ``DictReplayBatch``: float32 tensors on the storage's device.

    ``observations`` and ``next_observations`` map each observation key to ``(B, *shape)``; ``actions`` is
    ``(B, *action shape)``; ``rewards``, ``terminateds`` and ``truncateds`` are ``(B, 1)``.
    """

    observations: dict[str, torch.Tensor]
    actions: torch.Tensor
    rewards: torch.Tensor
    terminateds: torch.Tensor
    truncateds: torch.Tensor
    next_observations: dict[str, torch.Tensor]


class PrioritizedHerReplayBatch(NamedTuple):
    """A batch of a storage with ``prioritize="td"``: :class:`HerReplayBatch`'s fields, then ``weights`` (float32
    ``(B,)``, importance weights) and ``indices`` (int64 ``(B,)``, what :meth:`HerReplayStorage.update_priorities`
    takes), as the batches of rllte's prioritized storage carry them."""

    observations: dict[str, torch.Tensor]
    actions: torch.Tensor
    rewards: torch.Tensor
    terminateds: torch.Tensor
    truncateds: torch.Tensor
    next_observations: dict[str, torch.Tensor]
    weights: torch.Tensor
    indices: torch.Tensor


_TEMP_PREFIX = "her_store-"  # the temporary stores of this class (SB3's buffer uses another prefix)
_ABANDONED_AFTER = 60.0  # seconds since a temporary directory last changed before it may count as abandoned


def _remove_abandoned_temporaries() -> None:
    """Remove the temporary stores of storages whose process died without closing them (e.g. by kill -9).

    A directory goes only when all of this holds: its name has this class's prefix, it belongs to this user, it
    holds nothing but ``store``, it has not changed for a minute (so it is not one being created), and that
    store's writer lock can be taken (the kernel drops a lock when its holder dies; a live storage holds its
    lock until it is closed). A temporary store is never saved in a handle, so nothing else refers to it.
    """
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(_TEMP_PREFIX)]
    except OSError:
        return
    old = time.time() - _ABANDONED_AFTER
    for name in names:
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mtime > old:
                continue
            if os.listdir(path) != ["store"]:
                continue
            EpisodeStore.open(os.path.join(path, "store"), "a").close()  # StoreLockedError while its owner lives
        except (OSError, StoreError):
            continue
        shutil.rmtree(path, ignore_errors=True)


def _release(writer: StepWriter, sampler: HerSampler, store: EpisodeStore, tmpdir: str | None) -> None:
    """End a persistent store's unfinished episodes as truncated, release the sampler and the store (committing
    what is staged); remove a temporary store's directory. Run by close() or at garbage collection."""
    try:
        if tmpdir is None:
            writer.flush_partial()
    finally:
        try:
            sampler.close()
            store.close()
        finally:
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)


def _store_of(
    path: str | os.PathLike[str] | Backend | EpisodeStore,
    observation_space: spaces.Dict,
    action_space: spaces.Space,
    options: Mapping[str, Any],
) -> EpisodeStore:
    """The storage's store: the one at ``path`` created or resumed by one :func:`~her_store.open_store`, or ``path``
    itself, a store handed over open, checked as ``open_store`` checks a store it resumes (spaces, capacity, info keys,
    metadata) and closed when refused."""
    if not isinstance(path, EpisodeStore):
        return open_store(path, observation_space, action_space, **options)
    store = path
    try:
        info = options.get("info_keys", store.schema.info_spaces)
        Schema(observation_space, action_space, info).check_same(store.schema, store.url)
        check_creation_options(store, options)
        if "commit_interval" in options:
            store.commit_interval = options["commit_interval"]
    except BaseException:
        store.close()
        raise
    return store


class HerReplayStorage:
    """rllte's ``HerReplayStorage`` with the episodes in a her_store store on disk.

    The constructor, :meth:`add`, :meth:`sample` and :meth:`update` take what rllte's take; ``path`` makes the
    storage persistent (an existing store there is resumed). Beyond rllte: the default ``reward_fn`` is the
    ``compute_reward`` of the env the store's metadata names, the ``"random"`` strategy works, infos are kept
    per env, and the data outlives the process.

    Parameters
    ----------
    observation_space : gymnasium.spaces.Dict
        With ``observation``, ``achieved_goal`` and ``desired_goal``.
    action_space : gymnasium.spaces.Space
        Box, Discrete, MultiBinary or MultiDiscrete.
    device : str or torch.device
        Where sampled batches go; one that is not available here (e.g. ``"cuda"`` without CUDA) is refused with a
        ValueError before anything is created.
    storage_size : int or None
        Capacity in transitions, summed over envs (rllte keeps ``storage_size`` per env): a ring that evicts the
        oldest whole episodes; None grows without bound. At most a store's largest capacity (2**52 - 1). Fixed when
        the store is created; resuming a store needs the same value.
    num_envs : int
        Environments stepped together; each :meth:`add` carries one step of each.
    batch_size : int
        Transitions per :meth:`sample`.
    goal_selection_strategy : {"future", "final", "episode", "random"} or callable
        As :class:`~her_store.sampling.sampler.HerSampler`: SB3's formulas; ``random`` takes the achieved goal of any
        stored transition.
    num_goals : int
        Relabelled transitions per real one: ``her_ratio = 1 - 1 / (num_goals + 1)``.
    reward_fn : callable, optional
        ``reward_fn(achieved_goal, desired_goal, infos)`` -> ``(n,)`` or ``(n, 1)`` rewards, vectorised
        (``env.unwrapped.compute_reward``). Default: ``compute_reward`` of ``metadata["env_id"]`` when that id is
        registered in this process; otherwise the constructor raises StoreError saying to pass one.
    copy_info_dict : bool
        Hand ``reward_fn`` one dict per relabelled transition holding its stored ``info_keys``.
    path : str, PathLike, Backend or EpisodeStore, optional
        Local directory, fsspec URL or backend of the store, created or resumed there by one
        :func:`~her_store.open_store`. Or a store already open for appending (e.g. a writer's shard of a dataset of
        many), handed over: it must have these spaces and ``storage_size`` (and the ``info_keys`` and ``metadata``
        given), and the storage closes it (at once if it refuses it). None: a fresh temporary directory, removed by
        :meth:`close` or when the storage is garbage collected; one left by a process that was killed is removed
        when a later temporary storage is made (once no process holds its writer lock and it has not changed for a
        minute).
    info_keys : sequence of str, optional
        Numeric info entries stored per step (e.g. ``["is_success"]``), read from ``infos`` as a list of dicts
        or a dict of per-env arrays. Default: none for a new store, the stored ones for an existing store.
    metadata : mapping, optional
        The store's dataset card, e.g. ``{"env_id": "FetchReach-v4"}`` (which also gives the default reward_fn).
    storage_options : mapping, optional
        fsspec options for a URL ``path``.
    seed : int, optional
        Seed of the sampler's generator.
    commit_interval : float, optional
        Seconds between group commits (see :meth:`EpisodeStore.create`): at most what a kill -9 loses of the ended
        episodes; :meth:`sample` commits the ones ended since the last commit before drawing.
    segment_steps : int, optional
        An unfinished episode that reaches this many steps is ended as truncated, and its env's next step starts
        a new episode (from the same state: the trajectory goes on seamlessly, but goals are then relabelled within
        each segment). This bounds the steps an env keeps in memory and what a kill -9 loses. Default
        ``storage_size``: an episode too long for the store is cut there rather than dropped (rllte cannot hold
        it either); None (with ``storage_size=None``) never cuts.

    Raises
    ------
    ArgumentTypeError
        An option of the wrong type (a bool, float or str where an int belongs, numpy integers being ints; not True
        or False where a bool belongs; not a callable where one belongs), named with what it must be and what was
        given; a TypeError and a ValueError. Checked, with the ranges, before anything is created on disk.
    SchemaMismatchError
        A store at ``path`` (or handed over) with other spaces, capacity or info keys.

    Notes
    -----
    ``prioritize`` ("energy" or "td"), ``alpha`` and ``beta`` are those of :class:`her_store.HerSampler`; with
    "td" the priorities are checkpointed to the store and resumed with it.

    Attributes
    ----------
    store : EpisodeStore
        The open store (read it, or hand it to other samplers).
    writer : StepWriter
        Assembles the steps of :meth:`add` into episodes.
    sampler : HerSampler
        Draws the batches of :meth:`sample`.

    Examples
    --------
    >>> from her_store.integrations.rllte import HerReplayStorage
    >>> storage = HerReplayStorage(env.observation_space, env.action_space, device="cuda", num_envs=8,
    ...                            path="runs/fetch", metadata={"env_id": "FetchReach-v4"})  # doctest: +SKIP
    >>> storage.add(obs, actions, rewards, terminateds, truncateds, infos, next_obs)  # doctest: +SKIP
    >>> batch = storage.sample()  # doctest: +SKIP
    >>> batch.observations["desired_goal"].shape, batch.rewards.shape  # doctest: +SKIP
    (torch.Size([1024, 3]), torch.Size([1024, 1]))
    """

    def __init__(
        self,
        observation_space: spaces.Dict,
        action_space: spaces.Space,
        device: str | torch.device = "cpu",
        storage_size: int | None = 1_000_000,
        num_envs: int = 1,
        batch_size: int = 1024,
        goal_selection_strategy: GoalStrategy = "future",
        num_goals: int = 4,
        reward_fn: RewardFn | None = None,
        copy_info_dict: bool = False,
        path: str | os.PathLike[str] | Backend | EpisodeStore | None = None,
        *,
        info_keys: Sequence[str] | None = None,
        metadata: Mapping[str, Any] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        seed: int | None = None,
        commit_interval: float | None = None,
        segment_steps: int | None = None,
        prioritize: str | None = None,
        alpha: float = 0.6,
        beta: float = 0.4,
    ) -> None:
        # checked before anything is created on disk
        priority_options = SamplerConfig(prioritize=prioritize, alpha=alpha, beta=beta)
        parse_strategy(goal_selection_strategy)
        storage_size = check_int(storage_size, "storage_size", low=1, or_none=True)
        if storage_size is not None:
            check_bounds(storage_size, "storage_size", high=MAX_CAPACITY, kind="an int")
        self.num_envs = check_int(num_envs, "num_envs", low=1)
        self.batch_size = check_int(batch_size, "batch_size", low=1)
        num_goals = check_int(num_goals, "num_goals", low=0)
        if segment_steps is None:
            segment_steps = storage_size
        else:
            segment_steps = check_int(segment_steps, "segment_steps", low=1)
            if storage_size is not None and segment_steps > storage_size:
                raise ValueError(
                    f"segment_steps={segment_steps} exceeds storage_size={storage_size}: a segment that long could "
                    "not be stored"
                )
        self.segment_steps = segment_steps
        check_callable(reward_fn, "reward_fn", or_none=True)
        self.copy_info_dict = check_bool(copy_info_dict, "copy_info_dict")
        seed = check_int(seed, "seed", low=0, or_none=True)
        commit_interval = check_number(commit_interval, "commit_interval", low=0, finite=True, or_none=True)
        self.device = checked_device(device)
        if path is None:
            _remove_abandoned_temporaries()
        tmpdir = tempfile.mkdtemp(prefix=_TEMP_PREFIX) if path is None else None
        options: dict[str, Any] = {"capacity": storage_size, "storage_options": storage_options}
        if info_keys is not None:
            options["info_keys"] = list(info_keys)
        if metadata is not None:
            options["metadata"] = dict(metadata)
        if commit_interval is not None:
            options["commit_interval"] = commit_interval
        try:
            self.store = _store_of(
                path if tmpdir is None else os.path.join(tmpdir, "store"), observation_space, action_space, options
            )
        except BaseException:
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        try:
            if self.copy_info_dict and not self.store.info_keys:
                raise ValueError(
                    "copy_info_dict=True hands reward_fn the stored info entries, and the store keeps none: name them "
                    "with info_keys=[...] when the store is created"
                )
            self.writer: StepWriter = self.store.writer(self.num_envs)
            self.sampler = HerSampler(
                self.store, self.batch_size, n_sampled_goal=num_goals, goal_selection_strategy=goal_selection_strategy,
                reward_fn=reward_fn, device=self.device, seed=seed, copy_info_dict=self.copy_info_dict,
                prioritize=priority_options.prioritize, alpha=priority_options.alpha, beta=priority_options.beta,
            )
        except BaseException:
            self.store.close()
            if tmpdir is not None:
                shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        self.path = self.store.url
        self._temporary = tmpdir is not None
        self._finalizer = weakref.finalize(self, _release, self.writer, self.sampler, self.store, tmpdir)

    def add(
        self,
        observations: Mapping[str, Any],
        actions: Any,
        rewards: Any,
        terminateds: Any,
        truncateds: Any,
        infos: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None,
        next_observations: Mapping[str, Any],
    ) -> None:
        """Add one step of every env (torch tensors on any device, or arrays; ``num_envs`` leading).

        ``next_observations`` holds the terminal observation of envs that ended on this step (rllte's
        ``real_next_obs``). An env's episode is appended to the store when it is terminated or truncated, or
        when it reaches ``segment_steps`` (as truncated). An env whose observation is not its last step's next
        observation was reset in between: its episode ends there, as truncated, and a new one starts (the store
        keeps a step's next observation as the following row; joined, the last step would lead to the new start).

        Raises
        ------
        EpisodeValidationError
            A missing or extra observation key, a wrong shape or a value the store's dtype cannot hold, named by
            field; nothing was added.
        ValueError
            Termination flags that are neither booleans nor 0/1.

        Examples
        --------
        >>> storage.add(obs, actions, rewards, terms, truncs, infos, real_next_obs)  # doctest: +SKIP
        """
        obs = {k: as_numpy(v) for k, v in observations.items()} if isinstance(observations, Mapping) else observations
        nxt = (
            {k: as_numpy(v) for k, v in next_observations.items()}
            if isinstance(next_observations, Mapping)
            else next_observations
        )
        self._require_open()
        if isinstance(infos, Mapping):
            infos = {k: as_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in infos.items()}
        self.writer.add(
            obs, nxt, as_numpy(actions), as_numpy(rewards), as_flags(terminateds, "terminateds"),
            as_flags(truncateds, "truncateds"), infos, cut_resets=True,
        )
        if self.segment_steps is not None:
            long = self.writer.pending_steps >= self.segment_steps
            if long.any():  # ended as truncated; the env's next step starts a new episode from the same state
                self.writer.flush_partial(np.flatnonzero(long).tolist())

    def sample(self, step: int | None = None) -> HerReplayBatch | PrioritizedHerReplayBatch:
        """One batch of ``batch_size`` transitions from the ended episodes (``step`` is accepted, unused).

        Episodes ended since the last commit are committed first (one commit, about a millisecond), so every ended
        episode is drawn from, as in rllte.

        The first ``int(her_ratio * batch_size)`` rows are relabelled (rllte puts them last); their rewards are
        recomputed with ``reward_fn``.

        Raises
        ------
        NoEpisodeError
            No episode has ended yet. It is a RuntimeError (what rllte raises then, so code written for rllte
            catches it) and a StoreError.

        Examples
        --------
        >>> batch = storage.sample(step)  # doctest: +SKIP
        >>> q = critic(batch.observations, batch.actions)  # doctest: +SKIP
        """
        self._require_open()
        self.store.flush()
        if not self.store.snapshot().num_transitions:
            raise NoEpisodeError(
                f"Unable to sample before the end of the first episode: {self.path} holds no ended episode yet. "
                "Add steps until an episode is terminated or truncated (num_init_steps greater than the longest "
                "episode) before sampling."
            )
        b = self.sampler.sample()
        batch = HerReplayBatch(
            observations={k: v.float() for k, v in b.observations.items()},
            actions=b.actions.float(),
            rewards=b.rewards,
            terminateds=b.terminated,
            truncateds=b.truncated,
            next_observations={k: v.float() for k, v in b.next_observations.items()},
        )
        if b.weights is None or b.indices is None:
            return batch
        return PrioritizedHerReplayBatch(*batch, weights=b.weights, indices=b.indices)

    def update(self, metrics: Mapping[str, Any] | None = None, *args: Any, **kwargs: Any) -> None:
        """What rllte calls after each gradient step: with ``prioritize="td"`` and ``metrics`` holding ``indices``
        and ``priorities`` (rllte's prioritized storage's keys; ``td_errors`` is taken too), the priorities are
        updated (:meth:`update_priorities`); otherwise nothing is."""
        if self.sampler.priorities is None or not isinstance(metrics, Mapping) or "indices" not in metrics:
            return
        errors = metrics.get("priorities", metrics.get("td_errors"))
        if errors is not None:
            self.update_priorities(metrics["indices"], errors)

    def update_priorities(self, indices: Any, td_errors: Any) -> int:
        """Set the priorities of a batch's transitions from their TD errors (``prioritize="td"``; see
        :meth:`her_store.HerSampler.update_priorities`).

        Examples
        --------
        >>> batch = storage.sample()  # doctest: +SKIP
        >>> storage.update_priorities(batch.indices, td_errors)  # doctest: +SKIP
        """
        self._require_open()
        return self.sampler.update_priorities(indices, td_errors)

    def close(self) -> None:
        """Store the unfinished episodes as truncated (a persistent store), commit, release the store.

        A temporary store's directory is removed. Idempotent; garbage collection does the same.

        Examples
        --------
        >>> storage.close()  # doctest: +SKIP
        """
        self._finalizer()

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise StoreError(f"this HerReplayStorage ({self.path}) is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "temporary" if self._temporary else repr(self.path)
        return f"HerReplayStorage({where}, num_envs={self.num_envs}, batch_size={self.batch_size})"

