"""What ``her-store verify`` found: a store's problems, which episodes they affect, and what repair needs to mend them.

:func:`~her_store.ops.verify.verify` fills a :class:`Report`; :func:`~her_store.ops.repair.repair` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Problem", "Report", "id_ranges"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a store: what, and which episodes it affects (ids as they were when checked).

    ``kind`` is ``"open"`` (the store cannot be opened), ``"file"`` (a chunk or shard file), ``"checksum"`` (episodes
    whose rows fail their crc32), ``"uncommitted"`` (left past the commit record by a commit that never completed) or
    ``"repair"`` (a repair that stopped before it had appended the good episodes it was moving again).
    """

    kind: str
    what: str
    episodes: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.what} (episodes {id_ranges(self.episodes)})" if self.episodes else self.what


@dataclass
class Report:
    """What :func:`verify` found.

    Attributes
    ----------
    url : str
    problems : list of Problem
        Empty when the store is clean.
    episodes, transitions : int
        Live episodes and transitions checked.
    bytes_read : int
        Bytes of chunk and shard files read.
    seconds : float
    bad_episodes : numpy.ndarray
        Live episode ids that fail their crc32 or whose rows are missing or unreadable (what :func:`repair` drops).
    """

    url: str
    problems: list[Problem] = field(default_factory=list)
    episodes: int = 0
    transitions: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    bad_episodes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    damaged_files: list[str] = field(default_factory=list)  # entries (ArraySpec.chunk_entry) of unreadable chunks
    short_files: list[tuple[str, int]] = field(default_factory=list)  # raw chunk keys not of their size, and the size
    linked_files: list[str] = field(default_factory=list)  # raw chunk keys of committed rows with other (hard) links
    tail_positions: list[int] = field(default_factory=list)  # index positions holding ids never committed
    tail_chunks: dict[str, list[int]] = field(default_factory=dict)  # per array, chunks holding rows past write_row
    # per array, unreadable chunks with no committed row
    junk_chunks: dict[str, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what is not wrong but worth saying (a live writer's tail)

    @property
    def clean(self) -> bool:
        return not self.problems

    @property
    def opened(self) -> bool:
        return not any(p.kind == "open" for p in self.problems)

    def summary(self) -> str:
        """The report as lines of text: a verdict, then one line per problem."""
        rate = self.bytes_read / self.seconds / 1e6 if self.seconds > 0 else 0.0
        checked = (
            f"{self.episodes:,} episodes ({self.transitions:,} transitions), {self.bytes_read / 1e6:,.1f} MB read in "
            f"{self.seconds:.2f} s ({rate:,.0f} MB/s)"
        )
        if self.clean:
            return "\n".join([f"{self.url}: clean: {checked}", *(f"  note: {n}" for n in self.notes)])
        lines = [f"{self.url}: {len(self.problems)} problem{'s' * (len(self.problems) != 1)}"]
        if self.opened:
            lines[0] += f" ({checked})"
        lines += [f"  - {p}" for p in self.problems]
        if len(self.bad_episodes):
            lines.append(f"  episodes that fail their crc32 or miss rows: {id_ranges(self.bad_episodes)}")
        return "\n".join(lines)


def id_ranges(ids: Any) -> str:
    """Episode ids as short ranges: ``0..3, 7, 9..10``.

    Examples
    --------
    >>> id_ranges([0, 1, 2, 3, 7, 9, 10])
    '0..3, 7, 9..10'
    """
    a = np.unique(np.asarray(ids, np.int64))
    if not len(a):
        return "none"
    cuts = np.flatnonzero(np.diff(a) != 1) + 1
    parts = [f"{int(r[0])}..{int(r[-1])}" if len(r) > 1 else str(int(r[0])) for r in np.split(a, cuts)]
    return ", ".join(parts) if len(parts) <= 40 else ", ".join(parts[:40]) + f", ... ({len(a):,} in all)"
