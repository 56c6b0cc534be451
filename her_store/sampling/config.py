"""The samplers' options: one dataclass (:class:`SamplerConfig`), checked once, shared by every sampler.

HerSampler, WorkingSetSampler, MixtureSampler and the DataLoader dataset all take their shared options from it.

Every option goes through :mod:`her_store.checks` when the config is made, so a sampler never meets
``batch_size=True`` or ``prefetch=2.5``; the defaults that depend on the store (the env's reward function, the refresh
interval) and on the device (pinned memory) are resolved by the parts that use them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from her_store.checks import check_bool, check_callable, check_int, check_number
from her_store.errors import short_repr
from her_store.sampling.batch import DeviceTransfer
from her_store.sampling.committed import CommittedView
from her_store.sampling.relabel import (
    GoalContext,
    GoalMixture,
    GoalSelectionStrategy,
    GoalStrategy,
    her_ratio,
    parse_strategy,
)
from her_store.sampling.rewards import RewardFn, RewardRecompute, env_reward_fn
from her_store.store.episode_store import EpisodeStore
from her_store.store.index import IndexView

__all__ = [
    "PRIORITIZE", "RANKS", "ConfiguredSampler", "SamplerConfig", "check_options", "reward_recompute", "rng_state",
]

PRIORITIZE = ("energy", "td")  # episodes by their index priority; transitions by TD error (PER)
RANKS = ("average", "min", "max", "dense", "ordinal")  # how episode priorities may be ranked (scipy's rankdata's)


@dataclass(frozen=True)
class SamplerConfig:
    """Options of a :class:`~her_store.sampling.sampler.HerSampler`, checked when the config is made.

    The fields are HerSampler's keyword arguments (see it for what each does); a sampler built from a config
    (:meth:`HerSampler.from_config <her_store.sampling.sampler.HerSampler.from_config>`) samples exactly as one
    built from the same keywords. ``goal_selection_strategy`` is kept parsed (a name becomes its
    :class:`~her_store.sampling.relabel.GoalSelectionStrategy`) and ``device`` as a ``torch.device``; numbers are kept
    as Python ints and floats.

    Raises
    ------
    ValueError, TypeError
        An option of the wrong type or out of range, naming it (:class:`~her_store.checks.ArgumentTypeError`,
        both at once, for a wrong type): ``batch_size`` an int >= 1, ``n_sampled_goal``, ``prefetch`` and
        ``cache_bytes`` ints >= 0, ``io_threads`` an int >= 0 or None, ``seed`` an int >= 0 or None,
        ``refresh_interval`` a number of seconds >= 0 or None, the flags True or False (``pin_memory`` or None),
        ``reward_fn`` and ``success_fn`` callables or None; ``prioritize`` None, "energy" or "td", ``alpha``,
        ``beta`` numbers >= 0, ``priority_eps`` and ``temperature`` numbers > 0, ``rank`` one of ``RANKS`` or None,
        ``priority_checkpoint`` seconds >= 0 or None.

    Examples
    --------
    >>> cfg = SamplerConfig(batch_size=np.int64(64), goal_selection_strategy="final")
    >>> cfg.batch_size, cfg.goal_selection_strategy, cfg.her_ratio
    (64, <GoalSelectionStrategy.FINAL: 'final'>, 0.8)
    >>> SamplerConfig(prefetch=-1)
    Traceback (most recent call last):
    ...
    ValueError: prefetch must be an int >= 0: got -1
    """

    batch_size: int = 256
    n_sampled_goal: int = 4
    goal_selection_strategy: GoalStrategy = "future"
    reward_fn: RewardFn | None = None
    device: str | torch.device = "cpu"
    seed: int | None = None
    copy_info_dict: bool = False
    prefetch: int = 0
    pin_memory: bool | None = None
    relabel_terminated: bool = False
    success_fn: RewardFn | None = None
    io_threads: int | None = None
    cache_bytes: int = 32 << 20
    refresh_interval: float | None = None
    prioritize: str | None = None
    alpha: float = 0.6
    beta: float = 0.4
    priority_eps: float = 1e-6
    temperature: float = 1.0
    rank: str | None = None
    priority_checkpoint: float | None = 60.0

    def __post_init__(self) -> None:
        checked: dict[str, Any] = {
            "batch_size": check_int(self.batch_size, "batch_size", low=1),
            "n_sampled_goal": check_int(self.n_sampled_goal, "n_sampled_goal", low=0),
            "goal_selection_strategy": parse_strategy(self.goal_selection_strategy),
            "reward_fn": check_callable(self.reward_fn, "reward_fn", or_none=True),
            "device": _device(self.device),
            "seed": check_int(self.seed, "seed", low=0, or_none=True),
            "copy_info_dict": check_bool(self.copy_info_dict, "copy_info_dict"),
            "prefetch": check_int(self.prefetch, "prefetch", low=0),
            "pin_memory": check_bool(self.pin_memory, "pin_memory", or_none=True),
            "relabel_terminated": check_bool(self.relabel_terminated, "relabel_terminated"),
            "success_fn": check_callable(self.success_fn, "success_fn", or_none=True),
            "io_threads": check_int(self.io_threads, "io_threads", low=0, or_none=True),
            "cache_bytes": check_int(self.cache_bytes, "cache_bytes", low=0),
            "refresh_interval": check_number(self.refresh_interval, "refresh_interval", low=0, or_none=True),
            "prioritize": _choice(self.prioritize, "prioritize", PRIORITIZE),
            "alpha": check_number(self.alpha, "alpha", low=0),
            "beta": check_number(self.beta, "beta", low=0),
            "priority_eps": check_number(self.priority_eps, "priority_eps", low=0, low_open=True),
            "temperature": check_number(self.temperature, "temperature", low=0, low_open=True),
            "rank": _choice(self.rank, "rank", RANKS),
            "priority_checkpoint": check_number(self.priority_checkpoint, "priority_checkpoint", low=0, or_none=True),
        }
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def strategy(self) -> GoalSelectionStrategy | GoalMixture | Callable[[GoalContext], np.ndarray]:
        """The parsed goal selection strategy."""
        return self.goal_selection_strategy  # type: ignore[return-value]  # parsed in __post_init__

    @property
    def her_ratio(self) -> float:
        """The relabelled share of a batch (:func:`~her_store.sampling.relabel.her_ratio`)."""
        return her_ratio(self.strategy, self.n_sampled_goal)

    def replace(self, **changes: Any) -> SamplerConfig:
        """A copy with ``changes``, checked as a new config is."""
        return dataclasses.replace(self, **changes)

    def options(self) -> dict[str, Any]:
        """The options as keyword arguments of HerSampler (or of anything taking them, such as a MixtureSampler),
        ``batch_size`` and ``seed`` left out."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("batch_size", "seed")}


