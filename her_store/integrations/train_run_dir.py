"""The run directory of a training run: its record ``run.json``, its atomic checkpoints, and undoing a failed start.

A run lives in ``--out``: ``run.json`` (the options that define the run, written with the first checkpoint: a start
that fails before leaves nothing it made, so the corrected command is accepted) and ``checkpoints/`` (the model and
the replay buffer's handle, each checkpoint written under a temporary name and renamed into place).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from typing import Any

from her_store.integrations.train_config import RUN_KEYS, TrainConfig
from her_store.integrations.train_errors import doing
from her_store.storage.files import fsync_file

__all__ = [
    "check_run_dir",
    "checkpoint",
    "final_checkpoint",
    "latest_checkpoint",
    "run_record",
    "save_checkpoint",
    "unmaker",
]


def run_record(cfg: TrainConfig) -> dict[str, Any]:
    """What ``run.json`` holds of ``cfg``: the options that define the run (:data:`RUN_KEYS`), the store's location."""
    record = {k: getattr(cfg, k) for k in RUN_KEYS}
    record["store"] = cfg.store_location
    return record


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, fsynced, renamed into place."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with doing(f"writing {path}"), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse options that would make the run recorded in ``run.json`` (if any) another run."""
    if os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise ValueError(f"--out {cfg.out} is a file; the run directory must be a directory (or a new path)")
    with doing(f"creating the run directory --out {cfg.out}"):
        os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "run.json")
    if not os.path.exists(path):
        return
    record = run_record(cfg)
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a run record of her-store train ({e}); pick another --out") from None
    if not isinstance(saved, dict):
        raise TypeError(f"{path} is not a run record of her-store train; pick another --out")
    for k in RUN_KEYS:
        if saved.get(k) != record[k]:
            raise ValueError(
                f"{cfg.out} holds a run with --{k.replace('_', '-')} {saved.get(k)!r}, not {record[k]!r}; "
                f"run it with the same options to resume, or pick another --out"
            )


def checkpoint(model: Any, cfg: TrainConfig) -> str:
    """Save a checkpoint of the run; the first one also writes ``run.json``, from when on the run exists.

    A start that fails before (a bad option the algorithm refuses, a store it cannot use) leaves no record, so the
    corrected command is accepted.
    """
    path = os.path.join(cfg.out, "run.json")
    if not os.path.exists(path):
        _write_atomic(path, json.dumps(run_record(cfg), indent=1).encode())
    return save_checkpoint(model, cfg.out)


def _checkpoint_dir(out: str) -> str:
    """Where the checkpoints of the run directory ``out`` are."""
    return os.path.join(out, "checkpoints")


def latest_checkpoint(out: str) -> tuple[int, str] | None:
    """The step and directory of the newest complete checkpoint of a run directory, or None.

    Checkpoints are written as ``checkpoints/.step-<N>.tmp`` and renamed to ``checkpoints/step-<N>`` when complete,
    so a directory without the temporary prefix is whole (leftovers of a killed write are ignored here and removed
    by the next :func:`save_checkpoint`).

    Examples
    --------
    >>> latest_checkpoint("runs/bits")  # doctest: +SKIP
    (5000, 'runs/bits/checkpoints/step-000005000')
    """
    root = _checkpoint_dir(out)
    if not os.path.isdir(root):
        return None
    best: tuple[int, str] | None = None
    for name in os.listdir(root):
        if name.startswith("step-") and name[5:].isdigit() and (best is None or int(name[5:]) > best[0]):
            best = (int(name[5:]), os.path.join(root, name))
    return best


def save_checkpoint(model: Any, out: str) -> str:
    """Save ``model`` and its replay buffer's handle as the run's newest checkpoint, atomically; return its directory.

    Both files go to a temporary directory, are fsynced, and the directory is renamed into place: a process killed
    at any moment leaves the previous checkpoint whole. A write that fails (a full disk) removes its temporary
    directory and raises with a note naming the checkpoint. Older checkpoints and leftovers of killed writes are removed
    afterwards (the caller's buffer holds the store's writer lock, so no other run of this directory is writing).

    Examples
    --------
    >>> save_checkpoint(model, "runs/bits")  # doctest: +SKIP
    'runs/bits/checkpoints/step-000001000'
    """
    root = _checkpoint_dir(out)
    os.makedirs(root, exist_ok=True)
    name = f"step-{model.num_timesteps:09d}"
    final = os.path.join(root, name)
    if os.path.isdir(final):
        return final
    tmp = os.path.join(root, f".{name}.tmp-{os.getpid()}")
    try:
        with doing(f"writing the checkpoint {final}"):
            os.makedirs(tmp)
            model.save(os.path.join(tmp, "model.zip"))
            model.save_replay_buffer(os.path.join(tmp, "replay_buffer.pkl"))
            for f in os.listdir(tmp):
                fsync_file(os.path.join(tmp, f))
            fsync_file(tmp)
            os.rename(tmp, final)
            fsync_file(root)
    except BaseException:  # a full disk, Ctrl-C: the previous checkpoint is whole, the partial one goes
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for other in os.listdir(root):
        if other.startswith((".step-", "step-")) and other != name:
            shutil.rmtree(os.path.join(root, other), ignore_errors=True)
    return final


def final_checkpoint(model: Any, cfg: TrainConfig) -> str:
    """The last checkpoint of a run that stops: its unfinished episodes end here, as truncated (closing the buffer
    would end them anyway), so that the store holds nothing newer than the checkpoint and a resumed run starts from
    both as they were."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # SB3's truncation warning speaks of a buffer being loaded
        model.replay_buffer.truncate_last_trajectory()
    return checkpoint(model, cfg)


def unmaker(url: str, storage_options: dict[str, Any] | None = None) -> Callable[[], None]:
    """A function removing what is made at ``url`` (a local path or an fsspec URL) from now on: all of it, with the
    local parent directories made for it, when nothing is there now; else what a directory there holds then and not
    now. Nothing that is there now is ever removed (where that cannot be read, nothing is)."""
    if "://" not in url or url.startswith("file://"):
        path = os.path.abspath(url.removeprefix("file://"))
        if not os.path.lexists(path):
            top = path
            while not os.path.lexists(os.path.dirname(top)):
                top = os.path.dirname(top)
            return lambda: shutil.rmtree(top, ignore_errors=True)
        if not os.path.isdir(path) or os.path.islink(path):
            return lambda: None
        held = set(os.listdir(path))

        def remove_new_entries() -> None:
            for name in set(os.listdir(path)) - held:
                entry = os.path.join(path, name)
                if os.path.isdir(entry) and not os.path.islink(entry):
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    os.remove(entry)

        return remove_new_entries
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        there = fs.exists(root)
        listed = set(fs.ls(root, detail=False)) if there and fs.isdir(root) else set()
    except Exception:  # noqa: BLE001 -- unreachable, no credentials: what is there is unknown, so nothing is removed
        return lambda: None

    def remove_new_objects() -> None:
        fs.invalidate_cache()
        if not there:
            if fs.exists(root):
                fs.rm(root, recursive=True)
            return
        for entry in set(fs.ls(root, detail=False)) - listed:
            fs.rm(entry, recursive=True)

    return remove_new_objects
