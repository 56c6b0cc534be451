"""``her-store verify --repair``: drop what :func:`~her_store.ops.verify.verify` finds damaged, with a new commit.

Episode ids are consecutive, so episodes are dropped as the ring drops them: bad episodes at the start of the live
range are evicted; from the first bad episode after them the live range is cut, and the good episodes that followed
it are appended again (new ids, each printed beside its old one). The episodes it moves, and its plan, wait beside the
store before the cut is committed (:mod:`her_store.ops.repair_plan`): a repair killed half-way loses nothing, and the
next one finishes it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import numpy as np

from her_store.errors import CorruptStoreError, StoreError
from her_store.ops.repair_plan import PLAN_KEY, plan_of, spill_dir
from her_store.ops.report import Report, id_ranges
from her_store.ops.verify import verify
from her_store.progress import progress as progress_bar
from her_store.sampling.priority_checkpoint import discard_checkpoint
from her_store.storage import open_backend
from her_store.store.episode_store import EpisodeStore

__all__ = ["clear_tail", "repair"]


def repair(path: str | os.PathLike[str], *, progress: bool = False, log: Callable[[str], None] = print) -> Report:
    """Drop what :func:`verify` finds damaged, with a new commit, and return the report of the repaired store.

    Under the writer lock (the store opened with ``mode="a"``): episodes that fail their crc32 or whose rows are
    missing or unreadable are dropped (bad episodes at the start of the live range are evicted; from the first bad one
    after them the live range is cut and the good episodes that followed are appended again, with new ids), shards
    that cannot be read and hold no kept row are removed, short chunk files are filled out with zeros, and what lies
    past the commit record is cleared. Every dropped and renumbered episode is logged. Readers open during a repair
    must be reopened.

    Parameters
    ----------
    path : str or PathLike
        A local store (repairs rewrite files in place: on object storage, copy the store to local disk first).
    progress : bool
        Progress bars over the bytes read.
    log : callable
        Receives each line saying what was found and done.

    Raises
    ------
    CorruptStoreError
        The store cannot be opened (its commit record, attributes or index are damaged): nothing was changed.
    StoreError
        A URL (repair works on local disk only).

    Examples
    --------
    >>> report = repair("runs/fetch")  # doctest: +SKIP
    >>> report.clean  # doctest: +SKIP
    True
    """
    loc = open_backend(path)
    if loc.local_directory() is None and loc.read_only is None:  # object storage (a read-only place says why below)
        raise StoreError(
            f"{loc}: --repair works on a store on local disk (it drops episodes in place, and readers of object "
            "storage cannot be kept out meanwhile); copy the store to local disk, repair it there, and copy it back"
        )
    try:
        store = EpisodeStore.open(loc, mode="a")
    except CorruptStoreError as e:
        raise CorruptStoreError(f"{e}; it cannot be repaired (nothing was changed)") from e
    with store:
        _finish_moving(store, log)
        found = verify(store, progress=progress)
        log(found.summary())
        if found.clean:
            return found
        _drop(store, found, progress, log)
        for key, size in found.short_files:  # what is missing reads as zeros: now on disk too, as FORMAT.md says
            fd = loc.open_file(key)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            log(f"{key}: filled out to {size:,} bytes")
        for key in found.linked_files:  # the same bytes under a name of the store's alone, replacing the shared one
            f, _, size = loc.open_range(key)
            with f:
                data = os.pread(f.fileno(), size, 0)
            loc.write_atomic(key, data, fsync=True)
            log(f"{key}: copied, its other names left as they were")
        clear_tail(store, log)
        final = verify(store, progress=progress)
        log(final.summary())
        return final


def clear_tail(store: EpisodeStore, log: Callable[[str], None] = print) -> None:
    """Empty what lies past the commit record of a store open for appending (index rows of ids never committed, rows
    past ``write_row``): what a commit that never completed left, or what a copy made while its source was written
    carried along.

    Examples
    --------
    >>> with EpisodeStore.open("runs/fetch", mode="a") as store:  # doctest: +SKIP
    ...     clear_tail(store)
    """
    if store.mode != "a":
        raise StoreError(f"{store.url}: open the store with mode='a' to clear past its commit record")
    committer = store.committer
    left = verify(store, checksums=False)
    if left.tail_positions or left.tail_chunks or left.junk_chunks:
        committer.clear_uncommitted(left.tail_positions, left.tail_chunks, left.junk_chunks)
        log(
            f"cleared past the commit: {len(left.tail_positions)} index rows, chunks "
            f"{ {p: c for p, c in left.tail_chunks.items()} }, removed unreadable chunks {left.junk_chunks}"
        )


def _drop(store: EpisodeStore, found: Report, progress: bool, log: Callable[[str], None]) -> None:
    """Drop ``found.bad_episodes`` with a new commit, appending the good episodes after the first cut again."""
    committer = store.committer
    bad = found.bad_episodes
    first, end = store.first_episode, store.end_episode
    if not len(bad):
        return
    leading = bad == np.arange(first, first + len(bad))  # bad episodes at the start of the live range: evicted
    lead = len(bad) if leading.all() else int(np.argmin(leading))
    rest = bad[lead:]
    cut = int(rest[0]) if len(rest) else end
    keep = np.setdiff1d(np.arange(cut, end), rest)
    env_index, priority = store.episodes["env_index"], store.episodes["priority"]
    spill = None
    if len(keep):
        # the good episodes after the cut, copied aside before the cut drops them from the commit, with a plan that a
        # repair run after a crash (or a full disk) finishes from: nothing committed is lost at any point
        spill = spill_dir(store.url)
        shutil.rmtree(spill, ignore_errors=True)
        os.makedirs(spill)
        with EpisodeStore.create(
            os.path.join(spill, "tail"), store.observation_space, store.action_space, info_keys=store.schema.info_spaces
        ) as aside:
            bar = progress_bar(len(keep), "copying aside", progress, unit="episode")
            for i in keep.tolist():
                aside.append_episode(
                    store.episode(i), env_index=int(env_index[i - first]), priority=float(priority[i - first])
                )
                bar.update(1)
            bar.close()
        plan = {"cut": cut, "count": len(keep), "ids": keep.tolist(), "generation": store.commit_record.generation}
        open_backend(spill).write_atomic(PLAN_KEY, json.dumps(plan).encode(), fsync=True)
    committer.keep_only(first + lead, cut)
    for i in bad.tolist():
        log(f"dropped episode {i}")
    if discard_checkpoint(store.backend):  # its ids and rows are other episodes' now
        log("removed the priorities checkpoint (priorities/manifest.json): it names episodes by ids and rows")
    for key in found.damaged_files:  # every episode with rows in them was dropped
        store.backend.remove(key)
        log(f"removed {key} (unreadable; no kept episode has rows in it)")
    if spill is not None:
        log(f"episodes {id_ranges(keep)} follow a dropped one: appending them again ({spill} holds them meanwhile)")
        _finish_moving(store, log)


def _finish_moving(store: EpisodeStore, log: Callable[[str], None]) -> None:
    """Append again what a repair moved aside and has not appended yet (all of it, or what a crash left), then
    remove it. A spill without a plan is a copy the cut never came after: the store still holds those episodes."""
    spill = spill_dir(store.url)
    if not os.path.isdir(spill):
        return
    plan = plan_of(store.url)
    if plan is None or store.commit_record.generation == plan["generation"]:
        # no plan: the cut never came after the copy; the plan's own generation: the cut's commit never replaced it.
        # Either way the store still holds every episode copied aside
        shutil.rmtree(spill)
        return
    done = store.end_episode - plan["cut"]
    if not 0 <= done <= plan["count"]:
        raise CorruptStoreError(
            f"{store.url} ends at episode {store.end_episode}, which a repair that cut it at {plan['cut']} and appends "
            f"{plan['count']} episodes again never left; the episodes it moved are in {spill}"
        )
    with EpisodeStore.open(os.path.join(spill, "tail")) as aside:
        env_index, priority = aside.episodes["env_index"], aside.episodes["priority"]
        for j in range(done, plan["count"]):
            new = store.append_episode(
                aside.episode(aside.first_episode + j), env_index=int(env_index[j]), priority=float(priority[j])
            )
            log(f"episode {plan['ids'][j]} is now episode {new}")
    store.flush()
    shutil.rmtree(spill)