def check_options(options: Mapping[str, Any], allowed: Collection[str]) -> None:
    """Raise TypeError naming the options that are not among ``allowed`` (names of :class:`SamplerConfig`'s fields)."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"HerSampler takes no argument(s) {unknown}; it takes {sorted(allowed)}")


def _choice(value: Any, name: str, allowed: tuple[str, ...]) -> str | None:
    """``value`` if it is None or one of ``allowed``, else a ValueError naming the option."""
    if value is None or (isinstance(value, str) and value in allowed):
        return value
    raise ValueError(f"{name} must be None or one of {list(allowed)}: got {short_repr(value)}")


def _device(device: Any) -> torch.device:
    """``device`` as a torch.device, or a ValueError naming the option."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be a torch.device or its name ('cpu', 'cuda', 'cuda:1'): got {short_repr(device)} ({e})"
        ) from e
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {short_repr(device)}: this torch has no CUDA device to use (a CPU build, or none "
                         "visible); use device='cpu'")
    return d


def reward_recompute(store: EpisodeStore, config: SamplerConfig, info_keys: tuple[str, ...]) -> RewardRecompute:
    """The rewards ``config`` asks a sampler of ``store`` to recompute: with its ``reward_fn``, or the store's env's
    where goals are relabelled and none is given."""
    reward_fn = config.reward_fn
    if reward_fn is None and config.n_sampled_goal > 0:
        reward_fn = env_reward_fn(store)
    return RewardRecompute(
        reward_fn, relabel_terminated=config.relabel_terminated, success_fn=config.success_fn, info_keys=info_keys
    )


