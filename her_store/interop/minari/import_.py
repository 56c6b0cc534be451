"""A Minari dataset read into a new store, every file checked before Minari reads it.

Import reads ``metadata.json`` itself and checks it before Minari opens anything: the spaces must be declared there
(Minari would otherwise build the environment, running its code), and are parsed by her_store's own checked parser
(:mod:`her_store.interop.minari.metadata`). The HDF5 file is checked before Minari reads it, JPEG-encoded image
frames by their headers: Minari decodes each at the size its header declares, so each must be a JPEG or PNG of its
space's shape.
"""

from __future__ import annotations

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
from her_store.format.schema import DTYPES, GOAL_KEYS, Schema, space_from_json
from her_store.interop.checks import check_hdf5, exact_cast
from her_store.interop.layout import minari_name
from her_store.interop.minari.metadata import (
    INFO_SPACES_KEY,
    card_from_metadata,
    declared_space,
    minari_dataset_id,
)
from her_store.progress import progress as progress_bar
from her_store.storage import open_backend
from her_store.storage.files import staged_output
from her_store.store.episode_store import EpisodeStore

__all__ = ["import_minari"]

# an inferred integer info's bounds: exact in the float64 a space's bounds pass through as JSON
_INT_BOUND = 1 << 53
# what an encoded frame may be (Minari writes JPEG; PNG is lossless), and the bytes of rows read at once to check them
_FRAME_FORMATS = ("JPEG", "PNG")
_FRAME_BLOCK = 1 << 22


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
    survives exactly (:func:`~her_store.interop.checks.exact_cast`), which is stated once per array as a warning;
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
    meta = _read_metadata(data_dir, where)
    observation_space = declared_space(meta, "observation_space", where)
    action_space = declared_space(meta, "action_space", where)
    if not isinstance(observation_space, spaces.Dict) or not set(GOAL_KEYS) <= observation_space.spaces.keys():
        raise ValueError(
            f"{where} is not a goal-conditioned dataset: its observation space is {observation_space}; a store needs a "
            f"Dict observation space with {list(GOAL_KEYS)}"
        )
    card = card_from_metadata(meta, where)
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
    info_spaces = _info_spaces(meta, first, where)
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


def _read_metadata(data_dir: str, where: str) -> dict[str, Any]:
    """The dataset's metadata.json: a JSON object with a valid ``dataset_id``, ``data_format`` hdf5 (the default) and
    strings where Minari keeps its version and env specs.

    Raises
    ------
    FileNotFoundError
        There is no metadata.json.
    ValueError
        It is not JSON, not an object, or one of those entries is not as said (named).
    """
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
            f"{where}: data_format {short_repr(meta.get('data_format'))}; her_store imports Minari's hdf5 datasets "
            "(its file is checked before Minari reads it)"
        )
    for key in ("minari_version", "env_spec", "eval_env_spec"):
        if key in meta and not isinstance(meta[key], str):
            raise ValueError(f"{where}: {key} is {meta[key]!r}, expected a string")
    return meta


def _info_spaces(meta: Mapping[str, Any], first: Any, where: str) -> dict[str, spaces.Space]:
    """The info keys' spaces: those a her_store export recorded in the metadata (``INFO_SPACES_KEY``), else those
    inferred from the ``first`` episode (:func:`_inferred_info_spaces`).

    Raises
    ------
    ValueError
        The recorded spaces are not an object of spaces her_store reads (named).
    """
    declared = meta.get(INFO_SPACES_KEY)
    if declared is None:
        return _inferred_info_spaces(first, where)
    if not isinstance(declared, dict):
        raise ValueError(f"{where}: {INFO_SPACES_KEY} is {declared!r}, expected an object of spaces")
    try:
        return {k: space_from_json(s) for k, s in declared.items()}
    except SchemaMismatchError as e:
        raise ValueError(f"{where}: its {INFO_SPACES_KEY} in metadata.json: {e}") from None


def _check_data_file(data_dir: str, meta: Mapping[str, Any], images: Mapping[str, spaces.Box], where: str) -> None:
    """Before Minari reads it: the HDF5 file holds nothing that reads outside it or explodes in memory
    (:func:`~her_store.interop.checks.check_hdf5`, encoded ``images`` counted as they decode), exactly the
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
                raise ValueError(
                    f"{where}: {path} is {kind}; a dataset is read from the regular files in its directory"
                )


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
