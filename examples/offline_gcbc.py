"""Offline goal-conditioned behaviour cloning from a her_store dataset, with OGBench-style hindsight goals.

The dataset is opened where ``--store`` points when a store is there (one written by ``her-store demo`` or
``her-store import`` from a PointGoal dataset, say); otherwise random-policy episodes of PointGoal are collected
into it (by default into a temporary directory). A small MLP policy ``pi(observation, goal) -> action`` is then
trained offline on batches of :class:`~her_store.HerSampler` whose goals come from
``GoalMixture(0, 1, 0, discount)``: every transition is relabelled with the achieved goal of a state its episode
reached later (OGBench's GCBC actor goals), so the action taken is a good action towards that goal. Last, the
policy and a random policy are run in the env and their success rates printed (an episode succeeds when it
reaches its goal at some step, OGBench's convention).

    python examples/offline_gcbc.py [--store PATH] [--collect-steps N] [--steps N] [--eval-episodes N] [--seed S]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # runs from a checkout, too

from her_store import EpisodeStore, GoalMixture, HerSampler
from her_store.cli.main import collect
from her_store.envs import ENV_ID


def dataset(path: Path, env_id: str, collect_steps: int, n_envs: int, seed: int) -> EpisodeStore:
    """The store at ``path``, opened read-only; collected first with a random policy if there is none."""
    if not path.exists():
        env = gym.make(env_id)
        metadata = {"env_id": env_id, "algorithm_name": "random policy", "description": "offline GCBC example"}
        with EpisodeStore.create(path, env.observation_space, env.action_space, metadata=metadata) as store:
            collect(store, env_id, n_envs, max(1, collect_steps // n_envs), seed=seed, progress=False)
    return EpisodeStore.open(path)


def policy_net(obs_dim: int, goal_dim: int, action_dim: int, hidden: int) -> nn.Module:
    """MLP ``(observation, desired goal) -> action in [-1, 1]``."""
    return nn.Sequential(
        nn.Linear(obs_dim + goal_dim, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, action_dim), nn.Tanh(),
    )


def train(store: EpisodeStore, env: gym.Env, args: argparse.Namespace) -> nn.Module:
    """Goal-conditioned behaviour cloning: regress the stored action on (observation, hindsight goal)."""
    obs_space, act_space = store.schema.observation_space, store.schema.action_space
    net = policy_net(obs_space["observation"].shape[0], obs_space["desired_goal"].shape[0], act_space.shape[0],
                     args.hidden)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    goals = GoalMixture(0.0, 1.0, 0.0, discount=args.discount)  # every goal: a state reached later in the episode
    t0, losses = time.perf_counter(), []
    with HerSampler(store, args.batch_size, goal_selection_strategy=goals, reward_fn=env.unwrapped.compute_reward,
                    seed=args.seed, prefetch=2) as sampler:
        for _ in range(args.steps):
            b = sampler.sample()
            x = torch.cat([b.observations["observation"], b.observations["desired_goal"]], dim=1)
            loss = ((net(x) - b.actions) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    print(f"trained GCBC for {args.steps} steps (batch {args.batch_size}) in {time.perf_counter() - t0:.1f} s; "
          f"loss {np.mean(losses[:10]):.4f} -> {np.mean(losses[-10:]):.4f}")
    return net


def success_rate(env_id: str, act: Callable[[dict[str, np.ndarray]], np.ndarray], episodes: int, seed: int) -> float:
    """Share of ``episodes`` (run side by side) in which the policy reaches its goal at some step."""
    envs = [gym.make(env_id) for _ in range(episodes)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    running, reached = np.ones(episodes, bool), np.zeros(episodes, bool)
    while running.any():
        live = np.flatnonzero(running)
        actions = act({k: np.stack([obs[i][k] for i in live]) for k in obs[0]})
        for i, a in zip(live, actions):
            obs[i], _, terminated, truncated, info = envs[i].step(a)
            reached[i] |= bool(info.get("is_success", 0.0))
            running[i] = not (terminated or truncated)
    return float(reached.mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--store", type=Path, help="dataset store: opened if present, else collected into (default: temp)")
    p.add_argument("--env", default=ENV_ID, help=f"goal env to collect from and evaluate in (default: {ENV_ID})")
    p.add_argument("--collect-steps", type=int, default=50_000, help="env steps of random-policy data to collect")
    p.add_argument("--n-envs", type=int, default=8, help="envs collected from side by side")
    p.add_argument("--steps", type=int, default=3000, help="gradient steps")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256, help="width of the policy's two hidden layers")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--discount", type=float, default=0.99,
                   help="future goals k ~ Geometric(1 - discount) steps ahead (OGBench's geometric sampling)")
    p.add_argument("--eval-episodes", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # a small MLP gains nothing from more, and threads that spin stall on a busy machine
    with tempfile.TemporaryDirectory() as tmp:
        path = args.store if args.store is not None else Path(tmp) / "dataset"
        with dataset(path, args.env, args.collect_steps, args.n_envs, args.seed) as store:
            env_id = store.metadata.get("env_id") or args.env
            print(f"dataset: {store.num_episodes:,} episodes, {store.num_transitions:,} transitions of {env_id}")
            env = gym.make(env_id)
            net = train(store, env, args)
    eval_seed = args.seed + 1_000_000  # goals the dataset's episodes never had
    space = env.action_space
    space.seed(args.seed)
    random_rate = success_rate(env_id, lambda o: np.stack([space.sample() for _ in o["desired_goal"]]),
                               args.eval_episodes, eval_seed)

    @torch.no_grad()
    def gcbc(o: dict[str, np.ndarray]) -> np.ndarray:
        return net(torch.from_numpy(np.concatenate([o["observation"], o["desired_goal"]], axis=1))).numpy()

    gcbc_rate = success_rate(env_id, gcbc, args.eval_episodes, eval_seed)
    print(f"random policy success rate: {100 * random_rate:.1f}% ({args.eval_episodes} episodes)")
    print(f"GCBC policy success rate: {100 * gcbc_rate:.1f}% ({args.eval_episodes} episodes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
