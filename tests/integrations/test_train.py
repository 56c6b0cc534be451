"""The training job (her_store.integrations.train, tools/train.py): real SB3 runs on real stores, kill -9 and resume."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib.util import find_spec

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.cli.main import main as cli_main
from her_store.errors import StoreError
from her_store.format.schema import GOAL_KEYS
from her_store.integrations import train as job
from her_store.integrations.train_env import DEFAULT_N_BITS
from her_store.integrations.train_errors import one_line
from her_store.integrations.train_eval import SUCCESS_BY_REWARD, evaluate_with_rule
from her_store.integrations.train_report import bytes_label
from her_store.integrations.train_run_dir import run_record
from tests.conftest import ROOT, until_stopped

# the job trains with SB3 (an optional dependency): a test that runs it that far skips where SB3 is not installed
needs_sb3 = pytest.mark.skipif(find_spec("stable_baselines3") is None, reason='pip install "her_store[train]"')
# DQN training from step 50 on every 4th step: a cheap run for the kill -9 test
FAST = ["--algo-kwargs", '{"learning_starts": 50, "train_freq": 4}', "--quiet"]


def run_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = job.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@needs_sb3
def test_default_run_trains_stores_checkpoints_and_resumes(tmp_path, capsys):
    # the default job (DQN+HER, BitFlippingEnv, its hyperparameters) on a short budget, stopping mid-episode
    out_dir = str(tmp_path / "run")
    code, out, err = run_main(capsys, "--out", out_dir, "--steps", "305", "--eval-episodes", "3", "--quiet")
    assert code == 0, err
    assert "success rate (deterministic)" in out and "episodes stored" in out and "resident memory" in out
    with EpisodeStore.open(os.path.join(out_dir, "store")) as store:
        first = store.num_episodes
        # every finished episode is in the store; only the last one of the single env may be unfinished
        assert store.num_transitions == 305  # the unfinished episode was ended before the last checkpoint
        assert store.episodes["length"].max() <= DEFAULT_N_BITS
        kept = store.episode(store.first_episode)
    assert job.latest_checkpoint(out_dir)[0] == 305
    assert sorted(os.listdir(job.latest_checkpoint(out_dir)[1])) == ["model.zip", "replay_buffer.pkl"]
    with open(os.path.join(out_dir, "run.json")) as f:
        record = json.load(f)
    assert record["algo"] == "dqn" and record["env"] == job.DEFAULT_ENV and record["seed"] == 0

    # a checkpoint write killed half-way is ignored, then cleaned up by the next checkpoint
    leftover = os.path.join(out_dir, "checkpoints", ".step-000000350.tmp-1")
    os.makedirs(leftover)
    # the same command with more steps resumes: the checkpoint's model, the store's episodes, the rest of the steps
    code, out, err = run_main(capsys, "--out", out_dir, "--steps", "400", "--eval-episodes", "2", "--quiet")
    assert code == 0, err
    assert f"resuming from step 305, {first} episodes in the store" in out
    assert "note:" not in out  # the finished run ended its last episode before its last checkpoint
    assert re.search(r"steps\s*│?\s*400 \(resumed from 305\)", out)
    with EpisodeStore.open(os.path.join(out_dir, "store")) as store:
        assert store.num_episodes > first
        again = store.episode(kept.id)
        assert all(np.array_equal(again[k], kept[k]) for k in kept)
    assert job.latest_checkpoint(out_dir)[0] == 400
    assert os.listdir(os.path.join(out_dir, "checkpoints")) == ["step-000000400"]

    # nothing left to do: evaluate only, through the her-store command
    assert cli_main(["train", "--out", out_dir, "--steps", "400", "--eval-episodes", "1", "--quiet"]) == 0
    assert "already did 400 of its 400 steps" in capsys.readouterr().out

    # a store removed under a run: the model resumes, the store starts again, training waits for learning_starts
    shutil.rmtree(os.path.join(out_dir, "store"))
    code, out, err = run_main(capsys, "--out", out_dir, "--steps", "450", "--eval-episodes", "1", "--quiet")
    assert code == 0, err
    assert "resuming from step 400, 0 episodes in the store" in out
    assert "the store is empty: training starts again after 500 steps" in out
    with EpisodeStore.open(os.path.join(out_dir, "store")) as store:
        assert 50 - 10 <= store.num_transitions <= 50


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--env", "NoSuchEnv-v9"], "--env NoSuchEnv-v9: ", marks=needs_sb3),
        pytest.param(["--env", "CartPole-v1"], "--env CartPole-v1 is not a goal env", marks=needs_sb3),
        (["--algo", "ppo"], "--algo ppo is an on-policy algorithm"),
        (["--algo", "a2c"], "needs an off-policy one: dqn, sac, td3, ddpg"),
        (["--algo", "rainbow"], "--algo rainbow is not an algorithm this job trains"),
        pytest.param(["--env", "her_store/PointGoal-v0"], "--algo dqn needs a Discrete action space", marks=needs_sb3),
        (["--env", "her_store/PointGoal-v0", "--algo", "sac", "--strategy", "nearest"], "--strategy nearest is not"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
        (["--eval-episodes", "-1"], "--eval-episodes must be at least 0"),
    ],
)
def test_bad_options_say_one_line_and_exit_nonzero(tmp_path, capsys, argv, message):
    code, out, err = run_main(capsys, "--out", str(tmp_path / "run"), *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("her-store train: error: ") and message in err, err
    assert "Traceback" not in out + err
    assert not os.path.exists(tmp_path / "run" / "store")


class _GoalKeysNoReward(gym.Env):
    """Goal-shaped observations but no compute_reward: not a goal env HER can relabel."""

    observation_space = spaces.Dict({k: spaces.Box(-1, 1, (2,), np.float32) for k in GOAL_KEYS})
    action_space = spaces.Box(-1, 1, (2,), np.float32)


gym.register("test_train/NoReward-v0", entry_point=_GoalKeysNoReward)


class _FailingBits(gym.Wrapper):
    """BitFlipping (4 bits, 4-step episodes) that raises at its 30th step: an env failing mid-run."""

    def __init__(self) -> None:
        from stable_baselines3.common.envs import BitFlippingEnv

        super().__init__(gym.wrappers.TimeLimit(BitFlippingEnv(n_bits=4), max_episode_steps=4))
        self.steps = 0

    def step(self, action):
        self.steps += 1
        if self.steps == 30:
            raise RuntimeError("the env failed at its step 30")
        return self.env.step(action)


gym.register("test_train/FailingBits-v0", entry_point=_FailingBits)
gym.register("test_train/DiscreteBits-v0", entry_point="stable_baselines3.common.envs:BitFlippingEnv")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "test_train/NoReward-v0", "--algo", "sac"], "is not a goal env: it has no compute_reward"),
        (["--env", "test_train/DiscreteBits-v0", "--algo", "td3"], "--algo td3 needs a Box action space"),
        (["--algo", "sac", "--algo-kwargs", '{"learning_rat": 0.1}'], "learning_rat"),
    ],
)
@needs_sb3
def test_envs_and_arguments_the_algorithm_cannot_use(tmp_path, capsys, argv, message):
    code, out, err = run_main(capsys, "--out", str(tmp_path / "run"), "--quiet", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err and "Traceback" not in out + err, err


def test_other_commands_refuse_unknown_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["info", "somewhere", "--steps", "5"])
    assert e.value.code == 2 and "unrecognized arguments: --steps 5" in capsys.readouterr().err


@needs_sb3
def test_bad_json_and_other_runs_options_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        job.main(["--algo-kwargs", "{not json"])
    assert e.value.code == 2 and "not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        job.main(["--algo-kwargs", "[1, 2]"])
    assert "expected a JSON object" in capsys.readouterr().err

    out_dir = tmp_path / "run"
    out_dir.mkdir()
    (out_dir / "run.json").write_text(json.dumps({**run_record(job.TrainConfig(out=str(out_dir))), "seed": 7}))
    code, _, err = run_main(capsys, "--out", str(out_dir), "--quiet")
    assert code == 2 and "holds a run with --seed 7, not 0" in err
    (out_dir / "run.json").write_text("[]")
    assert run_main(capsys, "--out", str(out_dir))[2].count("is not a run record") == 1
    (out_dir / "run.json").write_text("{")
    assert "is not a run record" in run_main(capsys, "--out", str(out_dir))[2]


def test_a_store_of_another_env_is_refused_and_kept(tmp_path, capsys):
    store_path = str(tmp_path / "point")
    assert cli_main(["demo", store_path, "--steps", "60", "--n-envs", "1", "--quiet"]) == 0
    capsys.readouterr()
    with EpisodeStore.open(store_path) as store:
        before = store.num_episodes
    code, _, err = run_main(capsys, "--out", str(tmp_path / "run"), "--store", store_path, *FAST)
    assert code == 2 and err.startswith("her-store train: error: ") and "Traceback" not in err
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes == before


def test_a_checkpoint_killed_half_way_is_ignored(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step-000000100").mkdir(parents=True)
    (root / ".step-000000200.tmp-123").mkdir()
    (root / ".step-000000200.tmp-123" / "model.zip").write_bytes(b"partial")
    (root / "notes").mkdir()
    assert job.latest_checkpoint(str(tmp_path)) == (100, str(root / "step-000000100"))
    assert job.latest_checkpoint(str(tmp_path / "none")) is None


def _episodes(path: str) -> int:
    try:
        with EpisodeStore.open(path) as store:
            return store.num_episodes
    except StoreError:  # not created yet
        return 0


# The training command (its arguments follow), which stops itself (SIGSTOP) once its first checkpoint is written: a
# kill -9 there lands at a point chosen, not timed (a run left to go on may have finished before a timed kill).
_STOPPED_AT_ITS_FIRST_CHECKPOINT = """
import os, runpy, signal, sys
from her_store.integrations import train_run_dir
save = train_run_dir.save_checkpoint