def rng_state(state: Any, rng: np.random.Generator) -> dict[str, Any]:
    """The generator state a sampler's ``state_dict()`` saved in ``state["rng"]``, checked against ``rng``'s kind.

    Raises
    ------
    ValueError
        ``state`` is not such a dict.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> rng_state({"rng": rng.bit_generator.state}, rng)["bit_generator"]
    'PCG64'
    """
    saved = state.get("rng") if isinstance(state, Mapping) else None
    kind = rng.bit_generator.state["bit_generator"]
    wrong = not isinstance(saved, Mapping) or saved.get("bit_generator") != kind
    if not wrong:
        try:  # what numpy accepts as a state of that kind, tried on a generator of its own
            type(rng.bit_generator)().state = dict(saved)
        except (TypeError, ValueError, KeyError):
            wrong = True
    if wrong:
        raise ValueError(
            f"not a sampler's state_dict(): expected a dict whose 'rng' is a {kind} state, got {short_repr(state)}"
        )
    return dict(saved)


def _option(name: str) -> property:
    """A read-only attribute of a sampler that is its ``config``'s option ``name`` (as checked and kept there)."""
    return property(lambda sampler: getattr(sampler.config, name), doc=f"The ``{name}`` option (see SamplerConfig).")


class ConfiguredSampler:
    """What every sampler made from a :class:`SamplerConfig` shows of the parts it is composed of: its options
    (read-only), where its batches go, the reward function, and the committed episodes it samples from.

    A sampler sets ``config`` (a SamplerConfig), ``rewards`` (a
    :class:`~her_store.sampling.rewards.RewardRecompute`), ``committed`` (a
    :class:`~her_store.sampling.committed.CommittedView`) and ``to_device`` (a
    :class:`~her_store.sampling.batch.DeviceTransfer`).
    """

    config: SamplerConfig
    rewards: RewardRecompute
    committed: CommittedView
    to_device: DeviceTransfer

    batch_size = _option("batch_size")
    n_sampled_goal = _option("n_sampled_goal")
    strategy = _option("strategy")
    copy_info_dict = _option("copy_info_dict")
    relabel_terminated = _option("relabel_terminated")
    success_fn = _option("success_fn")

    @property
    def device(self) -> torch.device:
        """Where batches go (and a working set lives)."""
        return self.to_device.device

    @property
    def pin_memory(self) -> bool:
        """Whether host tensors are page-locked before their copy to the device."""
        return self.to_device.pin_memory

    @property
    def reward_fn(self) -> RewardFn | None:
        """The reward function relabelled rows are rewarded with (the given one, or the store's env's); may be
        replaced any time."""
        return self.rewards.reward_fn

    @reward_fn.setter
    def reward_fn(self, fn: RewardFn) -> None:
        self.rewards.reward_fn = check_callable(fn, "reward_fn")

    @property
    def refresh_interval(self) -> float:
        """Seconds between looks for new commits by ``sample`` (``math.inf``: only :meth:`refresh`); may be changed
        any time."""
        return self.committed.interval

    @refresh_interval.setter
    def refresh_interval(self, seconds: float) -> None:
        self.committed.interval = float(seconds)

    @property
    def view(self) -> IndexView | None:
        """The committed episodes sampled from, as of the last refresh (None before the first)."""
        return self.committed.view

    def refresh(self, *, reread: bool = True) -> IndexView:
        """Look for new commits now; returns the committed episodes sampled from. ``reread=False`` takes what the
        store's handle already holds (its owner, a sharded dataset's view, has just refreshed it)."""
        return self.committed.refresh(reread=reread)
