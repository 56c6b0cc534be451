"""How a batch's rows are gathered: the read plan, the row sources, and the gather of one read per array.

The read plan is which arrays and fields a batch reads; a row source is where rows come from (the store's chunks
through its ChunkReader, or a working set's rows in memory); the gather reads rows ``t``, ``t + 1`` and the goal rows
with one read per array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import numpy as np

from her_store.store.episode_store import EpisodeStore
from her_store.store.rows import ChunkReader

__all__ = ["ArrayRead", "FieldRead", "Gather", "ReadPlan", "RowSource", "StoreRows", "contiguous_field", "finish_all"]


class FieldRead(NamedTuple):
    """One field of an array's rows: its name, its columns ``a:b`` in a packed array, its shape, and whether it is
    per step (actions, rewards, flags: no next row read)."""

    name: str
    a: int
    b: int
    shape: tuple[int, ...]
    per_step: bool


class ArrayRead(NamedTuple):
    """One array a batch reads: its path, whether it packs several fields, whether rows ``t + 1`` are read (it holds
    an observation field), whether the goal rows are read (it holds ``achieved_goal``), and its fields."""

    path: str
    is_pack: bool
    has_next: bool
    has_goal: bool
    fields: tuple[FieldRead, ...]


class ReadPlan:
    """Which arrays of a store a batch reads, and which of its fields, looked up once from the schema and layout.

    Arrays whose fields neither relabelling nor rewards read (image frames) are *later* arrays: they are gathered
    first and completed once the rest of the batch is assembled, their decoding meanwhile under way on the reader's
    threads; :attr:`arrays` lists them first.

    Parameters
    ----------
    store : EpisodeStore
        The store sampled.
    copy_info_dict : bool
        Read the stored info fields too.

    Attributes
    ----------
    arrays : tuple of ArrayRead
        The arrays read, the later ones first.
    later : frozenset of str
        Paths of the later arrays.
    obs_keys, info_keys : tuple of str
        Observation fields, and the info fields read (none without ``copy_info_dict``).
    goal_shape, goal_dtype
        Shape and dtype of ``achieved_goal``.
    goal_field : tuple
        Where ``achieved_goal`` is: its array's path, whether that array packs fields, and its columns ``a, b``.
    """

    def __init__(self, store: EpisodeStore, copy_info_dict: bool) -> None:
        schema, layout = store.schema, store.layout
        self.obs_keys: tuple[str, ...] = tuple(schema.observation_keys)
        self.info_keys: tuple[str, ...] = tuple(schema.info_keys) if copy_info_dict else ()
        needed = set(self.obs_keys) | {"action", "reward", "terminated", "truncated", *self.info_keys}
        arrays = []
        for spec in layout.arrays:
            fields = tuple(
                FieldRead(n, a, b, schema.by_name[n].shape, schema.by_name[n].per_step)
                for n, a, b in spec.columns
                if n in needed
            )
            if fields:
                has_next = any(not f.per_step for f in fields)
                has_goal = any(f.name == "achieved_goal" for f in fields)
                arrays.append(ArrayRead(spec.path, spec.is_pack, has_next, has_goal, fields))
        computed_on = {"achieved_goal", "desired_goal", *self.info_keys}
        self.later = frozenset(
            a.path for a in arrays if not a.is_pack and not computed_on & {f.name for f in a.fields}
        )
        arrays.sort(key=lambda a: a.path not in self.later)
        self.arrays: tuple[ArrayRead, ...] = tuple(arrays)
        self.goal_shape: tuple[int, ...] = schema.by_name["achieved_goal"].shape
        self.goal_dtype = schema.by_name["achieved_goal"].dtype
        spec, a, b = layout.fields["achieved_goal"]
        self.goal_field: tuple[str, bool, int, int] = (spec.path, spec.is_pack, a, b)


class RowSource(Protocol):
    """Where a gather reads rows: ``rows(path, rows)`` returns rows of an array (by the store's row numbers),
    ``rows_later(path, rows)`` starts such a read and returns the rows and the function that completes them, and
    ``field(name, col, shape)`` makes one field of them what batch assembly takes."""

    def rows(self, path: str, rows: np.ndarray) -> Any: ...

    def rows_later(self, path: str, rows: np.ndarray) -> tuple[Any, Callable[[], None]]: ...

    def field(self, name: str, col: Any, shape: tuple[int, ...]) -> Any: ...


def contiguous_field(name: str, col: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """One field of gathered rows as batch assembly takes it: ``(len(col), *shape)``, contiguous (a view of
    contiguous rows)."""
    return np.ascontiguousarray(col).reshape(len(col), *shape)


class StoreRows:
    """Rows read from the store's chunk files (mmap, ranged reads or fetched shards) by a :class:`ChunkReader`.

    Each read looks up ``reader.gather`` (or ``gather_later``) when it is made, so the reader is the one place
    rows come from.
    """

    field = staticmethod(contiguous_field)

    def __init__(self, reader: ChunkReader) -> None:
        self.reader = reader

    def rows(self, path: str, rows: np.ndarray) -> np.ndarray:
        return self.reader.gather(path, rows)

    def rows_later(self, path: str, rows: np.ndarray) -> tuple[Any, Callable[[], None]]:
        return self.reader.gather_later(path, rows)


def finish_all(pending: list[Callable[[], None]]) -> None:
    """Complete every pending gather: each is waited for, whatever the ones before it raised.

    Examples
    --------
    >>> done = []
    >>> finish_all([lambda: done.append(1), lambda: done.append(2)])
    >>> done
    [1, 2]
    """
    if pending:
        try:
            pending[0]()
        finally:
            finish_all(pending[1:])


class Gather:
    """A batch's fields, one read per array from a row source: rows ``t`` (every field), ``t + 1`` (observation
    fields) and the goal rows (``achieved_goal``) concatenated.

    Parameters
    ----------
    plan : ReadPlan
        The arrays and fields read.
    source : RowSource
        Where rows come from.
    """

    def __init__(self, plan: ReadPlan, source: RowSource) -> None:
        self.plan = plan
        self.source = source

    def __call__(
        self, rows: np.ndarray, goal_rows: np.ndarray | None
    ) -> tuple[dict[str, Any], dict[str, Any], Any, Callable[[], None]]:
        """Fields at ``rows``, observation fields at ``rows + 1``, the achieved goals at ``goal_rows`` (None
        without them), and the function that completes the later arrays' fields: call it before reading them,
        and before dropping the batch."""
        B = len(rows)
        now: dict[str, Any] = {}
        nxt: dict[str, Any] = {}
        goals = None
        source = self.source
        field = source.field
        pending: list[Callable[[], None]] = []
        for path, is_pack, has_next, has_goal, fields in self.plan.arrays:
            parts = [rows]
            if has_next:
                parts.append(rows + 1)
            if has_goal and goal_rows is not None:
                parts.append(goal_rows)
            at = np.concatenate(parts) if len(parts) > 1 else rows
            if path in self.plan.later:
                got, finish = source.rows_later(path, at)
                pending.append(finish)
            else:
                got = source.rows(path, at)
            for name, a, b, shape, per_step in fields:
                col = got[:, a:b] if is_pack else got
                now[name] = field(name, col[:B], shape)
                if not per_step:
                    nxt[name] = field(name, col[B : 2 * B], shape)
                if name == "achieved_goal" and goal_rows is not None:
                    goals = field(name, col[2 * B :], shape)
        return now, nxt, goals, lambda: finish_all(pending)

    def achieved_goals(self, rows: np.ndarray) -> Any:
        """The achieved goals at ``rows``, ``(len(rows), *goal shape)``."""
        path, is_pack, a, b = self.plan.goal_field
        got = self.source.rows(path, rows)
        return self.source.field("achieved_goal", got[:, a:b] if is_pack else got, self.plan.goal_shape)
