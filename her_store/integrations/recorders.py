"""Recorders: every finished episode of a running gymnasium env, or vector env, written into a her_store store.

:class:`RecordEpisodes` (one env) and :class:`RecordVectorEpisodes` (a gymnasium vector env, sync or async) turn any
policy's rollouts into a her_store dataset through the store's :class:`~her_store.store.step_writer.StepWriter`. They
never hide what the env returned: an episode the store refuses is dropped, listed and warned about
(:class:`RecordingWarning`), never raised from a step.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper

from her_store.datasets.opening import open_store
from her_store.errors import SchemaMismatchError, StoreError
from her_store.format.schema import Schema
from her_store.store.episode_store import EpisodeStore
from her_store.store.step_writer import DroppedEpisode

__all__ = ["RecordEpisodes", "RecordVectorEpisodes", "RecordingWarning"]


def _open(
    store: EpisodeStore | str | os.PathLike[str],
    observation_space: spaces.Space,
    action_space: spaces.Space,
    env_id: str | None,
    options: Mapping[str, Any],
) -> tuple[EpisodeStore, bool]:
    """The store to record into and whether the recorder opened it (and so closes it).

    A path is opened or created with the env's spaces (:func:`open_store`); a store given open must have them. The
    env id goes into the card of an empty store that has none; a card naming another env id is refused.
    """
    if isinstance(store, EpisodeStore):
        if options:
            raise TypeError(
                f"store options {sorted(options)} apply only when the recorder opens the store from a path; "
                f"{store.url} is open already"
            )
        Schema(observation_space, action_space, store.schema.info_spaces).check_same(store.schema, store.url)
        owned = False
    elif isinstance(store, (str, os.PathLike)):
        env_id = dict(options.get("metadata") or {}).get("env_id", env_id)  # a card given explicitly wins
        store, owned = open_store(store, observation_space, action_space, **options), True
    else:
        raise TypeError(f"store must be an EpisodeStore or a path, got {type(store).__name__}")
    try:
        stored = store.metadata.get("env_id")
        if env_id is not None and stored is None and store.num_episodes == 0:
            store.update_metadata(env_id=env_id)
        elif env_id is not None and stored is not None and stored != env_id:
            raise SchemaMismatchError(f"{store.url} holds episodes of env {stored!r}, this env is {env_id!r}")
    except BaseException:
        if owned:
            store.close()
        raise
    return store, owned


class RecordingWarning(UserWarning):
    """An episode a recorder did not write into its store; the env's values were returned to the caller all the same.

    Examples
    --------
    >>> import tempfile, warnings, gymnasium as gym, her_store
    >>> env = RecordEpisodes(gym.make("her_store/PointGoal-v0"), tempfile.mkdtemp() + "/rollouts")
    >>> _ = env.reset(seed=0)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error", RecordingWarning)  # a run that must not lose an episode: raise instead
    ...     obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    """


class _Recorder:
    """Steps of ``n_envs`` envs fed to one StepWriter: the last observations kept, what the store refuses reported.

    A refused step cannot be part of any recorded episode, so the episodes it belonged to are dropped (never
    spliced): their envs sit out (``skip``) until those episodes end. Every dropped episode, refused by the store or
    failed to append, is listed in ``dropped`` and warned about (:class:`RecordingWarning`); a store error is never
    raised from a step or a reset, whose values belong to the caller.
    """

    def __init__(self, store: EpisodeStore, owned: bool, n_envs: int, label: str) -> None:
        self.store, self.owned, self.n_envs, self.label = store, owned, n_envs, label
        self.writer = store.writer(n_envs)
        self.episode_ids: list[int] = []
        self.dropped: list[DroppedEpisode] = []
        self.last_obs: dict[str, np.ndarray] | None = None
        self.lost = np.zeros(n_envs, bool)  # envs whose current episode lost a refused step

    def require_reset(self) -> None:
        """Refuse a step before the first reset (before the env is stepped, so none of its values is lost)."""
        if self.last_obs is None:
            raise gym.error.ResetNeeded("the recorder needs a reset before the first step")

    def _report(self, episodes: Iterable[DroppedEpisode]) -> None:
        for d in episodes:
            self.dropped.append(d)
            warnings.warn(
                f"{self.label}: env {d.env}'s episode of {d.steps} steps was dropped, not recorded ({d.reason}); "
                f"recording goes on with that env's next episode ({len(self.dropped)} dropped so far, see .dropped)",
                RecordingWarning,
                stacklevel=4,
            )

    def _refused(self, envs: np.ndarray, steps: np.ndarray, err: StoreError) -> list[DroppedEpisode]:
        """The pending episodes of ``envs`` lost a step or their end: a new writer; returns those episodes."""
        self.writer = self.store.writer(self.n_envs)
        reason = f"{type(err).__name__}: {err}"
        return [DroppedEpisode(e, int(steps[e]), reason) for e in np.flatnonzero(envs).tolist()]

    def reset(self, obs: Mapping[str, Any], envs: np.ndarray | None) -> None:
        """After ``envs`` (a mask; None: all) were reset: end their unfinished episodes as truncated, keep ``obs``."""
        chosen = np.ones(self.n_envs, bool) if envs is None else envs
        writer = self.writer
        n, seen, before = len(writer.episode_ids), len(writer.dropped), writer.pending_steps.copy()
        try:
            writer.flush_partial(np.flatnonzero(chosen).tolist())
        except StoreError as err:
            pending = writer.pending_steps > 0
            if (pending & chosen).any():  # the last next_obs was refused: no pending episode can be ended
                self._report(self._refused(pending, before, err))
                self.lost |= pending & ~chosen
        finally:
            self.episode_ids += writer.episode_ids[n:]
            self._report(writer.dropped[seen:])
            if self.last_obs is None or envs is None:
                self.last_obs = {k: np.array(v) for k, v in obs.items()}
            else:
                for k, v in self.last_obs.items():
                    v[chosen] = obs[k][chosen]
            self.lost &= ~chosen

    def step(
        self,
        next_obs: Mapping[str, Any],
        action: Any,
        reward: Any,
        terminated: np.ndarray,
        truncated: np.ndarray,
        infos: Any,
        obs: Mapping[str, Any],
        skip: np.ndarray,
    ) -> None:
        """Stage one step of every env but ``skip``; ``obs`` is what the envs start their next step from."""
        self.require_reset()
        done = terminated | truncated
        skipped = skip | self.lost
        writer = self.writer
        n, seen, before = len(writer.episode_ids), len(writer.dropped), writer.pending_steps.copy()
        try:
            writer.add(self.last_obs, next_obs, action, reward, terminated, truncated, infos, skip=skipped)
        except StoreError as err:
            if not np.array_equal(writer.pending_steps, np.where(done | skipped, 0, before + 1)):
                # the step was refused: the episodes it belonged to can no longer be recorded whole
                self._report(self._refused(~skipped, before + 1, err))
                self.lost |= ~skip
        finally:
            self.episode_ids += writer.episode_ids[n:]
            self._report(writer.dropped[seen:])
            self.lost &= ~done
            self.last_obs = {k: np.array(v) for k, v in obs.items()}

    def close(self) -> None:
        """End the unfinished episodes as truncated; close (and so commit) the store if the recorder opened it.

        A store given open is its owner's to commit and close.
        """
        try:
            if self.last_obs is not None:
                self.reset(self.last_obs, None)
        finally:
            if self.owned:
                self.store.close()


def _env_id(env: gym.Env | VectorEnv) -> str | None:
    spec = getattr(env, "spec", None)
    return None if spec is None else spec.id


class _Recording:
    """What both recorders show of their recording: the episode ids, the dropped episodes, a commit on demand."""

    _recorder: _Recorder
    store: EpisodeStore

    def _record_into(self, store: EpisodeStore, owned: bool, n_envs: int) -> None:
        self._recorder = _Recorder(store, owned, n_envs, f"{type(self).__name__} into {store.url}")
        self._close = weakref.finalize(self, self._recorder.close)  # once: by close, garbage collection or exit
        self.store = store

    @property
    def episode_ids(self) -> list[int]:
        """The ids of the episodes recorded so far, of every env, durable once the store commits them (see the class
        docstring)."""
        return self._recorder.episode_ids

    @property
    def dropped(self) -> list[DroppedEpisode]:
        """The episodes not recorded, as :class:`~her_store.store.step_writer.DroppedEpisode` (env, steps, the
        store's reason)."""
        return self._recorder.dropped

    def flush(self) -> None:
        """Commit the store now: every id in :attr:`episode_ids` then survives a killed process.

        Running episodes stay pending: they are ended by the env, a reset or ``close``, not here.

        Examples
        --------
        >>> env.flush()  # the ids listed so far are committed  # doctest: +SKIP
        """
        self.store.flush()


class RecordEpisodes(_Recording, gym.Wrapper):
    """Write every episode of a running env into a her_store store, whatever policy drives it.

    Each step is staged in the store's :class:`~her_store.store.step_writer.StepWriter`; an episode is appended when
    the env reports ``terminated`` or ``truncated`` (its final observation is the one that step returned), with the
    info keys the store declares. An episode still running when the env is reset or closed is ended as truncated at its
    last step: every step the env produced is kept, and a truncated end lets HER bootstrap from it as from a time
    limit. Wrap the goal env itself (Dict observations), inside any flattening wrapper. A wrapper that is never
    closed does the same when it is garbage collected or the interpreter exits.

    The recorder never hides what the env returned: ``step`` and ``reset`` always return the env's values, and what
    the store refuses is reported, not raised. A step the store refuses (a value its space cannot hold) drops the
    episode it belonged to (never spliced around the gap), and recording resumes with the env's next episode; an
    episode the store cannot append (longer than its capacity, or a failed write) is dropped too. Each dropped
    episode is warned about (:class:`RecordingWarning`, naming the env, the episode's steps and the store's reason;
    turn it into an error with ``warnings.simplefilter("error", RecordingWarning)``) and listed in :attr:`dropped`.
    Steps the env takes after its episode ended and before a reset (a loop that does not reset) belong to no
    episode and are not recorded (a RecordingWarning says so).

    Episode ids are given when an episode is appended and are durable once the store commits them: at its group
    commit (every ``commit_interval`` seconds), at ``store.flush()`` or at :meth:`close`. A process killed before
    that loses the episodes appended since the last commit, and the store then gives their ids to the next episodes
    it appends: call :meth:`flush` when the ids in :attr:`episode_ids` must survive a kill.

    Inside the env fns of a ``SyncVectorEnv`` several recorders may share one open store; an ``AsyncVectorEnv``'s
    workers cannot write the parent's store (one writer per store): wrap the vector env with
    :class:`RecordVectorEpisodes` instead.

    Parameters
    ----------
    env : gymnasium.Env
        A goal env; for a vector env use :class:`RecordVectorEpisodes`.
    store : EpisodeStore or path
        A store opened for appending, whose spaces must be the env's; or a path or URL, opened or created with
        :func:`~her_store.datasets.opening.open_store` with the env's spaces (and then closed by :meth:`close`).
    **store_options
        For a path: passed to :func:`~her_store.datasets.opening.open_store` (``capacity``, ``info_keys``,
        ``metadata``, ...).

    Attributes
    ----------
    store : EpisodeStore
        The store written to (sample it with a HerSampler while recording).

    Raises
    ------
    SchemaMismatchError
        The store's spaces (or its card's env_id) are not the env's.
    gymnasium.error.ResetNeeded
        A step before the first reset (the env is not stepped).

    Examples
    --------
    >>> import tempfile
    >>> env = RecordEpisodes(gym.make("her_store/PointGoal-v0"), tempfile.mkdtemp() + "/rollouts",
    ...                      info_keys=["is_success"])
    >>> obs, info = env.reset(seed=0)
    >>> for _ in range(100):
    ...     obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    ...     if terminated or truncated:
    ...         obs, info = env.reset()
    >>> env.close()  # the unfinished episode is ended as truncated; the store is committed and closed
    >>> env.episode_ids, env.dropped  # two 50-step episodes; none refused
    ([0, 1], [])
    """

    def __init__(self, env: gym.Env, store: EpisodeStore | str | os.PathLike[str], **store_options: Any) -> None:
        if not isinstance(env, gym.Env):
            raise TypeError(
                f"RecordEpisodes wraps a gymnasium.Env, got {type(env).__name__}; wrap a vector env with "
                "RecordVectorEpisodes (one writer for all its envs)"
            )
        super().__init__(env)
        self._record_into(*_open(store, env.observation_space, env.action_space, _env_id(env), store_options), 1)
        self._ended = False  # the env's episode ended and it was not reset since

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._recorder.reset(_one(obs), None)
        self._ended = False
        return obs, info

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        self._recorder.require_reset()
        obs, reward, terminated, truncated, info = self.env.step(action)
        if self._ended:
            warnings.warn(
                f"RecordEpisodes into {self.store.url}: the env was stepped after its episode ended, without a reset; "
                "such steps belong to no episode and are not recorded",
                RecordingWarning,
                stacklevel=2,
            )
        skip = np.array([self._ended])
        self._ended = self._ended or bool(terminated or truncated)
        batch = _one(obs)
        self._recorder.step(
            batch,
            np.asarray(action)[None],
            np.asarray(reward)[None],
            np.array([terminated], bool),
            np.array([truncated], bool),
            [info],
            batch,
            skip,
        )
        return obs, reward, terminated, truncated, info

    def close(self) -> None:
        """End the unfinished episode as truncated, close the store if the wrapper opened it, close the env."""
        try:
            self._close()
        finally:
            super().close()


def _one(obs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One env's observation as a batch of one."""
    return {k: np.asarray(v)[None] for k, v in obs.items()}


class RecordVectorEpisodes(_Recording, VectorWrapper):
    """Write every episode of every env of a gymnasium vector env into one her_store store.

    A store has one writer (a lock), so the recorder wraps the whole vector env, sync or async, in the process that
    steps it, and feeds one :class:`~her_store.store.step_writer.StepWriter` of ``num_envs`` envs. Episodes end and are
    appended as with :class:`RecordEpisodes`, each with its env's index in the store's episode table. The vector
    env's autoreset mode is read from its metadata: next-step (gymnasium's default: the step after an env's last
    is its reset, and is not recorded), same-step (the final observation and info of an ended episode come from
    ``infos["final_obs"]`` and ``infos["final_info"]``) and disabled (reset ended envs with
    ``options={"reset_mask": ...}``). Episodes running when envs are reset or the recorder is closed are ended as
    truncated at their last step. As with :class:`RecordEpisodes`, ``step`` and ``reset`` always return the vector
    env's values: an episode the store refuses or fails to append is dropped, warned about
    (:class:`RecordingWarning`, naming its env) and listed in :attr:`dropped`, and episode ids are durable once the
    store commits them (its group commit, :meth:`flush` or :meth:`close`).

    Parameters
    ----------
    env : gymnasium.vector.VectorEnv
        Of goal envs (Dict observations).
    store : EpisodeStore or path
        As for :class:`RecordEpisodes`: a store open for appending with the envs' single spaces, or a path.
    **store_options
        For a path: passed to :func:`~her_store.datasets.opening.open_store`.

    Examples
    --------
    >>> import tempfile
    >>> envs = gym.make_vec("her_store/PointGoal-v0", num_envs=4, vectorization_mode="async")
    >>> envs = RecordVectorEpisodes(envs, tempfile.mkdtemp() + "/rollouts", info_keys=["is_success"])
    >>> obs, infos = envs.reset(seed=0)
    >>> for _ in range(200):
    ...     obs, rewards, terminated, truncated, infos = envs.step(envs.action_space.sample())
    >>> envs.close()
    >>> len(envs.episode_ids)
    16
    """

    def __init__(self, env: VectorEnv, store: EpisodeStore | str | os.PathLike[str], **store_options: Any) -> None:
        if not isinstance(env, VectorEnv):
            raise TypeError(
                f"RecordVectorEpisodes wraps a gymnasium vector env, got {type(env).__name__}; wrap a single env with "
                "RecordEpisodes"
            )
        super().__init__(env)
        self.autoreset_mode = AutoresetMode(env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        opened = _open(store, env.single_observation_space, env.single_action_space, _env_id(env), store_options)
        self._record_into(*opened, env.num_envs)
        self._autoreset = np.zeros(env.num_envs, bool)  # next-step mode: envs whose next step is their reset

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        mask = None if options is None else options.get("reset_mask")  # read first: the vector env pops it
        obs, infos = self.env.reset(seed=seed, options=options)
        envs = None if mask is None else np.asarray(mask, bool)
        self._autoreset[slice(None) if envs is None else envs] = False
        self._recorder.reset(obs, envs)
        return obs, infos

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self._recorder.require_reset()
        obs, rewards, terminated, truncated, infos = self.env.step(actions)
        terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
        done = terminated | truncated
        next_obs, step_infos = obs, infos
        if self.autoreset_mode == AutoresetMode.SAME_STEP and done.any():
            next_obs, step_infos = self._final(obs, infos, done)
        skip = self._autoreset.copy()
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            self._autoreset = done
        self._recorder.step(next_obs, actions, rewards, terminated, truncated, step_infos, obs, skip)
        return obs, rewards, terminated, truncated, infos

    def _final(
        self, obs: Mapping[str, np.ndarray], infos: Mapping[str, Any], done: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Same-step autoreset: ended envs' rows of ``obs`` and of the store's info keys replaced by their final
        ones."""
        next_obs = {k: np.array(v) for k, v in obs.items()}
        for i in np.flatnonzero(done).tolist():  # once per ended episode
            for k, v in next_obs.items():
                v[i] = infos["final_obs"][i][k]
        final = infos.get("final_info", {})
        step_infos = dict(infos)
        for key in self._recorder.store.info_keys:
            now, last = np.asarray(infos.get(key, 0)), np.asarray(final.get(key, 0))
            ended = done.reshape(-1, *[1] * (max(now.ndim, last.ndim) - 1))
            step_infos[key] = np.where(ended, last, now)
        return next_obs, step_infos

    def close(self, **kwargs: Any) -> None:
        """End the unfinished episodes as truncated, close the store if the wrapper opened it, close the envs."""
        try:
            self._close()
        finally:
            super().close(**kwargs)