def save_then_stop(model, out):
    final = save(model, out)
    os.kill(os.getpid(), signal.SIGSTOP)
    return final

train_run_dir.save_checkpoint = save_then_stop
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@needs_sb3
def test_kill_9_then_the_same_command_resumes(tmp_path):
    out_dir = str(tmp_path / "run")
    store_path = os.path.join(out_dir, "store")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "train.py"), "--out", out_dir, "--steps", "400",
           "--checkpoint-every", "100", "--eval-episodes", "2", *FAST]
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_AT_ITS_FIRST_CHECKPOINT, *cmd[1:]], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        until_stopped(proc)
    finally:
        proc.kill()
        proc.wait()
    with EpisodeStore.open(store_path) as store:
        killed_with = store.num_episodes
        kept = store.episode(store.first_episode)
    assert killed_with > 0
    step = job.latest_checkpoint(out_dir)[0]
    assert 100 <= step < 400

    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resuming from step {step:,}, {killed_with:,} episodes in the store" in done.stdout
    assert "Traceback" not in done.stdout + done.stderr
    assert re.search(rf"steps\s*│?\s*400 \(resumed from {step:,}\)", done.stdout)
    with EpisodeStore.open(store_path) as store:
        assert store.num_episodes > killed_with
        again = store.episode(kept.id)
        assert all(np.array_equal(again[k], kept[k]) for k in kept)
    assert job.latest_checkpoint(out_dir)[0] == 400


def test_the_command_does_not_import_sb3_until_train_runs():
    code = "import sys, her_store.cli.main; sys.exit('stable_baselines3' in sys.modules or 'torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT).returncode == 0


class _NoSuccessKey(gym.Wrapper):
    """BitFlipping whose infos carry no ``is_success``, as many goal envs outside SB3."""

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        info.pop("is_success", None)
        return obs, reward, terminated, truncated, info


class _FlipTheWrongBit:
    """A policy that flips the first bit that differs from the goal, or (``wrong``) bit 0 always."""

    def __init__(self, wrong: bool) -> None:
        self.wrong = wrong

    def predict(self, obs, deterministic=True):
        differ = np.flatnonzero(obs["achieved_goal"] != obs["desired_goal"])
        return (0 if self.wrong or not len(differ) else int(differ[0])), None


def _bits(no_success_key: bool):
    from stable_baselines3.common.envs import BitFlippingEnv

    env = gym.wrappers.TimeLimit(BitFlippingEnv(n_bits=4), max_episode_steps=4)
    return _NoSuccessKey(env) if no_success_key else env


@needs_sb3
@pytest.mark.parametrize("wrong", [False, True])
def test_success_without_is_success_is_judged_by_the_reward(wrong):
    policy = _FlipTheWrongBit(wrong)
    with_key, with_rule = evaluate_with_rule(policy, lambda: _bits(False), 12, seed=0)
    without_key, without_rule = evaluate_with_rule(policy, lambda: _bits(True), 12, seed=0)
    assert with_key == without_key and (with_key == 1.0) is not wrong and 0.0 < with_key
    assert with_rule == "is_success" and without_rule == SUCCESS_BY_REWARD
    assert job.evaluate(policy, lambda: _bits(True), 12, seed=0) == without_key
    fields = {"steps": 1, "resumed_from": None, "success_rate": 0.5, "train_success_rate": None, "episodes": 1,
              "transitions": 1, "store_bytes": None, "rss_bytes": 1, "peak_rss_bytes": 1, "seconds": 1.0, "store": "s",
              "checkpoint": "c"}
    assert job.TrainResult(success_rule=without_rule, **fields).rows()[1] == ("success judged by (no is_success)",
                                                                            SUCCESS_BY_REWARD)
    assert job.TrainResult(success_rule=with_rule, **fields).rows()[1][0].startswith("success rate (last 100")


@needs_sb3
def test_a_failed_start_leaves_no_run_and_the_corrected_command_is_accepted(tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    short = ["--out", out_dir, "--steps", "30", "--eval-episodes", "1", *FAST]
    code, _, err = run_main(capsys, *short[:-3], "--algo-kwargs", '{"learning_rat": 0.1}', "--quiet")
    assert code == 2 and "learning_rat" in err
    code, _, err = run_main(capsys, *short, "--capacity", "5")  # the store refuses episodes longer than itself
    assert code == 2 and "dropped" in err
    assert not os.path.exists(os.path.join(out_dir, "run.json")) and not os.path.exists(os.path.join(out_dir, "store"))
    code, _, err = run_main(capsys, *short, "--capacity", "1000")
    assert code == 0, err
    with open(os.path.join(out_dir, "run.json")) as f:
        assert json.load(f)["capacity"] == 1000
    code, _, err = run_main(capsys, *short, "--capacity", "1000", "--seed", "3")  # the run exists now
    assert code == 2 and "holds a run with --seed 0, not 3" in err


def test_a_relative_store_is_the_same_store_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = job.TrainConfig(out=str(tmp_path / "run"), store="stores/bits")
    assert cfg.store == cfg.store_location == str(tmp_path / "stores" / "bits")
    assert run_record(cfg)["store"] == str(tmp_path / "stores" / "bits")
    assert job.TrainConfig(store=f"file://{tmp_path}/stores/bits").store == cfg.store
    assert job.TrainConfig(store="memory://bits").store == "memory://bits"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert run_record(job.TrainConfig(out=str(tmp_path / "run"), store="../stores/bits")) == run_record(cfg)


@needs_sb3
def test_many_envs_wait_for_an_episode_of_each_before_training(tmp_path, capsys):
    # 16 envs of 10-step episodes: 100 steps (DQN's learning_starts) end no episode; the job waits for 160
    code, _, err = run_main(capsys, "--out", str(tmp_path / "run"), "--n-envs", "16", "--steps", "200",
                              "--eval-episodes", "1", "--quiet")
    assert code == 0, err
    from stable_baselines3.common.save_util import load_from_zip_file

    data, _, _ = load_from_zip_file(os.path.join(job.latest_checkpoint(str(tmp_path / "run"))[1], "model.zip"))
    assert data["learning_starts"] == 16 * DEFAULT_N_BITS


@needs_sb3
def test_training_waits_for_an_episode_of_an_env_without_a_known_limit(tmp_path, capsys):
    # PointGoal's spec has no max_episode_steps: with 8 envs its 50-step episodes outlast learning_starts 200
    code, out, err = run_main(capsys, "--out", str(tmp_path / "run"), "--env", "her_store/PointGoal-v0", "--algo",
                              "sac", "--n-envs", "8", "--steps", "480", "--eval-episodes", "1", "--quiet",
                              "--algo-kwargs", '{"batch_size": 16, "gradient_steps": 1, "learning_starts": 200}')
    assert code == 0, err
    assert "Traceback" not in out + err


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        pytest.param(["--device", "foo"], 2, "--device foo is not a torch device; expected e.g. auto, cpu, cuda",
                     marks=needs_sb3),
        pytest.param(["--device", "cuda:0"], 2, "--device cuda:0: no cuda device is available here (try --device cpu)",
                     marks=needs_sb3),
        (["--threads", "100000"], 2, "--threads must be at most 256 (0: torch's default), got 100000"),
        pytest.param(["--algo-kwargs", '{"learning_rate": "abc"}'], 1,
                     "building the DQN model: AssertionError: The learning rate schedule must be a float or a callable",
                     marks=needs_sb3),
        pytest.param(["--store", "s3://nonexistent-bucket-zz/x"], 1, "reading the store s3://nonexistent-bucket-zz/x: ",
                     marks=needs_sb3),
    ],
)
def test_failures_anywhere_say_what_failed_in_one_line(tmp_path, capsys, monkeypatch, argv, code, message):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no credentials from anywhere, no waiting for them
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    got, out, err = run_main(capsys, "--out", str(tmp_path / "run"), "--quiet", *argv)
    assert got == code and err.count("\n") == 1 and err.startswith("her-store train: error: ") and message in err, err
    assert "Traceback" not in out + err


