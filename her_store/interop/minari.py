"""Minari datasets: a store's episodes written as a local Minari dataset, and a Minari dataset read into a new store.

A Minari dataset is a directory holding ``data/metadata.json`` and ``data/main_data.hdf5``; Minari keeps them at
``<root>/<dataset_id>`` (the root is ``MINARI_DATASETS_PATH``, default ``~/.minari/datasets``), where
``minari.load_dataset(dataset_id)`` finds them, and ``minari.MinariDataset(path + "/data")`` opens them anywhere.

Export writes that directory through Minari's own storage (``MinariStorage.new`` at the destination, then
``update_episodes`` with one ``EpisodeBuffer`` per episode), uncompressed (no JPEG encoding of images: the round
trip is bit-exact). Episodes take Minari's shape: observations ``T + 1`` rows, actions, rewards, terminations and
truncations ``T``, infos ``T + 1`` rows aligned with the observations as Minari's DataCollector records them (row 0
is the reset's info, which a store does not keep: it is written as zeros). The dataset card becomes Minari's
metadata: Minari's fields under their own names (``author`` and ``author_email`` as lists), every other card entry
(``env_id``, ``reward_function``, ``goal_keys``, ``success_threshold``, ``versions``, ...) beside them, and the
store's info spaces as ``her_store_info_spaces``.

Import reads ``metadata.json`` itself and checks it before Minari opens anything: the spaces must be declared there
(Minari would otherwise build the environment, running its code), and are parsed by her_store's own checked parser.
The HDF5 file is checked before Minari reads it, JPEG-encoded image frames by their headers: Minari decodes each at
the size its header declares, so each must be a JPEG or PNG of its space's shape.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
import os
import stat
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium import spaces

from her_store.checks import is_int
from her_store.errors import EpisodeValidationError, SchemaMismatchError, short_repr
from her_store.extras import require
from her_store.format.card import check_card
from her_store.format.schema import DTYPES, GOAL_KEYS, Schema, space_from_json, space_to_json
from her_store.interop import Batch, check_hdf5, exact_cast, minari_name, read_batches
from her_store.progress import progress as progress_bar
from her_store.storage import open_backend
from her_store.storage.files import staged_output
from her_store.store.episode_store import EpisodeStore

__all__ = ["export_minari", "import_minari", "minari_dataset_id"]

INFO_SPACES_KEY = "her_store_info_spaces"
# Keys of metadata.json that Minari writes itself (or that describe the data, not the dataset): never card entries.
MINARI_OWN_KEYS = frozenset(
    ("observation_space", "action_space", "total_episodes", "total_steps", "data_format", "jpeg_encoding",
     "minari_version", "dataset_size", INFO_SPACES_KEY)
)
_AUTHOR_KEYS = ("author", "author_email")
_MAX_SPACE_DEPTH = 8
# an inferred integer info's bounds: exact in the float64 a space's bounds pass through as JSON
_INT_BOUND = 1 << 53
# what an encoded frame may be (Minari writes JPEG; PNG is lossless), and the bytes of rows read at once to check them
_FRAME_FORMATS = ("JPEG", "PNG")
_FRAME_BLOCK = 1 << 22


def minari_dataset_id(dataset_id: Any, what: str) -> str:
    """``dataset_id`` checked against Minari's syntax, ``(namespace/)name-v<version>``, else a ValueError naming ``what``.

    Examples
    --------
    >>> minari_dataset_id("point/random-v0", "the card's dataset_id")
    'point/random-v0'
    >>> minari_dataset_id("point", "the destination's name")
    Traceback (most recent call last):
    ValueError: the destination's name 'point' is not a Minari dataset id: expected (namespace/)name-v<version>, e.g. 'point/random-v0'
    """
    from minari.dataset.minari_dataset import DATASET_ID_RE

    m = DATASET_ID_RE.fullmatch(dataset_id) if isinstance(dataset_id, str) else None
    if m is None or m.group("version") is None:  # Minari's loader needs the version
        raise ValueError(
            f"{what} {dataset_id!r} is not a Minari dataset id: expected (namespace/)name-v<version>, e.g. 'point/random-v0'"
        )
    return dataset_id


def export_minari(
    store: EpisodeStore, episode_ids: Sequence[int] | np.ndarray, dest: str | os.PathLike[str], *, progress: bool = False
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
    metadata = _minari_metadata(card, dataset_id, minari.__version__, store.schema.info_spaces)
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


def _minari_metadata(
    card: Mapping[str, Any], dataset_id: str, minari_version: str, info_spaces: Mapping[str, spaces.Space]
) -> dict[str, Any]:
    """The entries of Minari's metadata.json a card gives: every card entry, authors as lists, the info spaces."""
    clash = sorted(MINARI_OWN_KEYS & card.keys())
    if clash:
        raise ValueError(f"the dataset card holds {clash}, which Minari's metadata keeps for itself; remove them first")
    out = {k: v for k, v in card.items() if v is not None}
    for key in _AUTHOR_KEYS:
        if isinstance(out.get(key), str):
            out[key] = [out[key]]
    if "env_spec" in out:
        _env_id(out["env_spec"], "the dataset card")  # Minari's loader reads it: one it cannot read would stop it
    out["dataset_id"] = dataset_id
    out["minari_version"] = minari_version
    out[INFO_SPACES_KEY] = {k: space_to_json(s) for k, s in info_spaces.items()}
    return out


