"""GoalEnvFlattener: a goal env's Dict observations as one flat vector, reversibly (SB2's ``HERGoalEnvWrapper``).

The flat vector holds ``observation``, ``achieved_goal`` and ``desired_goal`` (then any other keys), each flattened;
:meth:`GoalEnvFlattener.convert_obs_to_dict` gives the Dict back exactly. No value is changed silently: a cast that
would change one is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from her_store.errors import EpisodeValidationError
from her_store.format.schema import GOAL_KEYS, Field, conform

__all__ = ["GoalEnvFlattener"]

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
                raise ValueError(
                    f"obs_dict[{k!r}] has shape {v.shape}, expected (*batch, {', '.join(map(str, shape))})"
                )
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
            k: _cast(v[..., sl], sub_dtype, f"the flat vector[..., {sl.start}:{sl.stop}] ({k!r})").reshape(
                (*batch, *shape)
            )
            for k, sl, shape, sub_dtype in zip(self.keys, self._slices, self._shapes, self._dtypes)
        }

    def compute_reward(self, achieved_goal: Any, desired_goal: Any, info: Any) -> Any:
        """The wrapped goal env's ``compute_reward`` (goals are not flattened)."""
        return self.env.get_wrapper_attr("compute_reward")(achieved_goal, desired_goal, info)
