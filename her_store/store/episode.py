"""Episode: the unit users think in, a read-only mapping of field name -> numpy array, printed as shapes and dtypes."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from her_store.checks import check_int
from her_store.errors import short_repr

__all__ = ["Episode"]


class Episode(Mapping[str, np.ndarray]):
    """One committed episode read back from a store.

    Observation keys hold ``T + 1`` rows (the last is the final next-observation); ``action``, ``reward``,
    ``terminated``, ``truncated`` and info keys hold ``T`` rows. Iterating gives the field names in schema order;
    fields are read as items (``ep["observation"]``), and the repr shows them as the mapping they are, each as its
    dtype and shape.

    Attributes
    ----------
    id : int
        The episode id (consecutive from 0 in commit order).
    length : int
        ``T``, the number of transitions.

    Examples
    --------
    >>> ep = Episode(3, {"observation": np.zeros((3, 2)), "action": np.zeros((2, 1))})
    >>> ep
    Episode(id=3, length=2, {'observation': float64(3, 2), 'action': float64(2, 1)})
    >>> ep["observation"].shape
    (3, 2)
    """

    __slots__ = ("id", "length", "_data")

    def __init__(self, episode_id: int, data: dict[str, np.ndarray]) -> None:
        self.id = check_int(episode_id, "episode_id")
        if not isinstance(data, Mapping) or not data:
            raise ValueError(f"an episode's data is a mapping of field names to arrays, with one field at least: got "
                             f"{short_repr(data)}")
        self._data = data
        self.length = len(data["action"]) if "action" in data else len(next(iter(data.values()))) - 1

    def __getitem__(self, key: str) -> np.ndarray:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k!r}: {v.dtype}{tuple(v.shape)}" for k, v in self._data.items())
        return f"Episode(id={self.id}, length={self.length}, {{{fields}}})"
