"""What a training run reports: its summary (TrainResult), the store's figures in it, and the store's dataset card.

The summary table of ``her-store train`` shows the success rates, the steps, the store's episodes, transitions and
bytes, the process's memory and the wall time; a new store's dataset card names the env, the algorithm and the
versions of the code that trained it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from her_store.errors import NotAStoreError
from her_store.integrations.train_config import OFF_POLICY_ALGOS, TrainConfig
from her_store.store.episode_store import EpisodeStore

__all__ = ["TrainResult", "bytes_label", "bytes_on_disk", "dataset_card", "memory", "store_contents"]


@dataclass(frozen=True)
class TrainResult:
    """What a run reached, as its summary table shows it.

    Examples
    --------
    >>> result = train(TrainConfig(out="runs/bits"))  # doctest: +SKIP
    >>> result.success_rate >= 0.9  # doctest: +SKIP
    True
    """

    steps: int
    resumed_from: int | None
    success_rate: float
    success_rule: str | None
    train_success_rate: float | None
    episodes: int
    transitions: int
    store_bytes: int | None
    rss_bytes: int
    peak_rss_bytes: int
    seconds: float
    store: str
    checkpoint: str

    def rows(self) -> list[tuple[str, str]]:
        """The summary table's rows: label, value."""
        judged = [] if self.success_rule in (None, "is_success") else [
            ("success judged by (no is_success)", self.success_rule)]
        return [
            ("success rate (deterministic)", "n/a" if np.isnan(self.success_rate) else f"{self.success_rate:.1%}"),
            *judged,
            ("success rate (last 100 training episodes)",
             "n/a" if self.train_success_rate is None else f"{self.train_success_rate:.1%}"),
            ("steps",
             f"{self.steps:,}" + ("" if self.resumed_from is None else f" (resumed from {self.resumed_from:,})")),
            ("episodes stored", f"{self.episodes:,}"),
            ("transitions stored", f"{self.transitions:,}"),
            (bytes_label(self.store), "n/a" if self.store_bytes is None else _mib(self.store_bytes)),
            ("process resident memory (now / peak)", f"{_mib(self.rss_bytes)} / {_mib(self.peak_rss_bytes)}"),
            ("wall time", f"{self.seconds:.1f} s"),
            ("store", self.store),
            ("last checkpoint", self.checkpoint),
        ]


def bytes_label(store: str) -> str:
    """Where the store's bytes are: on disk, in this process's memory, or at a remote filesystem."""
    if store.startswith("memory://"):
        return "store bytes in memory (gone at exit)"
    if "://" in store and not store.startswith("file://"):
        return f"store bytes at {store.split('://', 1)[0]}://"
    return "store bytes on disk"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def store_contents(cfg: TrainConfig) -> tuple[int, int, str, tuple[str, ...]] | None:
    """(episodes, transitions, url, info keys) committed in the run's store, or None when there is no store yet."""
    try:
        with EpisodeStore.open(cfg.store_location, "r", cfg.storage_options) as store:
            return store.num_episodes, store.num_transitions, store.url, store.info_keys
    except NotAStoreError:
        return None


def bytes_on_disk(cfg: TrainConfig) -> int | None:
    loc = cfg.store_location
    if "://" not in loc or loc.startswith("file://"):
        path = loc.removeprefix("file://")
        # allocated blocks, not apparent sizes: chunk files are sparse until rows are written
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(loc, **(cfg.storage_options or {}))
        return int(fs.du(root))
    except (OSError, NotImplementedError, ValueError):
        return None


def dataset_card(cfg: TrainConfig, spec: Any) -> dict[str, Any]:
    """The dataset card of the run's store (:mod:`her_store.format.card`): the env, the algorithm, and the versions
    of the code that trained it (``requirements``: the pip requirements of the env, where its package is
    installed)."""
    import gymnasium
    import stable_baselines3
    import torch

    import her_store

    algo = f"{OFF_POLICY_ALGOS[cfg.algo.lower()]}+HER ({cfg.strategy})"
    modules = {"her_store": her_store, "stable_baselines3": stable_baselines3, "gymnasium": gymnasium, "torch": torch,
               "numpy": np}
    card: dict[str, Any] = {
        "env_id": cfg.env,
        "algorithm_name": algo,
        "description": f"the replay buffer of her-store train ({algo}, seed {cfg.seed})",
        "versions": {name: str(m.__version__) for name, m in modules.items()},
    }
    try:
        card["env_spec"] = spec.to_json()
    except (AttributeError, TypeError, ValueError):  # an entry point or kwargs that are not JSON
        pass
    entry = getattr(spec, "entry_point", None)
    module = entry.partition(":")[0] if isinstance(entry, str) else getattr(entry, "__module__", "")
    requirements = [_requirement(m) for m in ("gymnasium", module)]
    card["requirements"] = list(dict.fromkeys(r for r in requirements if r is not None))
    return card


def _requirement(module: str) -> str | None:
    """``name==version`` of the installed distribution of ``module``'s top-level package, or None."""
    from importlib import metadata

    try:
        dist = metadata.distribution(module.partition(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return None
    return f"{dist.metadata['Name']}=={dist.version}"


def memory() -> tuple[int, int]:
    """Resident memory of this process now and at its peak, in bytes."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return peak, peak
