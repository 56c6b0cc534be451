"""The commit record, ``commit.json``: the one truth of which episodes and rows of a store are committed.

A commit writes data rows, then index rows, then replaces this record atomically; readers trust only it
(FORMAT.md, The commit record).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, fields

from her_store.errors import CorruptStoreError, FormatVersionError, short_repr
from her_store.format.keys import COMMIT_KEY
from her_store.format.layout import FORMAT_VERSION, is_count

__all__ = ["Commit"]


@dataclass(frozen=True)
class Commit:
    """The commit record: the only truth about which episodes and rows are committed.

    Attributes
    ----------
    generation : int
        Incremented by every commit.
    first_episode, end_episode : int
        Live episode ids are ``first_episode <= id < end_episode``; ids below were evicted by the ring.
    write_row : int
        Row where the next episode starts (before any wrap).
    num_transitions : int
        Sum of the lengths of the live episodes.
    array_rows : int
        Rows the arrays are sized to (grows for unbounded stores).
    """

    generation: int = 0
    first_episode: int = 0
    end_episode: int = 0
    write_row: int = 0
    num_transitions: int = 0
    array_rows: int = 0

    def to_bytes(self, version: int = FORMAT_VERSION) -> bytes:
        """The record as written: ``version`` is the format version of the store it commits."""
        body = {
            "format_version": version,
            "generation": self.generation,
            "first_episode": self.first_episode,
            "end_episode": self.end_episode,
            "write_row": self.write_row,
            "num_transitions": self.num_transitions,
            "array_rows": self.array_rows,
        }
        body["crc32"] = zlib.crc32(json.dumps(body, sort_keys=True).encode())
        return json.dumps(body, sort_keys=True, indent=1).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, where: str, version: int | None = None) -> Commit:
        """Parse and check a commit record: exactly the keys of FORMAT.md, its crc32, non-negative integers that
        agree with each other, and (given ``version``) the store's format version. Anything else raises
        CorruptStoreError (FormatVersionError for a newer format)."""
        names = [f.name for f in fields(cls)]
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise CorruptStoreError(
                f"{where}: commit record {COMMIT_KEY} is unreadable ({e!r}); expected the JSON described in FORMAT.md"
            ) from e
        keys = {*names, "format_version", "crc32"}
        if not isinstance(body, dict) or body.keys() != keys:
            got = sorted(body) if isinstance(body, dict) else short_repr(body)
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} has keys {got}, expected {sorted(keys)}")
        bad = {k: v for k, v in body.items() if not is_count(v)}
        if bad:
            raise CorruptStoreError(
                f"{where}: commit record {COMMIT_KEY} has {short_repr(bad)}, expected non-negative integers"
            )
        crc = body.pop("crc32")
        if crc != zlib.crc32(json.dumps(body, sort_keys=True).encode()):
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} fails its crc32 check")
        found = body.pop("format_version")
        if found > FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: commit record has format version {found}; this her_store reads up to {FORMAT_VERSION}"
            )
        if version is not None and found != version:
            raise CorruptStoreError(
                f"{where}: commit record has format version {found}, the store's attributes {version}; they must agree"
            )
        commit = cls(**body)
        live = commit.end_episode - commit.first_episode
        # every live episode has >= 1 transition and owns its T + 1 rows, disjoint from the others'
        consistent = 0 <= live <= commit.num_transitions and (live > 0 or commit.num_transitions == 0)
        fits = commit.num_transitions + live <= commit.array_rows and commit.write_row <= commit.array_rows
        if not (consistent and fits):
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} is inconsistent: {commit}")
        return commit

    def check_fits(
        self, capacity: int | None, index_slots: int | None, data_rows: int, index_rows: int, where: str
    ) -> None:
        """Check this record against the store's attributes and its arrays' real shapes: every row and index
        position it makes the store read must exist, whatever the record claims.

        Parameters
        ----------
        capacity, index_slots : int or None
            The store's attributes.
        data_rows, index_rows : int
            The smallest first dimension of the data arrays, of the index columns.
        where : str
            The record's file, for messages.
        """
        problem = None
        if self.array_rows > data_rows:
            problem = f"array_rows {self.array_rows} exceeds the {data_rows} rows of the data arrays"
        elif capacity is None and self.end_episode > index_rows:
            problem = f"end_episode {self.end_episode} exceeds the {index_rows} rows of the index arrays"
        elif index_slots is not None and index_slots > index_rows:
            problem = f"the store's index_slots {index_slots} exceed the {index_rows} rows of the index arrays"
        elif capacity is not None and self.num_transitions > capacity:
            problem = f"num_transitions {self.num_transitions} exceeds capacity {capacity}"
        elif capacity is not None and self.array_rows <= capacity:
            problem = f"array_rows {self.array_rows} cannot hold an episode of capacity {capacity} transitions"
        if problem:
            raise CorruptStoreError(f"{where}: commit record {COMMIT_KEY} does not fit the store: {problem}")
