"""Batches on a device: the same bits as the CPU's batches for every goal strategy, from HerSampler (pinned, pageable,
prefetched), the working set and the mixture; pinned host buffers reused, not leaked; the device figures of
tools/bench.py.

The device is a parameter. "cuda" runs where torch sees a GPU. "cpu" runs everywhere, as each check's counterpart on
the CPU: the same samplers with pinned and pageable copies and prefetch, a working set gathering with index_select
(the path a CUDA set takes), all against a CPU sampler of the same seed and the store's own rows."""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch
from gymnasium import spaces

from her_store import EpisodeStore, GoalMixture, HerSampler
from her_store.sampling.batch import HerBatch
from her_store.sampling.mixture import MixtureSampler
from her_store.sampling.working_set import WorkingSetSampler
from tests.conftest import ROOT, fetch_spaces
from tests.sampling.test_sampler import coded_episode, sparse_reward

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.cuda.is_available() is False")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=CUDA, id="cuda")]


def two_ahead(ctx) -> np.ndarray:
    """A callable strategy: the goal reached two steps later, read through the sampler's own gather."""
    return ctx.achieved_goals(ctx.episode_ids, np.minimum(ctx.steps + 2, ctx.lengths - 1))


STRATEGIES = {
    "future": "future",
    "final": "final",
    "episode": "episode",
    "random": "random",
    "goal-mixture": GoalMixture(0.2, 0.5, 0.3, discount=0.9),
    "callable": two_ahead,
}
OBS, ACT = fetch_spaces()
IMG_OBS = spaces.Dict({**OBS.spaces, "observation": spaces.Box(0, 255, (3, 16, 16), np.uint8)})  # LZ4 frames


def make_store(path, obs: spaces.Dict, ids: range) -> tuple[EpisodeStore, list[dict]]:
    """A store of coded episodes (achieved_goal row r of episode e is (e, r, 0)) of lengths 3..13, by id."""
    eps = [coded_episode(obs, ACT, i, T=3 + (i * 7) % 11, seed=i) for i in ids]
    with EpisodeStore.create(path, obs, ACT, chunk_rows=64) as store:
        for ep in eps:
            store.append_episode(ep)
    return EpisodeStore.open(path), eps


@pytest.fixture(params=["fetch", "images"])
def coded(request, tmp_path):
    """FetchReach-shaped or 3x16x16 uint8 image observations: 60 coded episodes."""
    store, eps = make_store(tmp_path / "s", OBS if request.param == "fetch" else IMG_OBS, range(60))
    yield store, eps
    store.close()


def set_budget(store: EpisodeStore, rows: int) -> int:
    """Bytes of ``rows`` rows of every array of the store (a working set's budget)."""
    return rows * sum(spec.row_nbytes for spec in store.layout.arrays)


def assert_rows_are_the_stores(b: HerBatch, episodes: list[dict]) -> None:
    """Row i of the batch is row ``steps[i]`` of ``episodes[i]``; a relabelled row has one goal in both observations
    and its reward recomputed for it, the others keep the stored goal and reward."""
    b = batch_on_cpu(b)
    t = b.steps.numpy()

    def at(key, d=0):
        return np.stack([ep[key][k + d] for ep, k in zip(episodes, t)])

    for k in ("observation", "achieved_goal"):
        np.testing.assert_array_equal(b.observations[k].numpy(), at(k))
        np.testing.assert_array_equal(b.next_observations[k].numpy(), at(k, 1))
    np.testing.assert_array_equal(b.actions.numpy(), at("action"))
    her = b.is_relabeled.numpy()
    goal, next_goal = b.observations["desired_goal"].numpy(), b.next_observations["desired_goal"].numpy()
    np.testing.assert_array_equal(goal[her], next_goal[her])
    np.testing.assert_array_equal(goal[~her], at("desired_goal")[~her])
    want = at("reward")
    want[her] = sparse_reward(b.next_observations["achieved_goal"].numpy()[her], goal[her], None)
    np.testing.assert_array_equal(b.rewards.numpy()[:, 0], want)


def tensors(b: HerBatch) -> dict[str, torch.Tensor]:
    """Every tensor of a batch, by field (observations and infos by key)."""
    out = {}
    for field in HerBatch._fields:
        v = getattr(b, field)
        if isinstance(v, dict):
            out.update({f"{field}.{k}": x for k, x in v.items()})
        elif v is not None:
            out[field] = v
    return out


def batch_on_cpu(b: HerBatch) -> HerBatch:
    return HerBatch(*(
        {k: x.cpu() for k, x in v.items()} if isinstance(v, dict) else None if v is None else v.cpu() for v in b
    ))


