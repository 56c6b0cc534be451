"""StepWriter: vectorised per-step adds for n_envs environments whose episodes interleave, appended whole on done."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from her_store import _kernels
from her_store.checks import check_int, is_int
from her_store.errors import EpisodeValidationError, StoreError, short_repr
from her_store.format.schema import Field, Schema, conform

__all__ = ["DroppedEpisode", "EpisodeSink", "StepWriter"]


@runtime_checkable
class EpisodeSink(Protocol):
    """What a :class:`StepWriter` appends its episodes to: an :class:`~her_store.store.episode_store.EpisodeStore`
    open for appending."""

    @property
    def url(self) -> str: ...

    @property
    def schema(self) -> Schema: ...

    def validate_episode(self, episode: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]: ...

    def append_validated(self, T: int, data: Mapping[str, np.ndarray], env_index: int = -1) -> int: ...


class DroppedEpisode(NamedTuple):
    """An ended episode a :class:`StepWriter` could not append: its env, its steps and why.

    Examples
    --------
    >>> DroppedEpisode(env=0, steps=6, reason="EpisodeValidationError: ...")
    DroppedEpisode(env=0, steps=6, reason='EpisodeValidationError: ...')
    """

    env: int
    steps: int
    reason: str


class StepWriter:
    """Assemble episodes from the steps of ``n_envs`` environments and append each when it ends.

    Steps are staged time-major (``(step, env, ...)`` arrays), so one ``add`` is one array write per field
    whatever ``n_envs`` is. An env's episode ends when it reports ``terminated`` or ``truncated``; that step's
    ``next_obs`` becomes the final observation (for SB3 and gymnasium vector envs, the terminal observation,
    not the reset one).

    A step that is refused (a missing key, a wrong shape, a value the stored dtype or the space cannot hold)
    changes nothing. An ended episode the store cannot append (longer than its capacity, or a failed write) is
    dropped: its env starts a new episode, the other envs' episodes are still appended, and ``add`` raises. Every
    dropped episode is also listed in :attr:`dropped`, so a caller can tell which env lost which episode.

    Parameters
    ----------
    store : EpisodeSink
        An EpisodeStore opened for appending.
    n_envs : int
        Number of environments stepped together.

    Attributes
    ----------
    episode_ids : list of int
        The ids of the episodes this writer appended, in order.
    dropped : list of DroppedEpisode
        The ended episodes it could not append, in order.

    Examples
    --------
    >>> w = store.writer(n_envs=2)  # doctest: +SKIP
    >>> w.add(obs, next_obs, action, reward, terminated, truncated, infos)  # doctest: +SKIP
    >>> w.flush_partial()  # end unfinished episodes as truncated  # doctest: +SKIP
    """

    def __init__(self, store: EpisodeSink, n_envs: int) -> None:
        if not isinstance(store, EpisodeSink):
            raise TypeError(f"StepWriter appends to an EpisodeStore open for appending, not {type(store).__name__} "
                            "(store.writer(n_envs) makes one)")
        self.store = store
        self.n_envs = check_int(n_envs, "n_envs", low=1)
        self._fields: tuple[Field, ...] = store.schema.fields
        self._obs_keys = store.schema.observation_keys
        self._info_keys = store.schema.info_keys
        # steps staged per env, doubled when an episode outgrows them: small, so that the rows a step is copied into
        # are pages touched before. A buffer of 1,024 steps of 8 images takes a page fault on each fresh page; one of
        # 128 steps gives a StepWriter(8) of 84x84x3 frames 1.4x the frames/s.
        self._steps = 128
        self._buf = {f.name: np.zeros((self._steps, n_envs, *f.shape), f.dtype) for f in self._fields}
        self._slots()
        # The next_obs of the last add, by reference (it is read only before the env steps again); checked when an
        # episode ended on it, else by flush_partial, the only other reader.
        self._last_next: Mapping[str, Any] | None = None
        self._t = 0
        self._start = np.zeros(n_envs, np.int64)
        self.episode_ids: list[int] = []
        self.dropped: list[DroppedEpisode] = []

    def _slots(self) -> None:
        """Per field: (name, rows, row shape, dtype of the fast path), looked up once rather than per step.

        ``rows`` is a list of the buffer's row views: ``rows[t][...] = v`` costs about 60 % of ``buf[t] = v``,
        and add is the hot path of data collection. Past 65,536 staged steps (very long episodes) the buffer
        itself stands in (same syntax, no list of views). The dtype is None for fields whose space bounds their
        values (Discrete, MultiDiscrete, MultiBinary): no value has dtype None, so theirs always take the checked
        path, which a value of the right dtype may still fail.
        """
        ranges = self.store.schema.value_ranges

        def slot(name: str) -> tuple[str, Any, tuple[int, ...], np.dtype | None]:
            buf = self._buf[name]
            rows = list(buf) if len(buf) <= 1 << 16 else buf
            return name, rows, buf.shape[1:], None if name in ranges else buf.dtype

        self._obs_slots = [slot(k) for k in self._obs_keys]
        self._info_slots = [slot(k) for k in self._info_keys]
        self._action, self._reward = slot("action"), slot("reward")
        self._term, self._trunc = slot("terminated"), slot("truncated")

    @property
    def pending_steps(self) -> np.ndarray:
        """Steps staged per env for episodes that have not ended yet."""
        return self._t - self._start

    def pending(self, env: int) -> dict[str, np.ndarray]:
        """A copy of ``env``'s unfinished episode, in the shape :meth:`EpisodeStore.append_episode` takes.

        Observation keys hold ``pending_steps[env] + 1`` rows (the last is that env's ``next_obs`` of the last
        add), the other fields ``pending_steps[env]`` rows. An env with no staged step gives zero-row arrays (and
        no observation row).

        Examples
        --------
        >>> w.add(obs, next_obs, action, reward, terminated, truncated)  # doctest: +SKIP
        >>> w.pending(0)["action"].shape  # doctest: +SKIP
        (1, 4)
        """
        env = check_int(env, "env")
        if not 0 <= env < self.n_envs:
            raise IndexError(f"env {env} out of range for a writer of {self.n_envs} envs")
        s, t = int(self._start[env]), self._t
        out = {f.name: self._buf[f.name][s:t, env].copy() for f in self._fields}
        if t > s:
            last = self._conformed(self._last_next, "the last add's next_obs")
            for k in self._obs_keys:
                out[k] = np.concatenate([out[k], last[k][env : env + 1]])
        return out

    def restore_pending(self, episodes: Sequence[Mapping[str, Any]]) -> None:
        """Stage unfinished episodes again, one per env as :meth:`pending` gave them, in a writer with none staged.

        What a saved training run needs to carry its partial episodes into a new process: the next :meth:`add`
        continues them, :meth:`flush_partial` ends them as truncated. An env's entry with zero steps stages
        nothing for it.

        Raises
        ------
        ValueError
            Not one entry per env, or the writer already has staged steps (nothing changes).
        EpisodeValidationError
            An entry that :meth:`EpisodeStore.append_episode` would refuse (keys, shapes, dtypes, values), named
            by env (nothing changes).

        Examples
        --------
        >>> saved = [w.pending(e) for e in range(w.n_envs)]  # doctest: +SKIP
        >>> store.writer(w.n_envs).restore_pending(saved)  # doctest: +SKIP
        """
        if len(episodes) != self.n_envs:
            raise ValueError(f"restore_pending takes one episode per env ({self.n_envs}), got {len(episodes)}")
        if self.pending_steps.any():
            raise ValueError(
                f"the writer has staged steps for envs {np.flatnonzero(self.pending_steps).tolist()}; restore_pending "
                "needs a writer with none"
            )
        checked: list[tuple[int, dict[str, np.ndarray]]] = []
        for e, episode in enumerate(episodes):
            action = episode.get("action") if isinstance(episode, Mapping) else None
            if action is not None and len(np.asarray(action)) == 0:
                checked.append((0, {}))
                continue
            try:
                checked.append(self.store.validate_episode(episode))
            except EpisodeValidationError as err:
                raise EpisodeValidationError(f"pending episode of env {e}: {err}") from None
        n = max(T for T, _ in checked)
        if n >= self._steps:
            self._steps = 1 << n.bit_length()
            self._buf = {f.name: np.zeros((self._steps, self.n_envs, *f.shape), f.dtype) for f in self._fields}
            self._slots()
        last = {k: np.zeros((self.n_envs, *self._buf[k].shape[2:]), self._buf[k].dtype) for k in self._obs_keys}
        for e, (T, data) in enumerate(checked):
            self._start[e] = n - T
            if T:
                for f in self._fields:
                    self._buf[f.name][n - T : n, e] = data[f.name][:T]
                for k in self._obs_keys:
                    last[k][e] = data[k][T]
        self._t = n
        self._last_next = last

    def _checked(self, label: str, name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
        """The slow path of add: conform a value to its field or refuse it with the field named.

        Only axes of size 1 may be added or dropped (SB3 passes Discrete actions as ``(n_envs, 1)``): a reshape
        between other shapes of the same size (a transposed array) would scramble the rows.
        """
        v = np.asarray(value)
        if v.shape != shape:
            if [d for d in v.shape if d != 1] != [d for d in shape if d != 1]:
                raise EpisodeValidationError(f"{label} has shape {v.shape}, expected {shape} (n_envs={self.n_envs})")
            v = v.reshape(shape)
        schema = self.store.schema
        return conform(v, schema.by_name[name], schema.value_ranges.get(name), label)

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
        *,
        skip: Any = None,
        cut_resets: bool = False,
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
        skip : bool array, optional
            ``(n_envs,)``: envs whose values on this call are no transition, e.g. the step of a gymnasium vector env
            (next-step autoreset) that resets the envs which ended on the previous step. Only an env between
            episodes (no pending step) may be skipped; its values must still be valid for the store.
        cut_resets : bool
            End, as truncated at its last step, the episode of an env whose ``obs`` is not (byte for byte, in the
            stored dtypes) the ``next_obs`` of its last add: it was reset in between, without an end flag. This step
            starts its next episode. Checked once the step is known valid: a refused step ends nothing; a cut episode
            the store refuses is dropped, as an ended one is, after the step is staged. Without it, such a step joins
            the episode, whose last transition then leads to the new start.

        Raises
        ------
        EpisodeValidationError
            A missing or extra observation key, a wrong shape, a dtype that does not cast, or a value the stored
            dtype or the field's space cannot hold, named by field: nothing was staged or appended. Also when an
            ended episode is longer than the store's capacity: that env's episode was dropped, the others were
            appended.
        StoreError
            The store failed to append an ended episode (the cause is chained; a her_store error keeps its
            class): that env's episode was dropped, the others were appended.
        """
        if self._t >= self._steps:
            self._make_room()
        t = self._t
        try:
            terminated, truncated = self._stage_row(t, obs, action, reward, terminated, truncated)
        except AttributeError:  # a list, a scalar, a tensor: convert every field, then take the fast path
            return self.add(
                _arrays(obs),
                next_obs,
                np.asarray(action),
                np.asarray(reward),
                np.asarray(terminated),
                np.asarray(truncated),
                infos,
                skip=skip,
                cut_resets=cut_resets,
            )
        except (KeyError, TypeError):
            self._require_keys("obs", obs)
            raise
        if len(obs) != len(self._obs_slots):  # a key the store does not hold (none was missing)
            self._require_keys("obs", obs)
        for name, rows, shape, _ in self._info_slots:
            rows[t][...] = self._checked(f"infos[{name!r}]", name, _info_column(infos, name, self.n_envs), shape)
        if skip is not None:
            skip = self._skip_mask(skip, t)
            terminated, truncated = terminated & ~skip, truncated & ~skip
        ended = (terminated[0] or truncated[0]) if self.n_envs == 1 else (terminated | truncated).any()
        # next_obs's values are not read unless an episode ends (or by flush_partial, which checks them then)
        last_next = self._conformed(next_obs, "next_obs") if ended else next_obs
        mapping = type(next_obs) is dict or isinstance(next_obs, Mapping)
        if not ended and mapping and len(next_obs) != len(self._obs_slots):
            self._require_keys("next_obs", next_obs)
        cut, refused = self._end_cut(t) if cut_resets else ([], None)
        self._last_next = last_next
        if skip is not None:
            self._start[skip] = t + 1  # row t of a skipped env belongs to no episode
        self._t = t + 1
        try:
            ids = self._finish_all(np.flatnonzero(terminated | truncated).tolist()) if ended else []
        except StoreError as err:
            if refused is None:
                raise
            raise type(refused)(f"{refused}; {err}") from err
        if refused is not None:
            raise refused
        return cut + ids

    def _stage_row(
        self, t: int, obs: Mapping[str, Any], action: Any, reward: Any, terminated: Any, truncated: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """Write a step's observations, action, reward and end flags into row ``t``; returns the end flags as
        written. Raises AttributeError for a value that is no array (:meth:`add` then converts every field), KeyError
        or TypeError for an ``obs`` without a key or no mapping, and what :meth:`_checked` raises."""
        # Unrolled on purpose: one dict lookup, one shape/dtype check and one row copy per field. A value whose
        # shape or dtype is not exactly the buffer's (or that is no ndarray) takes the checked path: a cast that
        # keeps every value, or a clear error. Row t belongs to no episode until self._t moves past it, so a step
        # refused part-way leaves every env as it was.
        for name, rows, shape, dtype in self._obs_slots:
            v = obs[name]
            if v.shape != shape or v.dtype is not dtype:
                v = self._checked(f"obs[{name!r}]", name, v, shape)
            rows[t][...] = v
        name, rows, shape, dtype = self._action
        if action.shape != shape or action.dtype is not dtype:
            action = self._checked(name, name, action, shape)
        rows[t][...] = action
        name, rows, shape, dtype = self._reward
        if reward.shape != shape or reward.dtype is not dtype:
            reward = self._checked(name, name, reward, shape)
        rows[t][...] = reward
        name, rows, shape, dtype = self._term
        if terminated.shape != shape or terminated.dtype is not dtype:
            terminated = self._checked(name, name, terminated, shape)
        rows[t][...] = terminated
        name, rows, shape, dtype = self._trunc
        if truncated.shape != shape or truncated.dtype is not dtype:
            truncated = self._checked(name, name, truncated, shape)
        rows[t][...] = truncated
        return terminated, truncated

    def _end_cut(self, t: int) -> tuple[list[int], StoreError | None]:
        """End the episodes of the envs :meth:`_cut_rows` finds reset without an end flag, at row ``t - 1``, their
        final observations going in row ``t`` (this step's, kept aside and put back): (the ids appended, and the
        store's refusal of a cut episode, which is then dropped and listed, or None)."""
        cut = self._cut_rows(t)
        if not cut:
            return cut, None
        staged = {name: buf[t].copy() for name, buf in self._buf.items()}
        try:
            return self.flush_partial(cut), None
        except StoreError as err:  # a cut episode the store refused: dropped (listed); this step goes on
            return [], err
        finally:
            for name, buf in self._buf.items():
                buf[t] = staged[name]

    def _cut_rows(self, t: int) -> list[int]:
        """The envs with steps pending whose staged observation (row ``t``, in the stored dtypes) is not the last
        add's next_obs (in the stored dtypes): those ``add(cut_resets=True)`` ends. A last next_obs that is not in the
        stored shapes tells nothing (it is read only when its episode ends)."""
        last = self._last_next
        if last is None:
            return []
        pairs = []
        for name, rows, shape, dtype in self._obs_slots:  # the usual step: the last next_obs as stored, no copy
            b = last.get(name) if type(last) is dict else None
            if type(b) is not np.ndarray or b.dtype is not dtype or b.shape != shape:
                try:  # another dtype (cast by add), a list, ...: as add would store it
                    conformed = self._conformed(last, "the last add's next_obs")
                except (EpisodeValidationError, KeyError, TypeError):
                    return []
                pairs = [(rows[t], conformed[n]) for n, rows, _, _ in self._obs_slots]
                break
            pairs.append((rows[t], b))
        if all(_same_bytes(a, b) for a, b in pairs):  # every env goes on (one memcmp a key)
            return []
        pending = self._t > self._start
        cut = np.zeros(self.n_envs, bool)
        for a, b in pairs:
            cut |= (np.ascontiguousarray(a).reshape(self.n_envs, -1).view(np.uint8)
                    != np.ascontiguousarray(b).reshape(self.n_envs, -1).view(np.uint8)).any(axis=1)
        return np.flatnonzero(cut & pending).tolist()

    def _skip_mask(self, skip: Any, t: int) -> np.ndarray:
        """``skip`` as a bool mask of the envs, refused if it is no such mask or names an env with pending steps."""
        mask = np.asarray(skip)
        if mask.shape != (self.n_envs,) or mask.dtype != np.bool_:
            raise EpisodeValidationError(
                f"skip must be a bool array of shape ({self.n_envs},), got {mask.dtype} {mask.shape}"
            )
        busy = np.flatnonzero(mask & (self._start < t))
        if busy.size:
            e = int(busy[0])
            raise EpisodeValidationError(
                f"skip names env {e}, which has {t - int(self._start[e])} pending steps; only an env between "
                "episodes can skip a step"
            )
        return mask

    def _require_keys(self, label: str, m: Any) -> None:
        """Refuse an obs or next_obs that is no mapping, lacks an observation key or has a key the store does not hold
        (naming which), as :meth:`EpisodeStore.append_episode` does."""
        if not isinstance(m, Mapping):
            raise EpisodeValidationError(
                f"{label} must be a mapping of observation key -> array, got {type(m).__name__}"
            )
        missing = [k for k in self._obs_keys if k not in m]
        if missing:
            raise EpisodeValidationError(
                f"{label} has no key {missing[0]!r}; expected the keys {list(self._obs_keys)}"
            ) from None
        extra = [k for k in m if k not in self._obs_keys]
        if extra:
            raise EpisodeValidationError(
                f"{label} has keys {short_repr(extra)} the store does not hold; expected the keys "
                f"{list(self._obs_keys)}"
            )

    def _conformed(self, next_obs: Any, label: str) -> dict[str, np.ndarray]:
        """``next_obs`` checked like obs, as arrays in the stored dtypes and shapes."""
        out = {}
        try:
            for name, _, shape, dtype in self._obs_slots:
                v = next_obs[name]
                if not isinstance(v, np.ndarray) or v.shape != shape or v.dtype is not dtype:
                    v = self._checked(f"{label}[{name!r}]", name, v, shape)
                out[name] = v
        except (KeyError, TypeError):
            self._require_keys(label, next_obs)
            raise
        if len(next_obs) != len(out):
            self._require_keys(label, next_obs)
        return out

    def _finish_all(self, envs: list[int]) -> list[int]:
        """Append the ended episodes of ``envs``; one the store refuses is dropped, the others are still appended."""
        ids, dropped = [], []
        for k, e in enumerate(envs):
            try:
                ids.append(self._finish(e))
            except Exception as err:  # noqa: BLE001  raised below, once every other env's episode is appended
                steps = self._t - int(self._start[e])
                dropped.append((e, steps, err))
                self.dropped.append(DroppedEpisode(e, steps, f"{type(err).__name__}: {err}"))
                self._start[e] = self._t
            except BaseException:
                # an interrupt: the ended episodes not appended yet are dropped, never merged with the next ones
                for rest in envs[k:]:
                    self._start[rest] = self._t
                raise
        if not dropped:
            return ids
        message = "; ".join(
            f"env {e}: episode of {T} steps dropped ({type(err).__name__}: {err})" for e, T, err in dropped
        )
        message += f"; such an env starts a new episode at its next step; the other ended episodes were appended {ids}"
        cause = next((err for _, _, err in dropped if not isinstance(err, EpisodeValidationError)), None)
        if cause is None:  # the store refused them (longer than its capacity): nothing failed
            raise EpisodeValidationError(message)
        # a her_store error keeps its class (StoreLockedError, ...) so callers can still tell what failed
        raise (type(cause) if isinstance(cause, StoreError) else StoreError)(message) from cause

    def _finish(self, e: int) -> int:
        if self._t >= self._steps:
            self._make_room()
        s, t = int(self._start[e]), self._t
        # the final observation goes in row t, which the next add overwrites: the episode's rows stay one slice
        assert self._last_next is not None
        for k in self._obs_keys:
            self._buf[k][t, e] = self._last_next[k][e]
        episode = {f.name: self._buf[f.name][s : t if f.per_step else t + 1, e] for f in self._fields}
        episode_id = self.store.append_validated(t - s, episode, e)
        self._start[e] = t
        self.episode_ids.append(episode_id)
        return episode_id

    def flush_partial(self, envs: Sequence[int] | None = None) -> list[int]:
        """End every unfinished episode as truncated at its last step (what SB3's truncate_last_trajectory does).

        The final observation is the ``next_obs`` of that env's last add. Returns the appended episode ids.
        Raises as :meth:`add` does: if that ``next_obs`` is refused nothing changes; an episode the store cannot
        append is dropped.

        Parameters
        ----------
        envs : sequence of int, optional
            Only these envs' episodes (e.g. the envs a vector env resets); default every env.

        Examples
        --------
        >>> w.flush_partial(envs=[0, 2])  # doctest: +SKIP
        [7, 8]
        """
        chosen = np.ones(self.n_envs, bool)
        if envs is not None:
            chosen[:] = False
            for e in envs:
                if not is_int(e) or not 0 <= e < self.n_envs:
                    raise IndexError(f"env {e!r} out of range for a writer of {self.n_envs} envs")
                chosen[e] = True
        ending = np.flatnonzero(chosen & (self._t > self._start)).tolist()
        if not ending:
            return []
        self._last_next = self._conformed(self._last_next, "the last add's next_obs")
        self._buf["truncated"][self._t - 1, ending] = True
        return self._finish_all(ending)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays of one shape and dtype hold the same bytes (NaNs by their bits)."""
    try:
        return bool(_kernels.same_bytes(a, b))
    except (BufferError, ValueError):  # not C-contiguous
        return a.tobytes() == b.tobytes()


def _arrays(m: Any) -> Any:
    return {k: np.asarray(v) for k, v in m.items()} if isinstance(m, Mapping) else m


def _info_column(infos: Sequence[Mapping[str, Any]] | Mapping[str, Any] | None, key: str, n_envs: int) -> np.ndarray:
    if infos is None:
        return np.zeros(n_envs, np.float32)
    if isinstance(infos, Mapping):  # gymnasium vector envs: dict of per-env arrays
        return np.asarray(infos.get(key, np.zeros(n_envs)))
    try:
        return np.array([info.get(key, 0) for info in infos])
    except (AttributeError, TypeError):
        raise EpisodeValidationError(
            f"infos must be a list of dicts (one per env) or a dict of arrays, got {str(infos)[:80]}"
        ) from None
