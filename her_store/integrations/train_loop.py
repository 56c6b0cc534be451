"""Training a run: the model built or resumed from its checkpoint, ``learn()`` with checkpoints, then its evaluation.

Running the same command again resumes: the model of the last checkpoint (Ctrl-C and SIGTERM write one before the
job exits), every episode the store committed (even those newer than the checkpoint) and the steps still to go.
Training starts once ``learning_starts`` steps are done and an episode has ended (HER samples whole committed
episodes); the default ``learning_starts`` covers one episode of every env when the env's spec gives its
``max_episode_steps``.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from her_store.integrations.train_config import (
    ALGO_DEFAULTS,
    OFF_POLICY_ALGOS,
    TrainConfig,
    algo_class,
    check_device,
    check_numbers,
)
from her_store.integrations.train_env import EnvFacts, env_factory
from her_store.integrations.train_errors import Terminated, doing
from her_store.integrations.train_eval import evaluate_with_rule
from her_store.integrations.train_report import TrainResult, bytes_on_disk, dataset_card, memory, store_contents
from her_store.integrations.train_run_dir import (
    check_run_dir,
    checkpoint,
    final_checkpoint,
    latest_checkpoint,
    unmaker,
)

__all__ = ["train"]


def _checkpoint_callback(cfg: TrainConfig, has_episodes: bool) -> Any:
    """Checkpoints every ``cfg.checkpoint_every`` steps; and no training before an episode has ended (HER samples
    committed episodes only), whatever ``learning_starts`` says: an env without a known episode limit may run
    longer episodes than ``learning_starts`` steps."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Checkpoints(BaseCallback):
        def __init__(self) -> None:
            super().__init__()
            self.last = 0
            self.ended = False

        def _on_training_start(self) -> None:
            self.last = self.num_timesteps
            self.ended = has_episodes

        def _on_step(self) -> bool:
            self.ended = self.ended or bool(np.any(self.locals["dones"]))
            if self.num_timesteps - self.last >= cfg.checkpoint_every:
                checkpoint(self.model, cfg)
                self.last = self.num_timesteps
            return True

        def _on_rollout_end(self) -> None:
            if not self.ended:  # called before the algorithm decides whether to train
                self.model.learning_starts = max(self.model.learning_starts, self.num_timesteps)

    return Checkpoints()


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes; return what it reached.

    The store records ``is_success`` when the env's infos carry it (a store that exists keeps its own info keys),
    and a new store's dataset card names the env, the algorithm and the versions of the code that trained it. A
    first attempt that fails before its first checkpoint removes what it made: the run directory, the store, the
    parent directories they needed (never anything that was there before).

    Parameters
    ----------
    cfg : TrainConfig
        The run.
    log : callable
        Where the job's messages go (one line each).

    Raises
    ------
    ValueError
        An option the job cannot use (an unknown or non-goal env, an on-policy algorithm, a run directory that
        holds another run, ...), named in the message.
    StoreError
        The store cannot be used (another writer holds it, its spaces are not the env's, ...).

    Examples
    --------
    >>> result = train(TrainConfig(out="runs/bits"))  # doctest: +SKIP
    >>> print(f"{result.success_rate:.0%}")  # doctest: +SKIP
    100%
    """
    t0 = time.perf_counter()
    check_numbers(cfg)
    algo_cls = algo_class(cfg.algo)
    env_facts = env_factory(cfg.env, cfg.algo, cfg.seed)
    from torch import set_num_threads

    check_device(cfg.device)
    if cfg.threads:
        set_num_threads(cfg.threads)
    record = os.path.join(cfg.out, "run.json")
    first = not os.path.exists(record)
    unmake_out = unmaker(cfg.out)
    unmake_store = unmaker(cfg.store_location, cfg.storage_options)
    check_run_dir(cfg)
    store_is_new = False
    try:
        with doing(f"reading the store {cfg.store_location}"):
            before = store_contents(cfg)
        store_is_new = before is None
        return _train(cfg, log, algo_cls, env_facts, before, t0)
    except BaseException:
        if first and not os.path.exists(record):  # no run was recorded: this attempt leaves nothing it made
            if store_is_new:
                unmake_store()
            unmake_out()
        raise


def _train(
    cfg: TrainConfig, log: Callable[[str], None], algo_cls: type, env_facts: EnvFacts,
    before: tuple[int, int, str, tuple[str, ...]] | None, t0: float,
) -> TrainResult:
    """:func:`train` once the options are checked, the run directory made and the store's contents read."""
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import DummyVecEnv

    from her_store.integrations.sb3 import ZarrHerReplayBuffer

    if cfg.store_location.startswith("memory://"):
        log(f"note: --store {cfg.store_location} is held in this process's memory: it does not outlive the run, "
            "so a resumed run starts with an empty store")
    ckpt = latest_checkpoint(cfg.out)
    env = DummyVecEnv([env_facts.make] * cfg.n_envs)
    resumed_from = None
    if ckpt is not None:
        with doing(f"loading the checkpoint {ckpt[1]}"):
            model = algo_cls.load(os.path.join(ckpt[1], "model.zip"), env=env, device=cfg.device)
            # load() built a buffer on the store from the saved kwargs; the checkpoint's handle replaces it (sampler
            # state, unfinished episodes), and it must release the store's writer lock first
            model.replay_buffer.close()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.load_replay_buffer(os.path.join(ckpt[1], "replay_buffer.pkl"))
        for w in caught:  # what became of the checkpoint's unfinished episodes: a line each, not a warning dump
            log(f"note: {str(w.message).splitlines()[0]}")
        resumed_from = model.num_timesteps
        model.set_random_seed(cfg.seed + model.num_timesteps)
        episodes = 0 if before is None else before[0]
        log(f"resuming from step {model.num_timesteps:,}, {episodes:,} episodes in the store")
        if episodes == 0:  # the store was removed or replaced: collect learning_starts steps again before training
            model.learning_starts += model.num_timesteps
            log(f"the store is empty: training starts again after {model.learning_starts:,} steps")
    else:
        if before is not None and before[0]:
            log(f"starting at step 0 (no checkpoint yet); the store already holds {before[0]:,} episodes, kept")
        kwargs = {**ALGO_DEFAULTS[cfg.algo.lower()], **cfg.algo_kwargs}
        if env_facts.max_episode_steps and "learning_starts" not in cfg.algo_kwargs:
            # HER samples whole committed episodes: let every env finish one before training starts
            kwargs["learning_starts"] = max(kwargs["learning_starts"], cfg.n_envs * env_facts.max_episode_steps)
        # infos stored: is_success when the env reports it (success figures of inspect and plot); a store that
        # exists keeps its own info keys
        info_keys = list(before[3]) if before is not None else ["is_success"] if env_facts.reports_success else []
        with doing(f"building the {OFF_POLICY_ALGOS[cfg.algo.lower()]} model"):
            model = algo_cls(
                "MultiInputPolicy",
                env,
                buffer_size=cfg.capacity,
                replay_buffer_class=ZarrHerReplayBuffer,
                replay_buffer_kwargs={
                    "path": cfg.store_location,
                    "storage_options": cfg.storage_options,
                    "n_sampled_goal": cfg.n_sampled_goal,
                    "goal_selection_strategy": cfg.strategy,
                    "prioritize": cfg.prioritize,
                    **({"copy_info_dict": True, "info_keys": info_keys} if info_keys else {}),
                },
                seed=cfg.seed,
                device=cfg.device,
                **kwargs,
            )
    # SB3's default logger makes a directory per learn() that nothing writes to; the job's own summary is its log
    model.set_logger(Logger(folder=None, output_formats=[]))
    remaining = cfg.steps - model.num_timesteps
    try:
        if ckpt is None:  # the card's fields the store lacks: a store made before keeps what its card says
            with doing(f"writing the dataset card of {cfg.store_location}"):
                store = model.replay_buffer.store
                card = store.metadata
                store.update_metadata(**{k: v for k, v in dataset_card(cfg, env_facts.spec).items() if k not in card})
        if remaining > 0:
            with doing(f"training from step {model.num_timesteps:,}"):
                model.learn(
                    remaining,
                    callback=_checkpoint_callback(cfg, before is not None and before[0] > 0),
                    reset_num_timesteps=False,
                    progress_bar=cfg.progress,
                )
        else:
            log(f"the run already did {model.num_timesteps:,} of its {cfg.steps:,} steps; evaluating only")
        checkpoint = final_checkpoint(model, cfg)
        with doing("evaluating the policy"):
            success, rule = evaluate_with_rule(model, env_facts.make, cfg.eval_episodes, cfg.seed + 1_000_000)
    except KeyboardInterrupt as e:
        final_checkpoint(model, cfg)
        how = "terminated (SIGTERM)" if isinstance(e, Terminated) else "interrupted"
        log(f"{how} at step {model.num_timesteps:,}; checkpoint saved, run the same command to resume")
        raise
    finally:
        failing = sys.exc_info()[1] is not None
        try:
            with doing(f"committing to the store {cfg.store_location}"):
                model.replay_buffer.close()  # commits what is staged and releases the store's writer lock
        except Exception:
            if not failing:  # else the error that stopped the run is the one to report
                raise
        finally:
            env.close()
    train_success = float(np.mean(model.ep_success_buffer)) if len(model.ep_success_buffer) else None
    episodes, transitions, url, _ = store_contents(cfg) or (0, 0, cfg.store_location, ())
    rss, peak = memory()
    return TrainResult(
        steps=model.num_timesteps,
        resumed_from=resumed_from,
        success_rate=success,
        success_rule=rule,
        train_success_rate=train_success,
        episodes=episodes,
        transitions=transitions,
        store_bytes=bytes_on_disk(cfg),
        rss_bytes=rss,
        peak_rss_bytes=peak,
        seconds=time.perf_counter() - t0,
        store=url,
        checkpoint=checkpoint,
    )
