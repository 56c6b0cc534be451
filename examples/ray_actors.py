"""Many actors, one dataset: N Ray actors each write a shard while a learner samples every shard, on a Ray cluster.

Each actor runs a random policy in her_store's PointGoal env and appends its episodes to its own shard of one
sharded dataset (``open_store(root, obs_space, action_space, shard="actor-3")``): no actor waits for another, and
no file is written by two of them. The learner, in the driver, opens the dataset's read view (``open_dataset(root)``)
and draws HER batches uniformly from every committed transition of every shard, following the actors' commits as
they come. With ``--address`` the actors run on an existing cluster's nodes; then ``--root`` must be a place every
node reaches (``s3://bucket/run`` with ``--storage-options '{"profile": "..."}'``, say). By default a local Ray
cluster is started and the dataset goes to a temporary directory.

    pip install her_store[ray]
    python examples/ray_actors.py [--actors 4] [--seconds 15] [--root PATH_OR_URL] [--address auto]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import gymnasium as gym
import numpy as np

try:
    import ray
except ImportError as e:
    raise SystemExit("this example needs Ray: pip install her_store[ray]") from e

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # runs from a checkout, too

from her_store import MixtureSampler, open_dataset, open_store
from her_store.cli.main import collect
from her_store.envs import ENV_ID
from her_store.errors import NotAStoreError

ROUND_STEPS = 500  # env steps between two looks at the clock (ten PointGoal episodes)


@ray.remote
class Actor:
    """Collects random-policy episodes into shard ``shard`` of the dataset at ``root``."""

    def __init__(self, root: str, shard: str, storage_options: dict[str, Any] | None, seed: int) -> None:
        import her_store.envs  # noqa: F401  (registers PointGoal in this worker)

        env = gym.make(ENV_ID)
        self.store = open_store(
            root, env.observation_space, env.action_space, shard=shard, storage_options=storage_options,
            metadata={"env_id": ENV_ID, "algorithm_name": "random policy"},
        )
        self.seed = seed

    def run(self, seconds: float) -> int:
        """Collect for ``seconds`` (whole rounds of episodes), commit, and return the shard's episodes."""
        deadline, rounds = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            collect(self.store, ENV_ID, 1, ROUND_STEPS, seed=self.seed + 1000 * rounds, progress=False)
            rounds += 1
        episodes = self.store.end_episode  # commits what is staged
        self.store.close()
        return episodes


def _running(pending: list) -> list:
    """The actor calls of ``pending`` still running; an actor's error is raised here."""
    done, running = ray.wait(pending, num_returns=len(pending), timeout=0)
    ray.get(done)
    return running


def learn(root: str, storage_options: dict[str, Any] | None, pending: list, batch_size: int) -> dict[str, Any]:
    """Sample batches from every shard while the actors write (until ``pending`` are done, and every shard holding
    an episode has been drawn from); what was drawn."""
    env = gym.make(ENV_ID)
    while True:
        try:
            view = open_dataset(root, storage_options=storage_options)
            break
        except NotAStoreError:  # no actor has created the dataset yet
            _running(pending)
            time.sleep(0.1)
    with view:
        sampler = MixtureSampler(
            view, weights="transitions", batch_size=batch_size, reward_fn=env.unwrapped.compute_reward, seed=0,
            refresh_interval=0.5,
        )
        while not sampler.refresh().sum():  # until some actor has committed an episode
            _running(pending)
            time.sleep(0.1)
        t0, batches, per_shard = time.perf_counter(), 0, np.zeros(0, np.int64)
        while pending or not _drew_every_shard(view, per_shard):
            batch = sampler.sample()
            counts = np.bincount(batch.source.numpy(), minlength=len(view.shards))
            per_shard = np.pad(per_shard, (0, len(counts) - len(per_shard))) + counts
            batches += 1
            pending = _running(pending)
        spent = time.perf_counter() - t0
        sampler.close()
        return {
            "batches": batches,
            "transitions/s": batches * batch_size / spent,
            "sampled": dict(zip(view.shards, per_shard.tolist())),
        }


def _drew_every_shard(view: Any, per_shard: np.ndarray) -> bool:
    """Whether every shard of the view that holds an episode has been drawn from."""
    view.refresh()
    held = np.array([s.num_episodes > 0 for s in view.stores], bool)
    drawn = np.pad(per_shard, (0, len(held) - len(per_shard))) > 0
    return bool((drawn | ~held).all())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--actors", type=int, default=4, help="Ray actors, each writing its own shard")
    p.add_argument("--seconds", type=float, default=15.0, help="how long the actors collect")
    p.add_argument("--root", help="the dataset's root: a directory or an fsspec URL (default: a temporary directory)")
    p.add_argument("--storage-options", type=json.loads, default=None, help="fsspec options of --root, as JSON")
    p.add_argument("--address", help="an existing Ray cluster ('auto', 'ray://host:10001'); default: start one here")
    p.add_argument("--batch-size", type=int, default=256)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or os.path.join(tmp, "dataset")
        if args.address is None:
            # a local cluster: its workers import her_store from where this script found it
            paths = [REPO, os.environ.get("PYTHONPATH", "")]
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
            ray.init(num_cpus=max(os.cpu_count() or 1, args.actors), include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=args.address)
        try:
            t0 = time.perf_counter()
            actors = [
                Actor.remote(root, f"actor-{k}", args.storage_options, seed=10_000 * k) for k in range(args.actors)
            ]
            pending = [a.run.remote(args.seconds) for a in actors]
            seen = learn(root, args.storage_options, list(pending), args.batch_size)
            episodes = dict(zip((f"actor-{k}" for k in range(args.actors)), ray.get(pending)))
            spent = time.perf_counter() - t0
        finally:
            ray.shutdown()
        with open_dataset(root, storage_options=args.storage_options) as view:
            final = dict(zip(view.shards, (s.num_episodes for s in view.stores)))
            if final != episodes:
                raise RuntimeError(f"the dataset holds {final} episodes per shard; the actors wrote {episodes}")
            print(f"{args.actors} actors wrote {view.num_episodes:,} episodes ({view.num_transitions:,} transitions) "
                  f"in {spent:.1f} s: {final}")
        print(f"the learner sampled {seen['batches']:,} batches of {args.batch_size} "
              f"({seen['transitions/s']:,.0f} transitions/s) while they wrote; rows per shard {seen['sampled']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
