"""The her-store command: the demo writes, resumes and reads back a store; info summarises it."""

from __future__ import annotations

from her_store import EpisodeStore
from her_store.cli import main


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