def import_minari(source: str | os.PathLike[str], store_path: str | os.PathLike[str], *, progress: bool = False) -> int:
    """Read a Minari dataset into a new store at ``store_path``; returns the number of episodes imported.

    Parameters
    ----------
    source : str or path
        A dataset directory (the one holding ``data/``, or ``data/`` itself), or a dataset id in the local Minari
        root (``MINARI_DATASETS_PATH``, default ``~/.minari/datasets``).
    store_path : path
        A local path where nothing exists yet; the store appears there only when every episode was imported.
    progress : bool
        Show a progress bar.

    The observation space must be a Dict with ``observation``, ``achieved_goal`` and ``desired_goal`` (a goal
    dataset). The card comes from Minari's metadata (a one-name author list becomes that name). Numeric infos become
    info keys, with the spaces a her_store export recorded, else float scalars as found (integers keep their dtype,
    booleans become float32); an info of ``T + 1`` rows (Minari's DataCollector: the reset's info first) is stored
    from its second row, one of ``T`` rows whole. Other infos are skipped with a warning. An array whose dtype is not
    its space's (rewards in float64, observations saved in float64 under a float32 Box) is cast only when every value
    survives exactly (:func:`~her_store.interop.exact_cast`), which is stated once per array as a warning;
    a cast that would change a value is refused.

    Raises
    ------
    ValueError
        Not a Minari dataset, not a goal dataset, or metadata or an episode that does not fit (named), or an array
        whose values its space's dtype cannot hold exactly (named, with both dtypes).
    EpisodeValidationError
        A ValueError: an encoded image frame whose header declares another size or format than its space (named
        with its episode and frame), found before anything decodes it.
    FileNotFoundError
        No such directory or dataset id.
    FileExistsError
        ``store_path`` exists.

    Examples
    --------
    >>> import_minari("point/random-v0", "runs/point_offline")  # doctest: +SKIP
    120
    """
    require("minari", "minari")
    require("h5py", "minari")
    from minari import MinariDataset
    from minari.dataset.minari_storage import MinariStorage

    data_dir = _data_dir(os.fspath(source))
    where = f"the Minari dataset at {data_dir}"
    _regular_files_only(data_dir, where)
    raw = open_backend(data_dir).read_bytes("metadata.json")
    if raw is None:
        raise FileNotFoundError(f"{where} has no metadata.json")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where}: metadata.json is not JSON, or nested too deep ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: metadata.json is a {type(meta).__name__}, expected a JSON object")
    minari_dataset_id(meta.get("dataset_id"), f"{where}: its dataset_id")
    if meta.get("data_format", "hdf5") != "hdf5":
        raise ValueError(
            f"{where}: data_format {short_repr(meta.get('data_format'))}; her_store imports Minari's hdf5 datasets (its "
            "file is checked before Minari reads it)"
        )
    for key in ("minari_version", "env_spec", "eval_env_spec"):
        if key in meta and not isinstance(meta[key], str):
            raise ValueError(f"{where}: {key} is {meta[key]!r}, expected a string")
    observation_space = _declared_space(meta, "observation_space", where)
    action_space = _declared_space(meta, "action_space", where)
    if not isinstance(observation_space, spaces.Dict) or not set(GOAL_KEYS) <= observation_space.spaces.keys():
        raise ValueError(
            f"{where} is not a goal-conditioned dataset: its observation space is {observation_space}; a store needs a "
            f"Dict observation space with {list(GOAL_KEYS)}"
        )
    card = {k: v for k, v in meta.items() if k not in MINARI_OWN_KEYS}
    for key in _AUTHOR_KEYS:
        if isinstance(card.get(key), list) and len(card[key]) == 1:
            card[key] = card[key][0]
    if INFO_SPACES_KEY not in meta and "env_id" not in card and "env_spec" in card:
        card["env_id"] = _env_id(card["env_spec"], where)  # a dataset from elsewhere: its env's id, for reward lookups
    card = check_card(card, f"{where}: its metadata")
    try:
        storage = MinariStorage.read(data_dir)  # the metadata only: the spaces and image encoding Minari reads with
    except (KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"{where} cannot be read by Minari: {type(e).__name__}: {e}") from None
    _check_data_file(data_dir, meta, _encoded_images(storage), where)
    try:
        dataset = MinariDataset(storage)
        episodes = iter(dataset.iterate_episodes())
        first = next(episodes, None)
    except (KeyError, TypeError, AssertionError) as e:
        raise ValueError(f"{where} cannot be read by Minari: {type(e).__name__}: {e}") from None
    declared = meta.get(INFO_SPACES_KEY)
    if declared is not None:
        if not isinstance(declared, dict):
            raise ValueError(f"{where}: {INFO_SPACES_KEY} is {declared!r}, expected an object of spaces")
        try:
            info_spaces = {k: space_from_json(s) for k, s in declared.items()}
        except SchemaMismatchError as e:
            raise ValueError(f"{where}: its {INFO_SPACES_KEY} in metadata.json: {e}") from None
    else:
        info_spaces = _inferred_info_spaces(first, where)
    try:  # the fields the spaces make (names that clash, unsupported spaces): before anything is written
        Schema(observation_space, action_space, info_spaces)
    except SchemaMismatchError as e:
        raise ValueError(f"{where}: its spaces in metadata.json make no store: {e}") from None
    count, total = 0, meta.get("total_episodes")
    with (
        staged_output(store_path) as tmp,
        EpisodeStore.create(
            tmp, observation_space, action_space, info_keys=info_spaces, metadata=card, commit_interval=60.0
        ) as store,
        progress_bar(total if isinstance(total, int) else None, "importing Minari", progress, unit="episode") as bar,
    ):
        noted: set[str] = set()
        names = {f.name: minari_name(f) for f in store.schema.fields}
        while first is not None:
            try:  # episode `count` is read, then appended, then the next one read
                ep = _store_episode(first, store.schema.observation_keys, info_spaces)
            except (KeyError, ValueError, TypeError, AssertionError) as e:
                raise ValueError(f"{where}: episode {count}: {type(e).__name__}: {e}") from None
            for f in store.schema.fields:  # Minari keeps what it was given: a dtype other than the space's is cast
                if f.name in ep:  # when that keeps every value, else refused
                    ep[f.name] = exact_cast(ep[f.name], f.dtype, where, names[f.name], count, noted)
            try:
                store.append_episode(ep)
                count += 1
                bar.update(1)
                first = next(episodes, None)
            except (KeyError, ValueError, TypeError, AssertionError) as e:
                raise ValueError(f"{where}: episode {count}: {type(e).__name__}: {e}") from None
    return count