def assert_same_batch(got: HerBatch, want: HerBatch, device: str) -> None:
    """Every field of ``got`` is on ``device`` and holds the bits of ``want``'s, in its dtype and shape."""
    g, w = tensors(got), tensors(want)
    assert g.keys() == w.keys()
    for name, x in g.items():
        assert x.device.type == device, (name, x.device)
        assert x.dtype == w[name].dtype and x.shape == w[name].shape, name
        assert torch.equal(x.cpu(), w[name]), f"{name} differs from the CPU batch's"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("device", DEVICES)
def test_device_batches_are_the_cpu_batches(coded, device, strategy):
    """HerSampler on the device, pinned + non_blocking, pageable, and prefetching: bit for bit the batches of a CPU
    sampler of the same seed, which are the store's rows."""
    store, eps = coded
    kw = dict(goal_selection_strategy=STRATEGIES[strategy], reward_fn=sparse_reward, seed=7)
    with (
        HerSampler(store, 256, **kw) as cpu,
        HerSampler(store, 256, device=device, pin_memory=True, **kw) as pinned,
        HerSampler(store, 256, device=device, pin_memory=False, **kw) as pageable,
        HerSampler(store, 256, device=device, prefetch=2, **kw) as ahead,
    ):
        assert pinned.pin_memory and not pageable.pin_memory and ahead.pin_memory == (device == "cuda")
        for _ in range(3):
            want = cpu.sample()
            assert_rows_are_the_stores(want, [eps[i] for i in want.episode_ids.tolist()])
            for sampler in (pinned, pageable, ahead):
                assert_same_batch(sampler.sample(), want, device)


@pytest.mark.parametrize("prioritize", ["energy", "td"])
@pytest.mark.parametrize("device", DEVICES)
def test_prioritized_batches_on_the_device_are_the_cpu_batches(coded, device, prioritize):
    """Prioritized samplers on the device draw the CPU sampler's batches, weights and indices included, and take
    the same updates."""
    store, eps = coded
    kw = dict(reward_fn=sparse_reward, seed=3, prioritize=prioritize, priority_checkpoint=None)
    with HerSampler(store, 128, **kw) as cpu, HerSampler(store, 128, device=device, **kw) as on_device:
        for _ in range(3):
            want = cpu.sample()
            got = on_device.sample()
            assert_same_batch(got, want, device)
            assert (want.weights is None) == (prioritize == "energy")
            if prioritize == "td":
                td = torch.linspace(-2, 2, 128)
                cpu.update_priorities(want.indices, td)
                on_device.update_priorities(got.indices, td.to(device))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_working_set_on_the_device_gives_the_cpu_batches(coded, device, strategy):
    """A working set held on the device, gathered there with index_select (on the CPU: its index_select path, the
    one a CUDA set takes), refilled alike: bit for bit the batches of a CPU set's numpy gather."""
    store, eps = coded
    kw = dict(goal_selection_strategy=STRATEGIES[strategy], reward_fn=sparse_reward, seed=5, background=False,
              refill_fraction=0.25)
    budget = set_budget(store, 200)  # 200 rows of the store's 540
    with WorkingSetSampler(store, budget, 128, **kw) as host, WorkingSetSampler(
        store, budget, 128, device=device, **kw
    ) as dev:
        dev.set_rows.numpy_gather = False
        assert host.set_rows.numpy_gather
        assert all(buf.device.type == device for buf in dev.set_rows.buffers.values())
        for _ in range(4):
            want = host.sample()
            assert_rows_are_the_stores(want, [eps[i] for i in want.episode_ids.tolist()])
            assert_same_batch(dev.sample(), want, device)
            host.refill()
            dev.refill()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("device", DEVICES)
def test_a_mixture_on_the_device_gives_the_cpu_batches(tmp_path, device, strategy):
    """A mixture of two stores on the device, pinned and pageable: bit for bit the CPU mixture's batches, each row
    its own store's."""
    a, eps_a = make_store(tmp_path / "a", OBS, range(30))
    b, eps_b = make_store(tmp_path / "b", OBS, range(30, 60))
    stores, eps = [a, b], [eps_a, eps_b]
    kw = dict(goal_selection_strategy=STRATEGIES[strategy], reward_fn=sparse_reward, seed=3)
    with (
        MixtureSampler(stores, [1, 2], 192, **kw) as cpu,
        MixtureSampler(stores, [1, 2], 192, device=device, pin_memory=True, **kw) as pinned,
        MixtureSampler(stores, [1, 2], 192, device=device, pin_memory=False, **kw) as pageable,
    ):
        for _ in range(3):
            want = cpu.sample()
            rows = [eps[s][i] for s, i in zip(want.source.tolist(), want.episode_ids.tolist())]
            assert_rows_are_the_stores(want, rows)
            assert set(want.source.tolist()) == {0, 1}
            for m in (pinned, pageable):
                assert_same_batch(m.sample(), want, device)
    a.close()
    b.close()