@needs_sb3
def test_a_damaged_checkpoint_is_named_in_one_line(tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    short = ["--out", out_dir, "--eval-episodes", "1", *FAST]
    assert run_main(capsys, *short, "--steps", "20")[0] == 0
    ckpt = job.latest_checkpoint(out_dir)[1]
    with open(os.path.join(ckpt, "replay_buffer.pkl"), "r+b") as f:
        f.truncate(100)
    code, out, err = run_main(capsys, *short, "--steps", "40")
    assert code == 1 and err.count("\n") == 1 and "Traceback" not in out + err
    assert err.startswith(f"her-store train: error: loading the checkpoint {ckpt}: "), err


@pytest.mark.slow
@needs_sb3
def test_sigterm_writes_a_checkpoint_and_exits_143(tmp_path):
    out_dir = str(tmp_path / "run")
    cmd = [sys.executable, os.path.join(ROOT, "tools", "train.py"), "--out", out_dir, "--steps", "100000",
           "--checkpoint-every", "100000", "--eval-episodes", "1", *FAST]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # only a hang takes this long
        while proc.poll() is None and _episodes(os.path.join(out_dir, "store")) < 3:
            assert time.monotonic() < deadline, "the run committed no 3 episodes in 300 s"
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out + err
    step = job.latest_checkpoint(out_dir)[0]
    assert 0 < step < 100000
    assert f"terminated (SIGTERM) at step {step:,}; checkpoint saved" in out and "Traceback" not in out + err


@needs_sb3
def test_a_checkpoint_that_cannot_be_written_is_named_and_leaves_nothing(tmp_path):
    import resource

    from stable_baselines3 import DQN
    from stable_baselines3.common.envs import BitFlippingEnv

    model = DQN("MultiInputPolicy", BitFlippingEnv(n_bits=4), buffer_size=100, learning_starts=10)
    out_dir = str(tmp_path / "run")
    first = job.save_checkpoint(model, out_dir)
    model.num_timesteps = 100
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, limits[1]))  # files cannot grow past 2 KiB: as a full disk
    try:
        with pytest.raises(OSError) as e:
            job.save_checkpoint(model, out_dir)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    final = os.path.join(out_dir, "checkpoints", "step-000000100")
    assert e.value.__notes__ == [f"writing the checkpoint {final}"]
    assert one_line(e.value).startswith(f"writing the checkpoint {final}: OSError: ")
    assert os.listdir(os.path.join(out_dir, "checkpoints")) == [os.path.basename(first)]


