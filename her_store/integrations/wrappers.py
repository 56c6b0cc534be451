"""Env wrappers: SB2's goal-env flattener for gymnasium, and recorders writing every finished episode into a store.

:class:`GoalEnvFlattener` is stable-baselines (v2)'s ``HERGoalEnvWrapper`` for gymnasium: a goal env's Dict
observation as one flat vector (``observation``, ``achieved_goal``, ``desired_goal``), reversibly.
:class:`RecordEpisodes` (one env) and :class:`RecordVectorEpisodes` (a gymnasium vector env) turn any policy's
rollouts into a her_store dataset through the store's :class:`~her_store.store.step_writer.StepWriter`.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv, VectorWrapper

from her_store.errors import EpisodeValidationError, SchemaMismatchError, StoreError
from her_store.format.schema import GOAL_KEYS, Field, Schema, conform
from her_store.datasets.opening import open_store
from her_store.store.episode_store import EpisodeStore
from her_store.store.step_writer import DroppedEpisode

__all__ = ["GoalEnvFlattener", "RecordEpisodes", "RecordVectorEpisodes", "RecordingWarning"]

_FLAT_KINDS = (spaces.Box, spaces.MultiBinary, spaces.Discrete)


def _kind(space: spaces.Space) -> type[spaces.Space] | None:
    return next((k for k in _FLAT_KINDS if isinstance(space, k)), None)


def _flat_space(keys: Sequence[str], subs: Sequence[spaces.Space]) -> spaces.Space:
    """SB2's rule: one type for every sub-space; Box -> Box, MultiBinary -> MultiBinary, Discrete -> MultiDiscrete."""
    for k, s in zip(keys, subs):
        if _kind(s) is None:
            raise TypeError(
                f"observation_space[{k!r}] is {type(s).__name__}; GoalEnvFlattener flattens Box, MultiBinary and "
                "Discrete sub-spaces"
            )
    if len({_kind(s) for s in subs}) > 1:
        kinds = ", ".join(f"{k!r} is {type(s).__name__}" for k, s in zip(keys, subs))
        raise TypeError(
            f"GoalEnvFlattener needs sub-spaces of one type (as SB2's HERGoalEnvWrapper), got {kinds}; the flat "
            "space would have to change the values of some of them"
        )
    if isinstance(subs[0], spaces.MultiBinary):
        return spaces.MultiBinary(sum(int(np.prod(s.shape)) for s in subs))
    dtype = _exact_dtype(keys, subs)
    if isinstance(subs[0], spaces.Box):
        low = np.concatenate([np.ravel(s.low) for s in subs]).astype(dtype)
        high = np.concatenate([np.ravel(s.high) for s in subs]).astype(dtype)
        return spaces.Box(low, high, dtype=dtype)
    discrete = [s for s in subs if isinstance(s, spaces.Discrete)]
    return spaces.MultiDiscrete([int(s.n) for s in discrete], dtype=dtype, start=[int(s.start) for s in discrete])


def _exact_dtype(keys: Sequence[str], subs: Sequence[spaces.Space]) -> np.dtype:
    """The dtype that holds every sub-space's dtype, or TypeError if it cannot hold every value of one exactly.

    Only integers in a float can be lost: numpy's common dtype of int64 and float64 (or of uint64 and int64) is
    float64, which holds integers exactly only up to 2**53. An integer sub-space is accepted when its bounds lie
    within that range.
    """
    dtype = np.result_type(*(s.dtype for s in subs))
    if dtype.kind != "f":
        return dtype
    dtypes = ", ".join(f"{k!r} {s.dtype}" for k, s in zip(keys, subs))
    if isinstance(subs[0], spaces.Discrete):
        raise TypeError(
            f"the Discrete sub-spaces' dtypes ({dtypes}) have no common integer dtype (numpy's is {dtype}), which a "
            "MultiDiscrete needs; give them integer dtypes of one signedness"
        )
    limit = 2 ** (np.finfo(dtype).nmant + 1)
    inexact = []
    for k, s in zip(keys, subs):
        if np.dtype(s.dtype).kind not in "iu":
            continue
        low, high = int(np.min(s.low)), int(np.max(s.high))
        if max(-low, high) > limit:
            inexact.append(f"observation_space[{k!r}] ({s.dtype}, bounds {low}..{high})")
    if inexact:
        raise TypeError(
            f"GoalEnvFlattener's flat vector would be {dtype} (the common dtype of {dtypes}), which cannot hold "
            f"every value of {' and '.join(inexact)} exactly: {dtype} holds integers exactly only within "
            f"+-2**{np.finfo(dtype).nmant + 1}; give those sub-spaces bounds within that range, or dtypes of one kind"
        )
    return dtype


def _cast(value: np.ndarray, dtype: np.dtype, label: str) -> np.ndarray:
    """``value`` in ``dtype``, or ValueError if the cast would change a value.

    The store's rules (:func:`~her_store.format.schema.conform`: no integer wrapped, no finite float turned into inf, a
    narrower float rounds), plus: an integer becomes a float only if the float holds it exactly, and a float becomes
    an integer (a flat float vector's integer sub-space) or a signed integer an unsigned one only if the integer
    dtype holds it.
    The caller has checked that ``value``'s dtype casts to ``dtype`` within its kind, or is a float going back to
    an integer sub-space.
    """
    if value.dtype.kind in "iu" and dtype.kind == "f":
        cast = value.astype(dtype)
        with np.errstate(invalid="ignore"):  # a float beyond the integer dtype comes back changed: refused below
            changed = cast.astype(value.dtype) != value
    elif dtype.kind in "iu" and not np.can_cast(value.dtype, dtype, casting="same_kind"):
        info = np.iinfo(dtype)  # a float, or a signed integer going back to an unsigned sub-space
        if value.dtype.kind == "f":  # info.max + 1.0 is exact (a power of two), info.max as a float may round up
            changed = ~np.isfinite(value) | (value < info.min) | (value >= info.max + 1.0) | (np.trunc(value) != value)
        else:
            changed = (value < info.min) | (value > info.max)
        with np.errstate(invalid="ignore"):
            cast = value.astype(dtype)
    else:
        try:
            return conform(value, Field(label, dtype, (), True, "observation"), None, label)
        except EpisodeValidationError as err:
            raise ValueError(str(err)) from None
    if changed.any():
        at = tuple(int(i) for i in np.argwhere(changed)[0])
        raise ValueError(f"{label} has {value[at].item()!r} at {at}, which {dtype} cannot hold exactly")
    return cast


class GoalEnvFlattener(gym.ObservationWrapper):
    """A goal env whose Dict observations become one flat vector: SB2's ``HERGoalEnvWrapper`` for gymnasium.

    The flat vector holds ``observation``, ``achieved_goal`` and ``desired_goal`` in that order (SB2's), each
    flattened, then any other keys of the Dict in its order. The achieved goal is kept, so the transformation is
    reversible: :meth:`convert_obs_to_dict` gives back the Dict exactly, with each key's shape and dtype.

    Every sub-space must be of one type (SB2's rule), and the flat space's type follows it: Box sub-spaces give a
    Box (bounds concatenated, the dtype that holds every sub-space's), MultiBinary give a MultiBinary, Discrete give
    a MultiDiscrete with one entry per key (its ``n`` and ``start``). Other or mixed types raise TypeError, and so
    do dtypes whose common flat dtype cannot hold every value of a sub-space exactly (an int64 observation with
    bounds beyond 2**53 and float64 goals; uint64 with int64: numpy's common dtype of both is float64).

    No value is ever changed silently: both conversions refuse (ValueError, naming the key and the entry) a value
    the cast would change, as the store does (an integer a dtype cannot hold, a finite float that would become
    inf), and an integer that a float cannot hold exactly. A float narrowed to a smaller float (float64 given to a
    float32 space) is rounded, as the store rounds it.

    Parameters
    ----------
    env : gymnasium.Env
        With a Dict observation space holding ``observation``, ``achieved_goal`` and ``desired_goal``.

    Attributes
    ----------
    keys : tuple of str
        The Dict's keys in the order of the flat vector.
    obs_dim, goal_dim : int
        Entries of the flat vector taken by ``observation`` and by each goal (SB2's names).

    Examples
    --------
    >>> import gymnasium as gym, her_store
    >>> env = GoalEnvFlattener(gym.make("her_store/PointGoal-v0"))
    >>> obs, info = env.reset(seed=0)
    >>> obs.shape, env.observation_space.shape
    ((8,), (8,))
    >>> goals = env.convert_obs_to_dict(obs)
    >>> float(env.compute_reward(goals["achieved_goal"], goals["desired_goal"], info))
    -1.0
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        space = env.observation_space
        if not isinstance(space, spaces.Dict):
            raise TypeError(
                f"GoalEnvFlattener needs a Dict observation space with keys {list(GOAL_KEYS)}, got "
                f"{type(space).__name__}"
            )
        missing = [k for k in GOAL_KEYS if k not in space.spaces]
        if missing:
            raise ValueError(
                f"the observation space has no {missing}; GoalEnvFlattener needs the keys {list(GOAL_KEYS)}"
            )
        self.keys: tuple[str, ...] = (*GOAL_KEYS, *(k for k in space.spaces if k not in GOAL_KEYS))
        subs = [space.spaces[k] for k in self.keys]
        self.observation_space = _flat_space(self.keys, subs)
        self._shapes = tuple(tuple(s.shape) for s in subs)  # a Discrete's shape is (): one entry
        self._dtypes = tuple(np.dtype(s.dtype) for s in subs)
        self._sizes = tuple(int(np.prod(shape)) for shape in self._shapes)
        ends = np.cumsum(self._sizes).tolist()
        self._slices = tuple(slice(end - size, end) for end, size in zip(ends, self._sizes))
        self.obs_dim, self.goal_dim = self._sizes[0], self._sizes[1]

    def observation(self, observation: Mapping[str, Any]) -> np.ndarray:
        """What reset and step return: :meth:`convert_dict_to_obs` of the env's observation."""
        return self.convert_dict_to_obs(observation)

    def convert_dict_to_obs(self, obs_dict: Mapping[str, Any]) -> np.ndarray:
        """The flat vector of a Dict observation, or of a batch of them (any leading axes, the same for every key).

        Raises
        ------
        ValueError
            A key is missing, or a value's shape is not ``(*batch, *the key's shape)`` with one batch for all keys,
            or a value the flat dtype cannot hold exactly (see the class docstring).
        TypeError
            A value's dtype does not cast to the flat space's within its kind (floats for a MultiBinary space).

        Examples
        --------
        >>> import gymnasium as gym, her_store
        >>> env = GoalEnvFlattener(gym.make("her_store/PointGoal-v0"))
        >>> env.convert_dict_to_obs({k: np.zeros((32, 2 if "goal" in k else 4)) for k in env.keys}).shape
        (32, 8)
        """
        if not isinstance(obs_dict, Mapping):
            raise TypeError(f"obs_dict must be a mapping of {list(self.keys)} to arrays, got {type(obs_dict).__name__}")
        missing = [k for k in self.keys if k not in obs_dict]
        if missing:
            raise ValueError(f"obs_dict has no {missing}; expected the keys {list(self.keys)}")
        dtype = self.observation_space.dtype
        batch: tuple[int, ...] | None = None
        parts = []
        for k, shape, size in zip(self.keys, self._shapes, self._sizes):
            v = np.asarray(obs_dict[k])
            lead = v.ndim - len(shape)
            if lead < 0 or v.shape[lead:] != shape:
                raise ValueError(f"obs_dict[{k!r}] has shape {v.shape}, expected (*batch, {', '.join(map(str, shape))})")
            if batch is None:
                batch = v.shape[:lead]
            elif v.shape[:lead] != batch:
                raise ValueError(
                    f"obs_dict[{k!r}] has batch shape {v.shape[:lead]}, obs_dict[{self.keys[0]!r}] has {batch}"
                )
            if not np.can_cast(v.dtype, dtype, casting="same_kind"):
                raise TypeError(f"obs_dict[{k!r}] has dtype {v.dtype}, which does not cast to the flat {dtype}")
            parts.append(_cast(v, dtype, f"obs_dict[{k!r}]").reshape(*batch, size))
        return np.concatenate(parts, axis=-1, dtype=dtype)

    def convert_obs_to_dict(self, observations: Any) -> dict[str, np.ndarray]:
        """The Dict observation of a flat vector (or of a batch: any leading axes), each key in its shape and dtype.

        Raises
        ------
        ValueError
            The last axis is not the flat space's size, or a value the flat dtype or its key's dtype cannot hold
            exactly (see the class docstring).
        TypeError
            The dtype does not cast to the flat space's within its kind.

        Examples
        --------
        >>> import gymnasium as gym, her_store
        >>> env = GoalEnvFlattener(gym.make("her_store/PointGoal-v0"))
        >>> {k: v.shape for k, v in env.convert_obs_to_dict(np.zeros((32, 8), np.float32)).items()}
        {'observation': (32, 4), 'achieved_goal': (32, 2), 'desired_goal': (32, 2)}
        """
        v = np.asarray(observations)
        size, dtype = sum(self._sizes), self.observation_space.dtype
        if v.ndim < 1 or v.shape[-1] != size:
            raise ValueError(f"observations have shape {v.shape}, expected (*batch, {size})")
        if not np.can_cast(v.dtype, dtype, casting="same_kind"):
            raise TypeError(f"observations have dtype {v.dtype}, which does not cast to the flat {dtype}")
        v, batch = _cast(v, dtype, "the flat vector"), v.shape[:-1]
        return {
            k: _cast(v[..., sl], sub_dtype, f"the flat vector[..., {sl.start}:{sl.stop}] ({k!r})").reshape((*batch, *shape))
            for k, sl, shape, sub_dtype in zip(self.keys, self._slices, self._shapes, self._dtypes)
        }

    def compute_reward(self, achieved_goal: Any, desired_goal: Any, info: Any) -> Any:
        """The wrapped goal env's ``compute_reward`` (goals are not flattened)."""
        return self.env.get_wrapper_attr("compute_reward")(achieved_goal, desired_goal, info)


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
        """The episodes not recorded, as :class:`~her_store.store.step_writer.DroppedEpisode` (env, steps, the store's reason)."""
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

    Each step is staged in the store's :class:`~her_store.store.step_writer.StepWriter`; an episode is appended when the env
    reports ``terminated`` or ``truncated`` (its final observation is the one that step returned), with the info
    keys the store declares. An episode still running when the env is reset or closed is ended as truncated at its
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
        :func:`~her_store.store.episode_store.open_store` with the env's spaces (and then closed by :meth:`close`).
    **store_options
        For a path: passed to :func:`~her_store.store.episode_store.open_store` (``capacity``, ``info_keys``, ``metadata``, ...).

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
    >>> env = RecordEpisodes(gym.make("her_store/PointGoal-v0"), tempfile.mkdtemp() + "/rollouts", info_keys=["is_success"])
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
        For a path: passed to :func:`~her_store.store.episode_store.open_store`.

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
        """Same-step autoreset: ended envs' rows of ``obs`` and of the store's info keys replaced by their final ones."""
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
