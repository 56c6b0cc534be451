"""tools/learning_check.py: its refusals, and a tiny real run of each mode writing its curves and its plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TOOL = os.path.join(ROOT, "tools", "learning_check.py")


def _run(args: list[str], cwd: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          check=False)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--seeds", "0"], "--seeds must be at least 1, got 0"),
        (["--eval-every", "-5"], "--eval-every must be at least 1, got -5"),
        (["--distance-threshold", "0"], "--distance-threshold above 0"),
        (["--modes", "td"], "invalid choice: 'td'"),
        (["--seed", "2"], "unrecognized arguments: --seed 2"),  # never taken for --seeds
    ],
)
def test_bad_options_are_refused_before_anything_runs(tmp_path, argv, said):
    done = _run(argv, str(tmp_path), timeout=120)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_a_tiny_check_writes_a_curve_per_mode_and_seed_and_its_plot(tmp_path):
    pytest.importorskip("stable_baselines3")
    pytest.importorskip("matplotlib")
    out = tmp_path / "results"
    done = _run(["--steps", "200", "--eval-every", "100", "--eval-episodes", "2", "--learning-starts", "100",
                 "--seeds", "1", "--out", str(out)], str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stderr
    with open(out / "learning_check.json") as f:
        result = json.load(f)
    assert [(r["mode"], r["seed"]) for r in result["runs"]] == [("energy", 0), ("uniform", 0)]
    for r in result["runs"]:
        assert r["steps"] == [0, 100, 200] and all(s in (0.0, 0.5, 1.0) for s in r["success"])
    assert set(result["summary"]) == {"uniform", "energy"}
    with open(out / "learning_check.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
