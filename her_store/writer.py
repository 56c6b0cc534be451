"""StepWriter: vectorised per-step adds for n_envs environments whose episodes interleave, appended whole on done."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from her_store.errors import EpisodeValidationError
from her_store.schema import Field

if TYPE_CHECKING:
    from her_store.store import EpisodeStore

__all__ = ["StepWriter"]


class StepWriter:
    """Assemble episodes from the steps of ``n_envs`` environments and append each when it ends.

    Steps are staged time-major (``(step, env, ...)`` arrays), so one ``add`` is one array write per field
    whatever ``n_envs`` is. An env's episode ends when it reports ``terminated`` or ``truncated``; that step's
    ``next_obs`` becomes the final observation (for SB3 and gymnasium vector envs, the terminal observation,
    not the reset one).

    Parameters
    ----------
    store : EpisodeStore
        Opened for appending.
    n_envs : int
        Number of environments stepped together.

    Examples
    --------
    >>> w = store.writer(n_envs=2)  # doctest: +SKIP
    >>> w.add(obs, next_obs, action, reward, terminated, truncated, infos)  # doctest: +SKIP
    >>> w.flush_partial()  # end unfinished episodes as truncated  # doctest: +SKIP
    """

    def __init__(self, store: EpisodeStore, n_envs: int) -> None:
        if n_envs < 1:
            raise ValueError(f"n_envs must be >= 1, got {n_envs}")
        self.store = store
        self.n_envs = int(n_envs)
        self._fields: tuple[Field, ...] = store.schema.fields
        self._obs_keys = store.schema.observation_keys
        self._info_keys = store.schema.info_keys
        self._steps = 1024
        self._buf = {f.name: np.zeros((self._steps, n_envs, *f.shape), f.dtype) for f in self._fields}
        self._slots()
        # The next_obs of the last add, by reference: it is only read by flush_partial, before the env steps again.
        self._last_next: Mapping[str, Any] | None = None
        self._t = 0
        self._start = np.zeros(n_envs, np.int64)
        self.episode_ids: list[int] = []

    def _slots(self) -> None:
        """Per field: (name, rows, row shape, dtype), looked up once rather than per step.

        ``rows`` is a list of the buffer's row views: ``rows[t][...] = v`` costs about 60 % of ``buf[t] = v``,
        and add is the hot path of data collection. Past 65,536 staged steps (very long episodes) the buffer
        itself stands in (same syntax, no list of views).
        """

        def slot(name: str) -> tuple[str, Any, tuple[int, ...], np.dtype]:
            buf = self._buf[name]
            return name, (list(buf) if len(buf) <= 1 << 16 else buf), buf.shape[1:], buf.dtype

        self._obs_slots = [slot(k) for k in self._obs_keys]
        self._info_slots = [slot(k) for k in self._info_keys]
        self._action, self._reward = slot("action"), slot("reward")
        self._term, self._trunc = slot("terminated"), slot("truncated")

    @property
    def pending_steps(self) -> np.ndarray:
        """Steps staged per env for episodes that have not ended yet."""
        return self._t - self._start

    def _checked(self, name: str, value: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """The slow path of add: reshape (e.g. SB3's (n_envs, 1) Discrete actions) or refuse with the field named."""
        v = np.asarray(value)
        if v.shape != shape:
            if v.size != int(np.prod(shape)):
                raise EpisodeValidationError(
                    f"field {name!r} of one step has shape {v.shape}, expected {shape} (n_envs={self.n_envs})"
                )
            v = v.reshape(shape)
        if v.dtype != dtype and not np.can_cast(v.dtype, dtype, casting="same_kind"):
            raise EpisodeValidationError(f"field {name!r} has dtype {v.dtype}, expected {dtype} (or one that casts to it)")
        return v

    def _make_room(self) -> None:
        lo = int(self._start.min())
        if lo > 0:  # shift the unfinished steps to the front
            for buf in self._buf.values():
                buf[: self._t - lo] = buf[lo : self._t]
            self._start -= lo
            self._t -= lo
        if self._t >= self._steps:
            self._steps *= 2
            for name, buf in self._buf.items():
                grown = np.zeros((self._steps, *buf.shape[1:]), buf.dtype)
                grown[: self._t] = buf[: self._t]
                self._buf[name] = grown
            self._slots()

    def add(
        self,
        obs: Mapping[str, Any],
        next_obs: Mapping[str, Any],
        action: Any,
        reward: Any,
        terminated: Any,
        truncated: Any,
        infos: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Stage one step of every env; append the episodes that ended. Returns the ids of appended episodes.

        Parameters
        ----------
        obs, next_obs : mapping of str to array
            Each observation key with ``(n_envs, *shape)``; ``next_obs`` holds the terminal observation for envs
            that ended on this step.
        action : array
            ``(n_envs, *action shape)``.
        reward, terminated, truncated : array
            ``(n_envs,)``.
        infos : list of dicts (SB3) or dict of arrays (gymnasium vector envs), optional
            Source of the store's info keys (missing entries are 0).
        """
        if self._t >= self._steps:
            self._make_room()
        t = self._t
        # Unrolled on purpose: one dict lookup, one shape/dtype check and one row copy per field. A value whose
        # shape or dtype is not exactly the buffer's (or that is no ndarray) takes the checked path: a safe cast or
        # a clear error.
        try:
            for name, rows, shape, dtype in self._obs_slots:
                v = obs[name]
                if v.shape != shape or v.dtype is not dtype:
                    v = self._checked(name, v, shape, dtype)
                rows[t][...] = v
            name, rows, shape, dtype = self._action
            if action.shape != shape or action.dtype is not dtype:
                action = self._checked(name, action, shape, dtype)
            rows[t][...] = action
            name, rows, shape, dtype = self._reward
            if reward.shape != shape or reward.dtype is not dtype:
                reward = self._checked(name, reward, shape, dtype)
            rows[t][...] = reward
            name, rows, shape, dtype = self._term
            if terminated.shape != shape or terminated.dtype is not dtype:
                terminated = self._checked(name, terminated, shape, dtype)
            rows[t][...] = terminated
            name, rows, shape, dtype = self._trunc
            if truncated.shape != shape or truncated.dtype is not dtype:
                truncated = self._checked(name, truncated, shape, dtype)
            rows[t][...] = truncated
        except AttributeError:  # a list, a scalar, a tensor: convert every field, then take the fast path
            return self.add(
                {k: np.asarray(obs[k]) for k in self._obs_keys},
                next_obs,
                np.asarray(action),
                np.asarray(reward),
                np.asarray(terminated),
                np.asarray(truncated),
                infos,
            )
        for name, rows, shape, dtype in self._info_slots:
            rows[t][...] = self._checked(name, _info_column(infos, name, self.n_envs), shape, dtype)
        self._last_next = next_obs
        self._t = t + 1
        if self.n_envs == 1:
            return [self._finish(0)] if terminated[0] or truncated[0] else []
        done = terminated | truncated
        return [self._finish(int(e)) for e in np.flatnonzero(done)] if done.any() else []

    def _finish(self, e: int) -> int:
        if self._t >= self._steps:
            self._make_room()
        s, t = int(self._start[e]), self._t
        # the final observation goes in row t, which the next add overwrites: the episode's rows stay one slice
        assert self._last_next is not None
        for k in self._obs_keys:
            self._buf[k][t, e] = self._last_next[k][e]
        episode = {f.name: self._buf[f.name][s : t if f.per_step else t + 1, e] for f in self._fields}
        episode_id = self.store._append_checked(t - s, episode, e)
        self._start[e] = t
        self.episode_ids.append(episode_id)
        return episode_id

    def flush_partial(self) -> list[int]:
        """End every unfinished episode as truncated at its last step (what SB3's truncate_last_trajectory does).

        The final observation is the ``next_obs`` of that env's last add. Returns the appended episode ids.
        """
        ids = []
        for e in np.flatnonzero(self._t > self._start):
            self._buf["truncated"][self._t - 1, e] = True
            ids.append(self._finish(int(e)))
        return ids


def _info_column(infos: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None, key: str, n_envs: int) -> np.ndarray:
    if infos is None:
        return np.zeros(n_envs, np.float32)
    if isinstance(infos, Mapping):  # gymnasium vector envs: dict of per-env arrays
        return np.asarray(infos.get(key, np.zeros(n_envs)))
    return np.array([info.get(key, 0) for info in infos])
