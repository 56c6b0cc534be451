"""The her-store command: the demo writes, resumes and reads back a store; info summarises it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from her_store import EpisodeStore
from her_store.cli.main import main
from tests.conftest import ROOT


def test_demo_writes_resumes_and_info_reads(tmp_path, capsys):
    path = str(tmp_path / "demo")
    assert main(["demo", path, "--steps", "120", "--n-envs", "2", "--quiet"]) == 0
    with EpisodeStore.open(path) as store:
        first = store.num_episodes
        assert first == 2 * 120 // 50 and store.metadata["env_id"] == "her_store/PointGoal-v0"
    assert main(["demo", path, "--steps", "100", "--n-envs", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "resuming after episode" in out and "checksum-verified" in out
    with EpisodeStore.open(path) as store:
        assert store.num_episodes == first + 4
        assert (store.episodes["length"] == 50).all()
    assert main(["info", path]) == 0
    assert "PointGoal" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--step", "100"],  # taken for --steps, it would train
        ["demo", "somewhere", "--step", "5"],
        ["inspect", "somewhere", "--js"],
        ["export", "somewhere", "--to", "npz", "out.npz", "--qu"],
    ],
)
def test_an_abbreviated_option_is_refused(tmp_path, monkeypatch, capsys, argv):
    monkeypatch.chdir(tmp_path)  # nothing may be written anywhere else, whatever the command did
    with pytest.raises(SystemExit) as e:
        main(argv)
    bad = [a for a in argv if a.startswith("--")][-1]
    assert e.value.code == 2 and f"unrecognized arguments: {bad}" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tool", "argv", "bad"),
    [("train.py", ["--step", "100"], "--step 100"), ("store_inspect.py", ["somewhere", "--js"], "--js"),
     ("bench.py", ["--quic", "--full"], "--quic")],  # --quic taken for --quick: "not allowed with --full"
)
def test_the_tools_refuse_abbreviated_options(tmp_path, tool, argv, bad):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), *argv], capture_output=True, text=True,
                          check=False, cwd=tmp_path, timeout=300)
    assert done.returncode == 2 and f"unrecognized arguments: {bad}" in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []
