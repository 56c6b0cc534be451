"""Batches on a device (tools/bench.py's ``--device cuda`` figures): her_store's samplers delivering to CUDA tensors
beside stable-baselines3's HerReplayBuffer(device=...), against the host->device bandwidth measured in the same run.

    python tools/bench.py --device cuda            # every device figure
    python tools/bench.py --device cuda --quick    # smaller stores and fewer rounds, a few minutes

Data as tools/bench.py's: FetchReach-shaped transitions (batch 1024) and 3x84x84 uint8 images (batch 256, LZ4), 50-step
episodes on local disk, warm page cache; sampling is future, n_sampled_goal=4, rewards recomputed. The figures:

- device_copy: a large pinned host->device copy (bytes/s), the anchor of every "x bandwidth" figure, and a
  pageable one;
- device_fetch, device_images: transitions/s on the device with pinned staging + ``non_blocking`` copies, with
  plain pageable copies, and SB3's HerReplayBuffer sampling to the same device; bytes per batch and bytes/s over
  the bandwidth;
- device_prefetch: a stand-in training step (fixed matmuls on the device, its loss read on the host) with a batch
  sampled before each step, without prefetch and with prefetch=2: the share of the step's time sampling adds;
- device_working_set: WorkingSetSampler holding its set as device tensors against HerSampler: transitions/s and
  host->device bytes of each batch's fields (not counted: the gathers' row indices, 8 bytes a row per array).

Every figure runs on any torch device: tests/test_cuda.py runs them on the CPU for a couple of batches, where the
copies are memory copies and the figures say nothing about a GPU.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/bench.py as `bench`, imported from tests too
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # her_store from this checkout

from bench import (  # tools/bench.py: the data and timing of every figure
    EP_LEN,
    IMG_BATCH,
    IMG_POOL,
    build_image_store,
    fetch_reward,
    filled_store,
    image_pool,
    interleaved_rounds,
    sb3_filled,
    sb3_image_filled,
    warm_up,
)

from her_store import EpisodeStore, HerSampler
from her_store.sampling.batch import DeviceTransfer
from her_store.sampling.working_set import WorkingSetSampler

FETCH_BATCH = 1024


@dataclass(frozen=True)
class Sizes:
    """How much each device figure stores and times."""

    fetch: int  # FetchReach-shaped transitions stored
    images: int  # 3x84x84 image transitions stored
    rounds: int  # interleaved rounds of every timing (the median is reported)
    calls: int  # batches per round
    steps: int  # stand-in training steps per round of the prefetch figure
    matmul: int  # side of the stand-in step's square float32 matrices
    matmuls: int  # matrix products per stand-in step
    copy_bytes: int  # bytes of the bandwidth copy


QUICK = Sizes(fetch=100_000, images=10_000, rounds=5, calls=20, steps=50, matmul=2048, matmuls=8, copy_bytes=1 << 30)
FULL = Sizes(fetch=1_000_000, images=50_000, rounds=9, calls=50, steps=200, matmul=2048, matmuls=8, copy_bytes=4 << 30)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CPU's is done when queued)."""
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """The device's name, as its driver gives it."""
    if device.type == "cuda":  # pragma: no cover - needs CUDA
        p = torch.cuda.get_device_properties(device)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"{device} (no copy to a device: the figures time memory copies), torch {torch.__version__}"


