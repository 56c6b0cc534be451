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


def test_a_command_reading_over_http_says_one_line_and_leaves_no_open_session(tmp_path):
    """Over HTTP, a command that fails says one line on stderr, and one that succeeds says nothing there: the HTTP
    sessions of the reads end with the store (aiohttp's "Unclosed client session" notice at exit made them three)."""
    from tests.conftest import fetch_spaces, make_episode
    from tests.http_server import serving

    obs, act = fetch_spaces()
    with EpisodeStore.create(tmp_path / "served" / "store", obs, act) as store:
        store.append_episode(make_episode(obs, act, 5, seed=0))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "her_store.cli", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=120, check=False)

    with serving(str(tmp_path / "served")) as base:
        good = cli("inspect", f"{base}/store")
        assert good.returncode == 0 and good.stderr == "", good
        out = str(tmp_path / "e.npz")
        exported = cli("export", "--quiet", f"{base}/store", "--to", "npz", out)
        assert exported.returncode == 0 and exported.stderr == "" and os.path.getsize(out) > 0, exported
        for args in (("inspect", f"{base}/nothing"), ("verify", f"{base}/nothing"),
                     ("copy", f"{base}/nothing", str(tmp_path / "c"))):
            bad = cli(*args)
            lines = bad.stderr.strip().splitlines()
            assert bad.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"her-store {args[0]}: "), bad
            assert "no Zarr group" in lines[0], bad


def test_demo_on_a_broken_place_says_one_line(tmp_path, capsys):
    """A file, or a store of other spaces, where the demo's store would go: one line and exit 2, no traceback."""
    (tmp_path / "file").write_bytes(b"x")
    assert main(["demo", str(tmp_path / "file"), "--steps", "10", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == f"her-store demo: {tmp_path / 'file'} is a file, not a store directory"
    from tests.conftest import fetch_spaces

    obs, act = fetch_spaces()
    EpisodeStore.create(tmp_path / "other", obs, act).close()
    assert main(["demo", str(tmp_path / "other"), "--steps", "10", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("her-store demo: "), err
    assert main(["demo", str(tmp_path / "few"), "--steps", "3", "--quiet"]) == 0  # no episode ended: nothing to show


def test_an_unknown_option_is_named_by_its_command_and_a_closed_pipe_ends_quietly(tmp_path, capsys):
    """``her-store verify ... --bogus`` says "her-store verify: error:" (it said "her-store: error:"), and a reader of
    stdout that went away (``| head``) ends the command without a "Broken pipe" line."""
    path = str(tmp_path / "demo")
    assert main(["demo", path, "--steps", "60", "--quiet"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["verify", path, "--bogus"])
    assert "her-store verify: error: unrecognized arguments: --bogus" in capsys.readouterr().err
    proc = subprocess.Popen([sys.executable, "-m", "her_store.cli", "inspect", path], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # gone before the command writes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