def _samplers(store: EpisodeStore) -> dict[str, object]:
    """A HerSampler and a working set on CUDA, batch 256."""
    kw = dict(reward_fn=sparse_reward, seed=1, device="cuda")
    return {
        "her_sampler": HerSampler(store, 256, **kw),
        "working set": WorkingSetSampler(store, set_budget(store, 200), 256, **kw),
    }


def _flat_over_batches(sampler, measure, batches: int = 1_000) -> tuple[dict, dict, int]:
    """``measure()`` after 50 batches (the allocators' caches warm) and after ``batches`` more, each with nothing
    left of the batches; and one batch's bytes."""
    for _ in range(50):
        sampler.sample()
    torch.cuda.synchronize()
    gc.collect()
    before = measure()
    for _ in range(batches):
        b = sampler.sample()
    nbytes = sum(x.element_size() * x.nelement() for x in tensors(b).values())
    del b
    torch.cuda.synchronize()
    gc.collect()
    return before, measure(), nbytes


@CUDA
def test_device_memory_is_flat_over_1000_batches(coded):
    """Batches dropped leave nothing allocated on the device: the same bytes after 1,000 more (one batch's bytes of
    margin), for HerSampler and for a working set whose rows live there."""
    store, _ = coded
    for name, sampler in _samplers(store).items():
        with sampler:
            before, after, nbytes = _flat_over_batches(sampler, lambda: {"allocated": torch.cuda.memory_allocated()})
        assert after["allocated"] <= before["allocated"] + nbytes, (name, before, after, nbytes)


def _host_stats() -> dict[str, int]:
    """The pinned (host) allocator's blocks created and bytes held, or a skip naming what this torch lacks."""
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    want = ("num_host_alloc", "allocated_bytes.current")
    if not all(k in stats for k in want):
        pytest.skip(f"this torch ({torch.__version__}) has no pinned allocator stats {want}: {sorted(stats)[:20]}")
    return {k: int(stats[k]) for k in want}


@CUDA
def test_pinned_host_buffers_are_reused_not_leaked(coded):
    """torch's pinned allocator hands the staging buffers of one batch to the next: over 1,000 batches of HerSampler
    and of a working set it creates almost no block (a leak would create at least one a batch, some for every field)
    and holds at most twice the bytes it held after 50."""
    store, _ = coded
    for name, sampler in _samplers(store).items():
        with sampler:
            before, after, nbytes = _flat_over_batches(sampler, _host_stats)
        assert after["num_host_alloc"] - before["num_host_alloc"] < 100, (name, before, after)
        assert after["allocated_bytes.current"] <= 2 * before["allocated_bytes.current"] + nbytes, (name, before, after)


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_figures_run(tmp_path, device):
    """Every figure of tools/bench.py --device cuda, on a few small batches: the figures are there and finite; the
    bytes each batch brings to the device are those of its tensors, fewer from a working set on CUDA (observations
    and actions stay there)."""
    from tools.bench_device import DEVICE_BENCHES, Sizes

    tiny = Sizes(fetch=2_000, images=200, rounds=1, calls=2, steps=2, matmul=32, matmuls=1, copy_bytes=1 << 20)
    results = {name: bench(str(tmp_path), True, device, tiny) for name, bench in DEVICE_BENCHES.items()}
    for name, figures in results.items():
        for key, v in figures.items():
            if isinstance(v, (int, float)):
                assert np.isfinite(v), (name, key, v)
    assert results["device_copy"]["pinned host->device bytes/s"] > 0
    for name in ("device_fetch", "device_images"):
        r = results[name]
        assert r["pinned bytes per batch"] == r["pageable bytes per batch"] > 0
        assert r["pinned transitions/s"] > 0 and r["pageable transitions/s"] > 0
        assert r.get("sb3") == "not installed" or r["sb3 bytes per batch"] > 0  # SB3 sampled to the device too
    ws = results["device_working_set"]
    for label, group in (("fetch B=1024", "device_fetch"), ("images B=256", "device_images")):
        her = ws[f"{label}: her_sampler host->device bytes per batch"]
        dev = ws[f"{label}: working set host->device bytes per batch"]
        assert her == results[group]["pinned bytes per batch"]
        if device == "cpu":  # every field gathered on the host, as HerSampler's
            assert dev == her
        else:
            assert 0 < dev < her
        for prefetch in (0, 2):
            assert results["device_prefetch"][f"{label}: prefetch={prefetch} step s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the command runs the figures (tools/gpu_check.sh)")
def test_without_cuda_the_device_figures_say_they_need_a_gpu():
    r = subprocess.run([sys.executable, "tools/bench.py", "--device", "cuda", "--quick"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "CUDA not available: the --device cuda figures need a GPU"