def host_buffer(nbytes: int, device: torch.device, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked when ``pinned`` and the device is CUDA (the memory a DMA copy reads)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and device.type == "cuda":  # pragma: no cover - needs CUDA
        t = t.pin_memory()
    return t


def tensor_nbytes(x: Any) -> int:
    """Bytes of every tensor in ``x``: a tensor, or a (named) tuple, list or dict of them (HerBatch, SB3's samples)."""
    if isinstance(x, torch.Tensor):
        return x.element_size() * x.nelement()
    if isinstance(x, dict):
        return sum(tensor_nbytes(v) for v in x.values())
    if isinstance(x, (tuple, list)):
        return sum(tensor_nbytes(v) for v in x)
    return 0


class CountingTransfer(DeviceTransfer):
    """A sampler's :class:`DeviceTransfer`, counting the bytes of the host arrays it hands to the device (a tensor
    already there, such as a device working set's rows, is neither copied nor counted)."""

    def __init__(self, transfer: DeviceTransfer) -> None:
        super().__init__(transfer.device, transfer.pin_memory)
        self.nbytes = 0

    def __call__(self, a: Any) -> torch.Tensor:
        if not isinstance(a, torch.Tensor):
            self.nbytes += a.nbytes
        return super().__call__(a)


class StandInStep:
    """A fixed training step on the device: ``matmuls`` products of ``size`` x ``size`` float32 matrices and a term of
    the batch's rewards, actions and observations, its loss read on the host (which waits for the device, as a
    training loop logging its loss does)."""

    def __init__(self, device: torch.device, size: int, matmuls: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = (torch.randn(size, size, generator=g) / size**0.5).to(device)
        self.matmuls = matmuls

    def __call__(self, batch: Any) -> float:
        x = self.w
        for _ in range(self.matmuls):
            x = x @ self.w
        loss = x.mean() + batch.rewards.mean() + batch.actions.mean()
        for v in batch.observations.values():
            loss = loss + v.float().mean()
        return float(loss)


_BANDWIDTH: dict[tuple[str, int], dict[str, float]] = {}


def host_to_device(device: torch.device, nbytes: int, rounds: int = 5) -> dict[str, float]:
    """Bytes/s of one ``nbytes`` copy from pinned and from pageable host memory to ``device`` (medians over
    ``rounds``); measured once a run per device and size."""
    key = (str(device), nbytes)
    if key not in _BANDWIDTH:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = {}
        for how, pinned in (("pinned", True), ("pageable", False)):
            src = host_buffer(nbytes, device, pinned)
            src.fill_(1)
            dst.copy_(src, non_blocking=pinned)  # the first copy maps the pages
            synchronize(device)
            spent = []
            for _ in range(rounds):
                t = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                synchronize(device)
                spent.append(time.perf_counter() - t)
            out[how] = nbytes / statistics.median(spent)
            del src
        _BANDWIDTH[key] = out
    return _BANDWIDTH[key]


def _synced(fn: Callable[[], Any], device: torch.device, calls: int) -> Callable[[], None]:
    """``calls`` calls of ``fn``, then a wait for the device: what the batches cost once on it."""

    def run() -> None:
        for _ in range(calls):
            fn()
        synchronize(device)

    return run


_IMAGES: dict[str, str] = {}


def image_store(workdir: str, n: int) -> str:
    """A store of n 3x84x84 rendered-frame transitions, default codec (LZ4), built once a run."""
    path = os.path.join(workdir, f"device-images{n}")
    if path not in _IMAGES:
        build_image_store(path, image_pool("rendered", min(IMG_POOL, max(1, n // EP_LEN))), n)
        _IMAGES[path] = path
    return path


def _sampling_figures(
    device: torch.device, batch: int, fns: dict[str, Callable[[], Any]], sizes: Sizes
) -> dict[str, Any]:
    """Warm, interleaved timings of ``fns`` (each returns one batch on ``device``): transitions/s, bytes per batch and
    bytes/s over the pinned copy bandwidth."""
    bandwidth = host_to_device(device, sizes.copy_bytes)["pinned"]
    warm_up(fns)
    per_call = interleaved_rounds({k: _synced(f, device, sizes.calls) for k, f in fns.items()}, sizes.rounds, 1)
    out: dict[str, Any] = {}
    for name, f in fns.items():
        seconds = per_call[name] / sizes.calls
        nbytes = tensor_nbytes(f())
        out[f"{name} transitions/s"] = batch / seconds
        out[f"{name} bytes per batch"] = nbytes
        out[f"{name} bytes/s x bandwidth"] = nbytes / seconds / bandwidth
    return out


def _pinned_pageable_sb3(
    device: torch.device, store: EpisodeStore, batch: int, rb: Any, sizes: Sizes
) -> dict[str, Any]:
    """HerSampler with pinned and with pageable copies, and SB3's buffer ``rb`` (None: not installed), to ``device``."""
    kw = dict(reward_fn=fetch_reward, seed=0, device=device)
    with (
        HerSampler(store, batch, pin_memory=True, **kw) as pinned,
        HerSampler(store, batch, pin_memory=False, **kw) as pageable,
    ):
        fns: dict[str, Callable[[], Any]] = {"pinned": pinned.sample, "pageable": pageable.sample}
        if rb is not None:
            fns["sb3"] = lambda: rb.sample(batch, env=None)
        out = _sampling_figures(device, batch, fns, sizes)
    out["pinned / pageable"] = out["pinned transitions/s"] / out["pageable transitions/s"]
    if rb is None:
        out["sb3"] = "not installed"
    else:
        out["pinned / sb3"] = out["pinned transitions/s"] / out["sb3 transitions/s"]
    return out


def bench_device_copy(
    workdir: str, quick: bool, device: str | torch.device, sizes: Sizes | None = None
) -> dict[str, Any]:
    """The host->device copy bandwidth the other figures are measured against (a large pinned copy; a pageable one
    beside it), and the device."""
    dev, sizes = torch.device(device), sizes or (QUICK if quick else FULL)
    bw = host_to_device(dev, sizes.copy_bytes)
    return {
        "device": device_name(dev),
        "copy bytes": sizes.copy_bytes,
        "pinned host->device bytes/s": bw["pinned"],
        "pageable host->device bytes/s": bw["pageable"],
        "pageable / pinned": bw["pageable"] / bw["pinned"],
    }


def bench_device_fetch(
    workdir: str, quick: bool, device: str | torch.device, sizes: Sizes | None = None
) -> dict[str, Any]:
    """FetchReach-shaped, batch 1024, warm, local disk to the device: pinned + non_blocking vs pageable copies vs SB3's
    HerReplayBuffer(device=...)."""
    dev, sizes = torch.device(device), sizes or (QUICK if quick else FULL)
    with EpisodeStore.open(filled_store(workdir, sizes.fetch)) as store:
        out: dict[str, Any] = {"stored transitions": sizes.fetch, "batch": FETCH_BATCH}
        out.update(_pinned_pageable_sb3(dev, store, FETCH_BATCH, sb3_filled(sizes.fetch, device=str(dev)), sizes))
    return out


def bench_device_images(
    workdir: str, quick: bool, device: str | torch.device, sizes: Sizes | None = None
) -> dict[str, Any]:
    """3x84x84 uint8 images (LZ4), batch 256, warm, local disk to the device: pinned + non_blocking vs pageable copies
    vs SB3's HerReplayBuffer(device=...)."""
    dev, sizes = torch.device(device), sizes or (QUICK if quick else FULL)
    path = image_store(workdir, sizes.images)
    pool = image_pool("rendered", min(IMG_POOL, max(1, sizes.images // EP_LEN)))
    rb = sb3_image_filled(pool, sizes.images, device=str(dev))
    with EpisodeStore.open(path) as store:
        out: dict[str, Any] = {"stored transitions": sizes.images, "batch": IMG_BATCH}
        out.update(_pinned_pageable_sb3(dev, store, IMG_BATCH, rb, sizes))
    return out


def _stores(workdir: str, sizes: Sizes) -> Iterator[tuple[str, str, int]]:
    """(label, path, batch size) of the FetchReach-shaped and the image store."""
    yield f"fetch B={FETCH_BATCH}", filled_store(workdir, sizes.fetch), FETCH_BATCH
    yield f"images B={IMG_BATCH}", image_store(workdir, sizes.images), IMG_BATCH


def bench_device_prefetch(
    workdir: str, quick: bool, device: str | torch.device, sizes: Sizes | None = None
) -> dict[str, Any]:
    """A stand-in training step (fixed matmuls on the device, its loss read on the host) with a batch sampled before
    each: the share of the step's time sampling adds, without prefetch and with prefetch=2."""
    dev, sizes = torch.device(device), sizes or (QUICK if quick else FULL)
    step = StandInStep(dev, sizes.matmul, sizes.matmuls)
    out: dict[str, Any] = {"stand-in step": f"{sizes.matmuls} products of {sizes.matmul}x{sizes.matmul} float32"}
    for label, path, batch in _stores(workdir, sizes):
        kw = dict(reward_fn=fetch_reward, seed=1, device=dev)
        with (
            EpisodeStore.open(path) as store,
            HerSampler(store, batch, **kw) as plain,
            HerSampler(store, batch, prefetch=2, **kw) as ahead,
        ):
            fixed = plain.sample()  # the step alone: the same work on a batch already on the device
            loops: dict[str, Callable[[], float]] = {
                "step alone": lambda fixed=fixed: step(fixed),
                "prefetch=0": lambda: step(plain.sample()),
                "prefetch=2": lambda: step(ahead.sample()),
            }
            warm_up(loops)
            per_step = interleaved_rounds(loops, sizes.rounds, sizes.steps)
        alone = per_step["step alone"]
        out[f"{label}: step alone s"] = alone
        for name in ("prefetch=0", "prefetch=2"):
            out[f"{label}: {name} step s"] = per_step[name]
            out[f"{label}: {name} sampling adds x step time"] = per_step[name] / alone - 1
    return out


def bench_device_working_set(
    workdir: str, quick: bool, device: str | torch.device, sizes: Sizes | None = None
) -> dict[str, Any]:
    """WorkingSetSampler with its set as device tensors (a tenth of each store, refilled in the background) against
    HerSampler to the device: transitions/s and host->device bytes per batch."""
    dev, sizes = torch.device(device), sizes or (QUICK if quick else FULL)
    out: dict[str, Any] = {}
    for label, path, batch in _stores(workdir, sizes):
        with EpisodeStore.open(path) as store:
            row_bytes = sum(spec.row_nbytes for spec in store.layout.arrays)
            rows = min(store.num_transitions + store.num_episodes, max(store.num_transitions // 10, 8 * (EP_LEN + 1)))
            kw = dict(reward_fn=fetch_reward, seed=2, device=dev)
            with HerSampler(store, batch, **kw) as her, WorkingSetSampler(store, rows * row_bytes, batch, **kw) as ws:
                her.to_device = counters_her = CountingTransfer(her.to_device)
                ws.to_device = counters_ws = CountingTransfer(ws.to_device)
                counters = {"her_sampler": counters_her, "working set": counters_ws}
                fns = {"her_sampler": her.sample, "working set": ws.sample}
                loaded, t = ws.loaded_transitions, time.perf_counter()
                figures = _sampling_figures(dev, batch, fns, sizes)
                wall = time.perf_counter() - t
                out[f"{label}: working set bytes on the device"] = ws.nbytes
                for name, f in fns.items():
                    out[f"{label}: {name} transitions/s"] = figures[f"{name} transitions/s"]
                    before = counters[name].nbytes
                    f()
                    synchronize(dev)
                    out[f"{label}: {name} host->device bytes per batch"] = counters[name].nbytes - before
                out[f"{label}: working set / her_sampler"] = (
                    figures["working set transitions/s"] / figures["her_sampler transitions/s"]
                )
                out[f"{label}: refill transitions loaded/s while sampling"] = (ws.loaded_transitions - loaded) / wall
    return out


# the device figures, in the order they run (copy first: the others are measured against its bandwidth)
DEVICE_BENCHES: dict[str, Callable[..., dict[str, Any]]] = {
    "device_copy": bench_device_copy,
    "device_fetch": bench_device_fetch,
    "device_images": bench_device_images,
    "device_prefetch": bench_device_prefetch,
    "device_working_set": bench_device_working_set,
}

