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
        self._steps = 64
        self._buf = {f.name: np.zeros((self._steps, n_envs, *f.shape), f.dtype) for f in self._fields}
        self._last_next = {k: np.zeros((n_envs, *self._buf[k].shape[2:]), self._buf[k].dtype) for k in self._obs_keys}
        self._t = 0
        self._start = np.zeros(n_envs, np.int64)
        self.episode_ids: list[int] = []

    @property
    def pending_steps(self) -> np.ndarray:
        """Steps staged per env for episodes that have not ended yet."""
        return self._t - self._start

    def _put(self, name: str, t: int, value: Any) -> None:
        buf = self._buf[name]
        v = np.asarray(value)
        if v.shape != buf.shape[1:]:
            if v.size != int(np.prod(buf.shape[1:])):
                raise EpisodeValidationError(
                    f"field {name!r} of one step has shape {v.shape}, expected {buf.shape[1:]} (n_envs={self.n_envs})"
                )
            v = v.reshape(buf.shape[1:])
        if v.dtype != buf.dtype and not np.can_cast(v.dtype, buf.dtype, casting="same_kind"):
            raise EpisodeValidationError(f"field {name!r} has dtype {v.dtype}, expected {buf.dtype} (or one that casts to it)")
        buf[t] = v

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
        for k in self._obs_keys:
            self._put(k, t, obs[k])
        self._put("action", t, action)
        self._put("reward", t, reward)
        self._put("terminated", t, terminated)
        self._put("truncated", t, truncated)
        for k in self._info_keys:
            self._put(k, t, _info_column(infos, k, self.n_envs))
        for k in self._obs_keys:
            self._last_next[k][...] = next_obs[k]
        self._t = t + 1
        done = self._buf["terminated"][t] | self._buf["truncated"][t]
        if not done.any():
            return []
        return [self._finish(int(e)) for e in np.flatnonzero(done)]

    def _finish(self, e: int) -> int:
        s, t = int(self._start[e]), self._t
        episode = {}
        for f in self._fields:
            rows = self._buf[f.name][s:t, e]
            episode[f.name] = rows if f.per_step else np.concatenate([rows, self._last_next[f.name][e : e + 1]])
        episode_id = self.store.append_episode(episode, env_index=e)
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