@needs_sb3
def test_out_naming_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    code, _, err = run_main(capsys, "--out", str(tmp_path / "afile"), "--quiet")
    assert code == 2 and f"--out {tmp_path / 'afile'} is a file; the run directory must be a directory" in err


@needs_sb3
def test_a_memory_store_is_said_not_to_outlive_the_run(tmp_path, capsys):
    code, out, err = run_main(capsys, "--out", str(tmp_path / "run"), "--store", "memory://test-train-note",
                              "--steps", "20", "--eval-episodes", "1", *FAST)
    assert code == 0, err
    assert "note: --store memory://test-train-note is held in this process's memory: it does not outlive" in out
    assert "store bytes in memory (gone at exit)" in out and "on disk" not in out
    assert bytes_label("s3://bucket/x") == "store bytes at s3://"
    assert bytes_label(str(tmp_path)) == "store bytes on disk"


@needs_sb3
def test_no_evaluation_says_na_and_sb3_leaves_no_log_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-log"))  # where SB3's default logger would make its directory
    code, out, err = run_main(capsys, "--out", str(tmp_path / "run"), "--steps", "20", "--eval-episodes", "0", *FAST)
    assert code == 0, err
    assert re.search(r"success rate \(deterministic\)\s*│?\s*n/a", out) and "nan" not in out
    assert not os.path.exists(tmp_path / "sb3-log")


@needs_sb3
def test_an_env_module_that_cannot_be_imported_is_named(tmp_path, capsys):
    code, _, err = run_main(capsys, "--out", str(tmp_path / "run"), "--env", "nosuch_module_zz:Env-v0")
    assert code == 2 and err.startswith("her-store train: error: --env nosuch_module_zz:Env-v0: ")
    assert "No module" in err


gym.register("test_train/NoSuccessBits-v0", entry_point=lambda: _bits(True))


def test_the_store_records_success_and_its_card_names_env_algorithm_and_versions(tmp_path, capsys):
    import stable_baselines3

    import her_store
    from her_store.format.card import card_problems
    from her_store.ops.plot import plot_data

    store_path = str(tmp_path / "run" / "store")
    code, _, err = run_main(capsys, "--out", str(tmp_path / "run"), "--steps", "60", "--eval-episodes", "1", *FAST)
    assert code == 0, err
    assert cli_main(["inspect", store_path]) == 0
    shown = capsys.readouterr().out
    assert re.search(r"success rate\s+│?\s*\d+\.\d% of \d+ episodes with is_success", shown), shown
    with EpisodeStore.open(store_path) as store:
        assert store.info_keys == ("is_success",) and (store.episodes["success"] >= 0).all()
        assert len(plot_data(store).success_ids) == store.num_episodes  # the plot's success panel has them all
        card = store.metadata
    assert card["env_id"] == job.DEFAULT_ENV and card["algorithm_name"] == "DQN+HER (future)"
    assert card["versions"]["her_store"] == her_store.__version__
    assert card["versions"]["stable_baselines3"] == stable_baselines3.__version__
    assert json.loads(card["env_spec"])["id"] == job.DEFAULT_ENV
    assert any(r.replace("-", "_").startswith("stable_baselines3==") for r in card["requirements"])
    assert card_problems(card) == []

    # an env whose infos carry no is_success: no info stored, success unknown, the card still written
    store_path = str(tmp_path / "bare" / "store")
    code, _, err = run_main(capsys, "--out", str(tmp_path / "bare"), "--env", "test_train/NoSuccessBits-v0",
                            "--steps", "20", "--eval-episodes", "1", *FAST)
    assert code == 0, err
    with EpisodeStore.open(store_path) as store:
        assert store.info_keys == () and (store.episodes["success"] == -1).all()
        assert store.metadata["env_id"] == "test_train/NoSuccessBits-v0" and "env_spec" not in store.metadata


