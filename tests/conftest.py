"""Shared fixtures: goal-env spaces, episode generators, a real S3 protocol server (moto) on loopback."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time
import traceback
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import HealthCheck, settings

from her_store import EpisodeStore, _kernels

GOAL_KEYS = ("observation", "achieved_goal", "desired_goal")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
DATA = os.path.join(ROOT, "tests", "data")  # stores made by earlier format versions (tests/data/make_old_store.py)

# Property tests have no wall-clock limit per example or on generating them: on a loaded machine a slow example is
# not a failing one.
settings.register_profile("her_store", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("her_store")


# what only the compiled kernels do (her_store._kernels.pure says why the pure twins cannot)
requires_compiled = pytest.mark.skipif(
    not _kernels.COMPILED,
    reason="the compiled kernels' behaviour (her_store._kernels._frames not built, or HER_STORE_PURE=1)",
)


@pytest.fixture(scope="session", autouse=True)
def _sb3_log_dir(tmp_path_factory):
    """stable-baselines3 makes a log directory for every model it configures (the system's temp directory
    otherwise): keep them in the run's own temporary tree."""
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3-logs"))
    yield
    os.environ.pop("SB3_LOGDIR", None)


def fetch_spaces(obs_dim: int = 10, goal_dim: int = 3, action_dim: int = 4) -> tuple[spaces.Dict, spaces.Box]:
    """FetchReach-shaped spaces (observation 10, goals 3, action 4, float32)."""
    obs = spaces.Dict(
        {
            "observation": spaces.Box(-np.inf, np.inf, (obs_dim,), np.float32),
            "achieved_goal": spaces.Box(-np.inf, np.inf, (goal_dim,), np.float32),
            "desired_goal": spaces.Box(-np.inf, np.inf, (goal_dim,), np.float32),
        }
    )
    return obs, spaces.Box(-1.0, 1.0, (action_dim,), np.float32)


def random_rows(space: spaces.Space, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random values of a space, vectorised."""
    if isinstance(space, spaces.Box):
        if np.issubdtype(space.dtype, np.floating):
            return rng.standard_normal((n, *space.shape)).astype(space.dtype)
        return rng.integers(space.low, space.high, (n, *space.shape), endpoint=True).astype(space.dtype)
    if isinstance(space, spaces.Discrete):
        return rng.integers(space.start, space.start + space.n, n).astype(np.int64)
    if isinstance(space, spaces.MultiBinary):
        return rng.integers(0, 2, (n, *space.shape)).astype(space.dtype)
    if isinstance(space, spaces.MultiDiscrete):
        return (space.start + rng.integers(0, space.nvec, (n, *space.shape))).astype(space.dtype)
    raise TypeError(space)


def make_episode(
    obs_space: spaces.Dict,
    action_space: spaces.Space,
    T: int,
    seed: int,
    info_keys: tuple[str, ...] = (),
    terminated: bool = False,
) -> dict[str, np.ndarray]:
    """A random episode in the store's episode shape; the same seed gives the same episode."""
    rng = np.random.default_rng(seed)
    ep = {k: random_rows(s, T + 1, rng) for k, s in obs_space.spaces.items()}
    ep["action"] = random_rows(action_space, T, rng)
    ep["reward"] = rng.standard_normal(T).astype(np.float32)
    ep["terminated"] = np.zeros(T, bool)
    ep["truncated"] = np.zeros(T, bool)
    (ep["terminated"] if terminated else ep["truncated"])[-1] = True
    for k in info_keys:
        ep[k] = (rng.random(T) > 0.5).astype(np.float32)
    return ep


def assert_episode_equal(got, want) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"field {k}")
        assert np.asarray(got[k]).dtype == np.asarray(want[k]).dtype or k in ("reward",), k


