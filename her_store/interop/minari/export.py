"""A store's episodes written as a local Minari dataset, through Minari's own storage.

Export writes the dataset directory through ``MinariStorage.new`` at the destination, then ``update_episodes`` with
one ``EpisodeBuffer`` per episode, uncompressed (no JPEG encoding of images: the round trip is bit-exact). Episodes
take Minari's shape: observations ``T + 1`` rows, actions, rewards, terminations and truncations ``T``, infos
``T + 1`` rows aligned with the observations as Minari's DataCollector records them (row 0 is the reset's info, which
a store does not keep: it is written as zeros). The dataset card becomes Minari's metadata
(:func:`~her_store.interop.minari.metadata.metadata_from_card`).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from her_store.extras import require
from her_store.format.card import check_card
from her_store.interop.batches import Batch, read_batches
from her_store.interop.minari.metadata import metadata_from_card, minari_dataset_id
from her_store.storage.files import staged_output
from her_store.store.episode_store import EpisodeStore

__all__ = ["export_minari"]


def export_minari(
    store: EpisodeStore,
    episode_ids: Sequence[int] | np.ndarray,
    dest: str | os.PathLike[str],
    *,
    progress: bool = False,
) -> tuple[int, int]:
    """Write episodes of ``store`` as a local Minari dataset at ``dest`` (a new directory); returns the episodes and
    transitions written.

    Parameters
    ----------
    store : EpisodeStore
        Any open store (local or remote, read-only is enough).
    episode_ids : sequence of int
        Live episode ids, written in this order as Minari episodes 0, 1, ...
    dest : path
        The dataset directory to create (``data/metadata.json`` and ``data/main_data.hdf5`` in it), with the
        directories above it that do not exist yet. Put it at ``<Minari root>/<dataset_id>`` for
        ``minari.load_dataset(dataset_id)`` to find it.
    progress : bool
        Show a progress bar.

    The dataset id is the card's ``dataset_id``, else ``dest``'s name; either must be a Minari id
    (``name-v0``, ``namespace/name-v1``). Nothing is left at ``dest``, nor the directories made above it, unless every
    episode was written.

    Raises
    ------
    ValueError
        The id is not a Minari id, the card holds a key Minari writes itself or an ``env_spec`` gymnasium cannot
        read, or ``episode_ids`` is empty.
    CorruptStoreError
        An episode of the live range whose rows do not match their crc32 (damaged).
    FileExistsError
        ``dest`` exists.

    Examples
    --------
    >>> export_minari(store, store.episodes["episode_id"], "datasets/point/random-v0")  # doctest: +SKIP
    >>> minari.MinariDataset("datasets/point/random-v0/data").total_episodes  # doctest: +SKIP
    """
    minari = require("minari", "minari")
    require("h5py", "minari")
    from minari.data_collector.episode_buffer import EpisodeBuffer
    from minari.dataset.minari_storage import METADATA_FILE_NAME, MinariStorage

    card = check_card(store.metadata, f"the dataset card of {store.url}")
    dest = os.path.abspath(os.fspath(dest))
    if card.get("dataset_id") is not None:
        dataset_id = minari_dataset_id(card["dataset_id"], "the card's dataset_id")
    else:
        name = os.path.basename(dest)
        try:
            dataset_id = minari_dataset_id(name, "the destination's name")
        except ValueError:
            raise ValueError(
                f"the destination's name {name!r} is not a Minari dataset id, and the store's card has no dataset_id: "
                "the destination must be a new directory named name-v<version> (e.g. datasets/random-v0), or the card "
                "must name the id (her-store card STORE --set dataset_id=point/random-v0)"
            ) from None
    metadata = metadata_from_card(card, dataset_id, minari.__version__, store.schema.info_spaces)
    ids = np.asarray(episode_ids, np.int64).reshape(-1)
    if not len(ids):
        raise ValueError(f"no episode to export from {store.url}: a Minari dataset holds at least one")
    info_keys = store.info_keys

    counts = [0, 0]  # episodes, transitions written (a ring's writer may evict some while they are read)
    writes: _KeptWriteError | None = None

    def buffers(batches: Iterable[Batch]) -> Iterator[Any]:
        for batch in batches:
            counts[0] += len(batch.ids)
            counts[1] += int(batch.lengths.sum())
            for _, ep in batch.episodes():
                if writes is not None:
                    writes.raise_kept()  # a write failed: HDF5 gets no more episodes
                infos = {k: np.concatenate([np.zeros((1, *ep[k].shape[1:]), ep[k].dtype), ep[k]]) for k in info_keys}
                yield EpisodeBuffer(
                    observations={k: ep[k] for k in store.schema.observation_keys},
                    actions=ep["action"],
                    rewards=ep["reward"],
                    terminations=ep["terminated"],
                    truncations=ep["truncated"],
                    infos=infos or None,
                )

    # read as the other exports read (one commit's rows, each episode checked against its crc32), and the first
    # batch (every episode of a small store) gathered before anything is made at the destination or Minari sets up,
    # while a ring writer moves on
    batches = read_batches(store, ids, progress, "exporting to Minari")
    with contextlib.closing(batches):
        first = next(batches)
        with _made_parents(dest), staged_output(dest) as tmp:
            os.mkdir(tmp)
            data = os.path.join(tmp, "data")
            storage = MinariStorage.new(
                data, observation_space=store.observation_space, action_space=store.action_space, data_format="hdf5",
                jpeg_encoding=False,
            )
            # Written into Minari's own file rather than through update_metadata, which wants author sets and so would
            # lose the order of a card's author list; Minari's later updates keep these keys as they are.
            path = os.path.join(data, METADATA_FILE_NAME)
            with open(path) as f:
                written = json.load(f)
            with open(path, "w") as f:
                json.dump({**written, **metadata}, f)
            # HDF5 crashes the process (a segmentation fault) when a write fails under it (a full disk, a file size
            # limit) and its file is closed after: Minari's file is written through a Python file whose failed write
            # is kept, not told to HDF5, and raised once Minari is done (the partial dataset is then removed)
            file_path = storage._file_path
            with open(file_path, "r+b", buffering=0) as f:  # unbuffered: a failed write fails at write, not at a seek
                writes = _KeptWriteError(f)
                storage._file_path = writes
                try:
                    storage.update_episodes(buffers(itertools.chain([first], batches)))
                except Exception:
                    writes.raise_kept()
                    raise
                finally:
                    storage._file_path = file_path
                writes.raise_kept()
    return counts[0], counts[1]


@contextlib.contextmanager
def _made_parents(path: str) -> Iterator[None]:
    """The directories above ``path`` that do not exist, made for the block and removed again (those still empty,
    innermost first) when it fails."""
    missing = []
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    made = []
    try:
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made by someone else meanwhile: theirs, not removed
                os.mkdir(d)
                made.append(d)
        yield
    except BaseException:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        raise


class _KeptWriteError(io.RawIOBase):
    """A file for h5py whose first failed write (or flush) is kept rather than raised: from then on what HDF5 writes
    is held in memory (read back from there, so HDF5 sees a consistent file until it closes it), and
    :meth:`raise_kept` raises the error once HDF5 is done. The caller stops feeding HDF5 at the next episode, so what
    is held is one episode's rows and the file's closing metadata at most."""

    def __init__(self, f: io.FileIO) -> None:
        super().__init__()
        self._f = f
        self.error: OSError | None = None
        self._held: list[tuple[int, bytes]] = []  # (offset, bytes) written after the error, in order
        self._end = 0  # the file's end as HDF5 sees it, once writes are held

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_END and self.error is not None:
            return self._f.seek(self._end + offset)
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b: Any) -> int:
        at, out = self._f.tell(), memoryview(b).cast("B")
        got = self._f.readinto(out) or 0
        if self.error is None:
            return got
        n = max(got, min(len(out), self._end - at))
        out[got:n] = bytes(n - got)  # past the file's end on disk: only what is held
        for offset, data in self._held:  # later writes over earlier ones, as on disk
            lo, hi = max(offset, at), min(offset + len(data), at + n)
            if lo < hi:
                out[lo - at : hi - at] = data[lo - offset : hi - offset]
        self._f.seek(at + n)
        return n

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        at = self._f.tell()
        if self.error is None:
            try:
                done = 0
                while done < len(data):  # a raw write may be short (the last bytes below a limit)
                    done += self._f.write(data[done:]) or 0
                return len(data)
            except OSError as e:
                self.error = e
                self._f.seek(0, os.SEEK_END)
                self._end = max(self._f.tell(), at)
        self._held.append((at, data))
        self._end = max(self._end, at + len(data))
        self._f.seek(at + len(data))
        return len(data)

    def truncate(self, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        if self.error is None:
            try:
                return self._f.truncate(size)
            except OSError as e:
                self.error = e
        self._end = size
        return size

    def flush(self) -> None:
        if self.error is None:
            try:
                self._f.flush()
            except OSError as e:
                self.error = e
                self._f.seek(0, os.SEEK_END)
                self._end = self._f.tell()

    def raise_kept(self) -> None:
        if self.error is not None:
            raise self.error