def _check_data_file(data_dir: str, meta: Mapping[str, Any], images: Mapping[str, spaces.Box], where: str) -> None:
    """Before Minari reads it: the HDF5 file holds nothing that reads outside it or explodes in memory
    (:func:`~her_store.interop.check_hdf5`, encoded ``images`` counted as they decode), exactly the
    ``total_episodes`` episode groups the metadata says, and encoded frames that decode to their spaces' shapes
    (:func:`_check_frames`)."""
    import h5py

    path = os.path.join(data_dir, "main_data.hdf5")
    total = meta.get("total_episodes")
    if not is_int(total) or total < 1:
        raise ValueError(f"{where}: total_episodes is {total!r}; expected a positive integer")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise ValueError(f"{where}: {path} is not a readable HDF5 file ({e})") from None
    with f:
        check_hdf5(f, path, {name: math.prod(space.shape) for name, space in images.items()})
        groups = sum(1 for name in f if name.startswith("episode_"))
        if groups != total:
            raise ValueError(f"{where}: metadata.json says {total:,} episodes, {path} holds {groups:,}")
        for i in range(total):
            episode = f.get(f"episode_{i}")
            if isinstance(episode, h5py.Group):  # else Minari's reader refuses it, named below
                _check_frames(episode, images, f"{where}: episode {i}")


def _encoded_images(storage: Any) -> dict[str, spaces.Box]:
    """The datasets Minari's reader decodes as images, by their path in an episode's group, with their spaces: the
    image spaces (Minari's own test) of the observations and actions, when the dataset's images are encoded (Minari's
    default, also when metadata.json does not say)."""
    if not getattr(storage, "jpeg_encoding", False):  # a Minari that never encodes images reads them as stored
        return {}
    from minari.dataset.minari_storage import is_image_space

    def walk(space: spaces.Space, path: str) -> Iterator[tuple[str, spaces.Box]]:  # as the reader walks the groups
        if isinstance(space, spaces.Dict):
            for key, sub in space.spaces.items():
                yield from walk(sub, f"{path}/{key}")
        elif isinstance(space, spaces.Tuple):
            for i, sub in enumerate(space.spaces):
                yield from walk(sub, f"{path}/_index_{i}")
        elif is_image_space(space):
            yield path, space

    return dict(itertools.chain(walk(storage.observation_space, "observations"), walk(storage.action_space, "actions")))


def _check_frames(episode: Any, images: Mapping[str, spaces.Box], where: str) -> None:
    """Every encoded frame of ``episode`` (an HDF5 group) is a JPEG or PNG image that decodes to its space's shape in
    8-bit samples, told from its header alone (PIL reads the header, nothing decodes): Minari's reader decodes each
    frame at the size its header declares, and makes room for all of an episode's frames at the first one's size,
    before anything compares them with the space.

    Raises
    ------
    EpisodeValidationError
        Naming the episode (``where``), the dataset, the frame, what its header declares and what the space does.
    """
    import h5py
    from PIL import Image, ImageMode

    for name, space in images.items():
        frames = episode.get(name)
        if frames is None:  # an observation key the file lacks: the episode is refused when it is read
            continue
        if not isinstance(frames, h5py.Dataset):
            raise EpisodeValidationError(f"{where}: {name} is a group; encoded frames are a dataset of uint8 rows")
        vlen = h5py.check_vlen_dtype(frames.dtype)  # rows of unequal lengths (Minari's when the files' lengths differ)
        if not (frames.ndim == 1 and vlen == np.uint8 or frames.ndim == 2 and frames.dtype == np.uint8):
            raise EpisodeValidationError(
                f"{where}: {name} is {frames.shape} of {frames.dtype}; encoded frames are rows of uint8 bytes, one "
                "image file each"
            )
        if not len(frames):
            raise EpisodeValidationError(f"{where}: {name} holds no frame")
        declared = f"its space declares {space.shape} uint8 frames"
        # rows of a 2-D dataset are read a block at a time, variable-length rows one at a time (each is one file)
        step = 1 if vlen is not None else max(1, _FRAME_BLOCK // max(1, frames.shape[1]))
        for start in range(0, len(frames), step):
            for j, raw in enumerate(frames[start : start + step], start):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # its size is refused below
                        with Image.open(io.BytesIO(raw), formats=_FRAME_FORMATS) as image:
                            width, height, mode, kind = image.width, image.height, image.mode, image.format
                            bands = len(image.getbands())
                except (OSError, Image.DecompressionBombError) as e:
                    why = str(e) if isinstance(e, Image.DecompressionBombError) else type(e).__name__
                    raise EpisodeValidationError(
                        f"{where}: {name} frame {j} is no {' or '.join(_FRAME_FORMATS)} image whose header can be read "
                        f"({why}); {declared}"
                    ) from None
                shape = (height, width) if bands == 1 else (height, width, bands)
                dtype = np.dtype(ImageMode.getmode(mode).typestr)
                if shape != space.shape or dtype != np.uint8:
                    raise EpisodeValidationError(
                        f"{where}: {name} frame {j} is a {width}x{height} {mode} {kind} image, which decodes to "
                        f"{shape} {dtype}; {declared}"
                    )


def _data_dir(source: str) -> str:
    """The directory holding a dataset's metadata.json: from a dataset directory, its ``data/``, or a dataset id."""
    if os.path.isdir(source):
        for d in (os.path.join(source, "data"), source):
            if os.path.isfile(os.path.join(d, "metadata.json")):
                return os.path.abspath(d)
        raise ValueError(f"{source} is not a Minari dataset: no data/metadata.json in it")
    from minari.storage import get_dataset_path

    dataset_id = minari_dataset_id(source, f"{source!r} is no directory, and as a dataset id it")
    path = os.path.join(get_dataset_path(dataset_id), "data")
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(
            f"no Minari dataset {dataset_id!r} in the local Minari root {get_dataset_path()} (MINARI_DATASETS_PATH), "
            "and no directory of that name"
        )
    return path


def _regular_files_only(data_dir: str, where: str) -> None:
    """Refuse a dataset directory holding anything but directories and regular files below it (its own place may be
    reached through links, as a store's): a link there is followed by Minari's reader (out of the directory handed
    over), a FIFO blocks it forever."""
    for d, dirs, names in os.walk(data_dir):
        for name in [*dirs, *names]:
            path = os.path.join(d, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                kind = "a symbolic link" if stat.S_ISLNK(mode) else "neither a file nor a directory (a FIFO, a device)"
                raise ValueError(f"{where}: {path} is {kind}; a dataset is read from the regular files in its directory")


def _env_id(env_spec: str, where: str) -> str:
    """The id of an EnvSpec given as JSON (read, never made)."""
    from gymnasium.envs.registration import EnvSpec

    try:
        return str(EnvSpec.from_json(env_spec).id)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: its env_spec is not a gymnasium EnvSpec as JSON: {e}") from None


def _declared_space(meta: Mapping[str, Any], key: str, where: str) -> spaces.Space:
    """A space metadata.json declares, checked by her_store's parser (bounded sizes, supported kinds)."""
    text = meta.get(key)
    if not isinstance(text, str):
        raise ValueError(
            f"{where} declares no {key} in metadata.json; her_store does not build the environment to find it"
        )
    try:
        return space_from_json(_from_minari_space(json.loads(text), 0))
    except (ValueError, SchemaMismatchError) as e:
        raise ValueError(f"{where}: its {key} is not a space a store holds: {e}") from None


def _from_minari_space(d: Any, depth: int) -> Any:
    """Minari's space JSON in her_store's form: a Dict's ``subspaces`` as ``spaces``, Box bounds flattened."""
    if not isinstance(d, dict) or depth > _MAX_SPACE_DEPTH:
        return d  # her_store's parser names what is wrong
    if d.get("type") == "Dict" and isinstance(d.get("subspaces"), dict):
        return {"type": "Dict", "spaces": {k: _from_minari_space(s, depth + 1) for k, s in d["subspaces"].items()}}
    if d.get("type") == "Box":
        out = dict(d)
        for k in ("low", "high"):
            if isinstance(d.get(k), list):
                try:
                    out[k] = np.array(d[k], dtype=object).reshape(-1).tolist()
                except ValueError:  # ragged: left as is, and refused
                    pass
        return out
    return d


def _inferred_info_spaces(episode: Any, where: str) -> dict[str, spaces.Space]:
    """Info spaces of a dataset her_store did not write: numeric per-step arrays of the first episode."""
    if episode is None:
        return {}
    T = len(episode.rewards)
    out: dict[str, spaces.Space] = {}
    skipped = []
    for key, value in (episode.infos or {}).items():
        a = value if isinstance(value, np.ndarray) else None
        if a is None or a.dtype.name not in DTYPES or a.ndim < 1 or len(a) not in (T, T + 1):
            skipped.append(key)
        elif a.dtype.kind == "f":
            out[key] = spaces.Box(-np.inf, np.inf, a.shape[1:], a.dtype)
        elif a.dtype.kind in "iu":
            info = np.iinfo(a.dtype)
            out[key] = spaces.Box(max(info.min, -_INT_BOUND), min(info.max, _INT_BOUND), a.shape[1:], a.dtype)
        else:
            out[key] = spaces.Box(-np.inf, np.inf, a.shape[1:], np.float32)
    if skipped:
        warnings.warn(f"{where}: infos {skipped} are not numeric per-step arrays; they are not imported", stacklevel=3)
    return out


def _store_episode(ep: Any, observation_keys: Sequence[str], info_keys: Iterable[str]) -> dict[str, Any]:
    """A Minari episode in a store's episode shape (infos of ``T + 1`` rows drop the reset's), in the file's dtypes."""
    obs = ep.observations
    if not isinstance(obs, dict):
        raise ValueError(f"observations are a {type(obs).__name__}, expected a dict of {list(observation_keys)}")
    out: dict[str, Any] = dict(obs)
    out.update(action=ep.actions, reward=ep.rewards, terminated=ep.terminations, truncated=ep.truncations)
    T = len(ep.rewards)
    infos = ep.infos or {}
    for key in info_keys:
        if key not in infos:
            raise ValueError(f"info {key!r} is missing (the first episode has it)")
        a = np.asarray(infos[key])
        out[key] = a[1:] if len(a) == T + 1 else a
    return out