def test_resuming_a_run_that_ended_on_a_checkpoint_step_says_nothing_of_dropped_episodes(tmp_path, capsys):
    # the last step is a checkpoint step: that checkpoint's handle holds the episode under way, which the run then
    # ended (truncated) itself; its resume is the expected one
    import pickle

    argv = ["--out", str(tmp_path / "run"), "--checkpoint-every", "36", "--eval-episodes", "1", *FAST]
    code, _, err = run_main(capsys, *argv, "--steps", "108")  # 10-step episodes: the 11th is under way at step 108
    assert code == 0, err
    with open(os.path.join(job.latest_checkpoint(str(tmp_path / "run"))[1], "replay_buffer.pkl"), "rb") as f:
        assert pickle.load(f)._restore is not None  # the checkpoint holds steps of an unfinished episode
    with EpisodeStore.open(str(tmp_path / "run" / "store")) as store:
        assert store.num_transitions == 108  # which the run ended itself, after that checkpoint
    code, out, err = run_main(capsys, *argv, "--steps", "150")
    assert code == 0, err
    assert "resuming from step 108" in out and "note:" not in out and "dropped" not in out + err, out + err


def test_a_failed_first_attempt_leaves_nothing_it_made_and_keeps_what_was_there(tmp_path, capsys):
    # a bad --algo-kwargs: the run directory and its parent, made for it, go
    code, _, err = run_main(capsys, "--out", str(tmp_path / "runs" / "rf"), "--algo-kwargs", '{"learning_rat": 1}',
                            "--quiet")
    assert code == 2 and "learning_rat" in err
    assert os.listdir(tmp_path) == []
    # an env that fails mid-run, after episodes were committed: what was there stays, what it made goes
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    code, _, err = run_main(capsys, "--out", str(tmp_path / "mine"), "--store", str(tmp_path / "stores" / "bits"),
                            "--env", "test_train/FailingBits-v0", "--steps", "100", *FAST)
    assert code == 1 and "RuntimeError: the env failed at its step 30" in err, err
    assert sorted(os.listdir(tmp_path)) == ["mine"] and os.listdir(tmp_path / "mine") == ["notes.txt"]
    # a store that was there before is kept, whatever a failed attempt did with it
    assert cli_main(["demo", str(tmp_path / "point"), "--steps", "60", "--n-envs", "1", "--quiet"]) == 0
    code, _, err = run_main(capsys, "--out", str(tmp_path / "mine"), "--store", str(tmp_path / "point"), *FAST)
    assert code == 2 and os.listdir(tmp_path / "mine") == ["notes.txt"]
    with EpisodeStore.open(str(tmp_path / "point")) as store:
        assert store.num_episodes == 1
    # the corrected command then runs
    code, _, err = run_main(capsys, "--out", str(tmp_path / "runs" / "rf"), "--steps", "20", "--eval-episodes", "1",
                            *FAST)
    assert code == 0 and os.path.exists(tmp_path / "runs" / "rf" / "run.json"), err


def test_the_run_directories_are_ignored_by_git():
    paths = ["her_store_run/store/zarr.json", "runs/rf/run.json"]
    try:
        done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True,
                              check=False)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if done.returncode == 128:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    assert done.stdout.split() == paths, done.stderr


def test_prioritize_energy_trains_draws_by_energy_and_is_part_of_the_run(tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    argv = ["--out", out_dir, "--algo", "sac", "--env", "her_store/PointGoal-v0", "--steps", "150",
            "--eval-episodes", "1", "--quiet", "--algo-kwargs", '{"learning_starts": 60, "batch_size": 16}']
    code, out, err = run_main(capsys, *argv, "--prioritize", "energy")
    assert code == 0, err
    with open(os.path.join(out_dir, "run.json")) as f:
        assert json.load(f)["prioritize"] == "energy"
    with EpisodeStore.open(os.path.join(out_dir, "store")) as store:
        assert store.episodes["priority"].min() > 0  # a moving point: every episode has energy
    code, out, err = run_main(capsys, *argv)  # resuming without it would change how the run replays
    assert code == 2 and "--prioritize 'energy', not None" in out + err
    with pytest.raises(SystemExit) as stop:
        run_main(capsys, *argv, "--prioritize", "td")
    assert stop.value.code == 2 and "invalid choice: 'td'" in capsys.readouterr().err