def until_stopped(proc: subprocess.Popen, patience_s: float = 300.0) -> None:
    """Until the child ``proc`` has stopped itself (SIGSTOP, at a point a test chose for a kill); the test fails if
    it ended instead, or after ``patience_s`` (only a hang takes that long)."""
    deadline = time.monotonic() + patience_s
    while not (found := os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG))[0]:
        assert time.monotonic() < deadline, f"pid {proc.pid} did not stop in {patience_s:g} s"
        time.sleep(0.05)
    if not os.WIFSTOPPED(found[1]):
        out = proc.stdout.read() if proc.stdout is not None else ""
        raise AssertionError(f"pid {proc.pid} ended (wait status {found[1]}) instead of stopping: {out}")


def in_forked_child(check: Callable[[], bool], patience_s: int = 60) -> int:
    """Run ``check`` in a child made by ``os.fork()``: its exit status, 0 when ``check`` returned True, 1 when it
    returned False, 2 when it raised (the error printed), or the status of a child the alarm ended (a hang)."""
    pid = os.fork()
    if pid == 0:
        code = 2
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(patience_s)
            code = 0 if check() else 1
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    status = os.waitpid(pid, 0)[1]
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else status


@pytest.fixture
def fetch():
    return fetch_spaces()


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto's S3 server on loopback, in its own process (tools/s3_server.py), for the whole session."""
    pytest.importorskip("s3fs", reason="pip install her_store[s3]")
    pytest.importorskip("moto.server", reason="pip install moto[server]")
    from tools.s3_server import moto_server

    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(autouse=True)
def _close_dropped_sessions(request):
    """After a test that reached S3: the HTTP sessions of the s3fs instances it dropped are closed now, not while a
    later test runs (their notices went into a command's stderr there)."""
    yield
    if "s3_endpoint" in request.fixturenames:
        gc.collect()


@pytest.fixture
def s3_url(s3_endpoint):
    """A fresh bucket on the loopback server; yields (url, storage_options)."""
    import s3fs

    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}, "key": "testing", "secret": "testing"}
    fs = s3fs.S3FileSystem(**opts)
    bucket = f"b{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    yield f"s3://{bucket}/store", opts


class FailingTask:
    """An encoding task (``_kernels.encode_lz4_start``) whose wait() joins its threads, then fails as one whose thread
    ran out of memory."""

    def __init__(self, task) -> None:
        self.task = task

    def wait(self):
        self.task.wait()
        raise MemoryError("no memory for the encoded rows")


def remote_handle_forks(url: str, storage_options: dict | None) -> None:
    """A read handle and a sampler of the store at ``url``, made and used here, then used in forked children: each
    reads what the parent reads (fsspec's filesystems and their sessions belong to the parent's event loops, which a
    child does not have)."""
    from her_store import HerSampler

    def reward(a, d, infos):
        return -(np.linalg.norm(a - d, axis=-1) > 0.05).astype(np.float32)

    with EpisodeStore.open(url, storage_options=storage_options) as store:
        first = store.episode(store.first_episode)
        with HerSampler(store, 16, reward_fn=reward, seed=0) as sampler:
            sampler.sample()
            state = sampler.state_dict()
            want = sampler.sample()
            sampler.load_state_dict(state)

            def same_batch() -> bool:
                got = sampler.sample()
                return bool((got.episode_ids == want.episode_ids).all() and (got.actions == want.actions).all())

            def new_sampler() -> bool:
                with HerSampler(store, 16, reward_fn=reward, seed=1) as fresh:
                    return fresh.sample().actions.shape == (16, *store.action_space.shape)

            checks = {
                "refresh": lambda: store.refresh() == 0,
                "episode": lambda: all((store.episode(store.first_episode)[k] == v).all() for k, v in first.items()),
                "the parent's sampler": same_batch,
                "a new sampler": new_sampler,
            }
            for what, check in checks.items():
                assert in_forked_child(check) == 0, f"{url}: {what} in a forked child"
            assert (sampler.sample().episode_ids == want.episode_ids).all()  # and the parent's reads go on
