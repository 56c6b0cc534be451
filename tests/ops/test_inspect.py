"""her-store inspect and card: summaries that match the store, episode pages, plain text when piped, card edits that
are checked and atomic (a kill -9 never tears zarr.json), and stores whose card is hostile still open."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.cli.main import main
from her_store.format.layout import FORMAT_VERSION
from tests.conftest import ROOT, fetch_spaces, make_episode

CARD = {"env_id": "FetchReach-v4", "algorithm_name": "SAC+HER", "author": "lab"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m her_store.cli ...`` with stdout a pipe, as a user's shell pipe or a script sees it."""
    return subprocess.run([sys.executable, "-m", "her_store.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, check=False)


def _json(capsys, *args: str) -> dict:
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def _image_store(path: str, lengths: list[int]) -> list[dict]:
    """A store with a compressed image observation (a smooth pattern that LZ4 shrinks) and is_success."""
    def box(shape):
        return spaces.Box(-np.inf, np.inf, shape, np.float32)

    obs = spaces.Dict({"observation": spaces.Box(0, 255, (48, 48, 3), np.uint8), "achieved_goal": box((2,)),
                       "desired_goal": box((2,))})
    act = spaces.Box(-1, 1, (2,), np.float32)
    eps = []
    with EpisodeStore.create(path, obs, act, info_keys=["is_success"], metadata=CARD) as store:
        for i, T in enumerate(lengths):
            ep = make_episode(obs, act, T, seed=i, info_keys=("is_success",), terminated=i % 2 == 0)
            ep["observation"] = np.broadcast_to(np.arange(T + 1, dtype=np.uint8)[:, None, None, None],
                                                (T + 1, 48, 48, 3)).copy()
            store.append_episode(ep)
            eps.append(ep)
    return eps


def _zarr_json(path: str) -> bytes:
    with open(os.path.join(path, "zarr.json"), "rb") as f:
        return f.read()


def _files_under(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def _du(directory: str) -> int:
    """Bytes allocated for the files under ``directory`` (what ``du`` counts)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(directory) for f in files)


def test_inspect_json_matches_the_store(tmp_path, capsys):
    path = str(tmp_path / "s")
    lengths = [5, 17, 1, 40, 9, 23]
    eps = _image_store(path, lengths)
    s = _json(capsys, "inspect", path, "--json")
    assert s["format_version"] == FORMAT_VERSION and s["location"] == os.path.abspath(path)
    assert (s["episodes"], s["transitions"], s["first_episode"], s["end_episode"]) == (6, sum(lengths), 0, 6)
    assert s["capacity"] is None and s["evicted"] == 0 and s["fill"] is None
    assert s["spaces"]["info_keys"] == ["is_success"] and "uint8" in s["spaces"]["observation"]["observation"]
    st = s["statistics"]
    assert st["length"] == pytest.approx({"mean": np.mean(lengths), "std": np.std(lengths), "min": 1,
                                          "median": np.median(lengths), "max": 40})
    returns = [float(np.sum(e["reward"], dtype=np.float64)) for e in eps]
    assert st["return"]["mean"] == pytest.approx(np.mean(returns), rel=1e-6)
    succeeded = sum(e["is_success"][-1] > 0.5 for e in eps)
    assert st["success"] == {"known": 6, "succeeded": succeeded, "rate": pytest.approx(succeeded / 6)}
    assert (st["terminated"], st["truncated"]) == (3, 3)
    assert s["card"] == CARD and s["card_warnings"] == []
    fields = {f["name"]: f for f in s["fields"]}
    image = fields["observation"]
    assert (image["dtype"], image["shape"], image["array"]) == ("uint8", [48, 48, 3], "steps/observation")
    # apparent bytes are the files' sizes, bytes on disk what is allocated for them; the ratio is the rows' raw bytes
    # over the files' sizes (the pattern compresses)
    shards = os.path.join(path, "steps", "observation")
    named = [os.path.join(shards, n) for n in os.listdir(shards) if n.startswith("c.")]
    assert image["apparent_bytes"] == sum(map(os.path.getsize, named)) > 0
    assert image["bytes_on_disk"] == sum(os.stat(p).st_blocks * 512 for p in named) > 0
    rows = sum(lengths) + len(lengths)
    assert image["compression_ratio"] == pytest.approx(rows * 48 * 48 * 3 / image["apparent_bytes"])
    assert image["compression_ratio"] > 3
    assert fields["action"]["compression_ratio"] == 1.0  # packs are raw
    columns = os.path.join(path, "episodes")
    assert s["index_apparent_bytes"] == sum(_files_under(os.path.join(columns, c, "c")) for c in os.listdir(columns))
    assert s["index_bytes"] == sum(_du(os.path.join(columns, c, "c")) for c in os.listdir(columns)) > 0
    arrays = {a["path"]: a for a in s["arrays"]}
    for key in ("bytes_on_disk", "apparent_bytes"):
        index = s["index_bytes" if key == "bytes_on_disk" else "index_apparent_bytes"]
        assert s[key] == index + sum(a[key] for a in arrays.values())
        assert sum(f[key] for f in s["fields"] if f["array"] == "packs/float32") == pytest.approx(
            arrays["packs/float32"][key], abs=4)


def test_bytes_on_disk_are_the_bytes_allocated_and_the_files_sizes_are_called_apparent(tmp_path, capsys):
    """A store of the default local layout with five episodes: its uncompressed chunk files are 1,048,576 rows each,
    nearly all holes. inspect called their sizes (88 MB) its "bytes on disk", where du counts about 250 KB and the
    main job's summary 0.4 MiB. Bytes on disk are now what is allocated (st_blocks); the sizes are the apparent size,
    and both are given in --json and in the table."""
    path = str(tmp_path / "s")
    obs, act = fetch_spaces()
    with EpisodeStore.create(path, obs, act) as store:
        for i in range(5):
            store.append_episode(make_episode(obs, act, 50, seed=i))
    chunks = [os.path.join(path, top, name, "c") for top in ("packs", "episodes") for name in os.listdir(
        os.path.join(path, top)) if os.path.isdir(os.path.join(path, top, name))]
    allocated, apparent = sum(map(_du, chunks)), sum(map(_files_under, chunks))
    if allocated * 4 > apparent:
        pytest.skip("this file system keeps no holes")
    s = _json(capsys, "inspect", path, "--json")
    assert s["bytes_on_disk"] == allocated
    assert s["apparent_bytes"] == apparent > 100 * allocated
    index = [c for c in chunks if "/episodes/" in c]
    assert (s["index_bytes"], s["index_apparent_bytes"]) == (sum(map(_du, index)), sum(map(_files_under, index)))
    fields = {f["name"]: f for f in s["fields"]}
    assert 0 < fields["observation"]["bytes_on_disk"] < fields["observation"]["apparent_bytes"]
    assert main(["inspect", path]) == 0
    lines = {line.split("  ")[1]: line for line in capsys.readouterr().out.splitlines() if line.count("  ") >= 2}
    assert f"{allocated / 1000:.1f} KB" in lines["bytes on disk"]
    assert f"{apparent / 1e6:.1f} MB" in lines["apparent size"]


def test_inspect_a_ring_that_evicted(tmp_path, capsys):
    path = str(tmp_path / "ring")
    obs, act = fetch_spaces()
    with EpisodeStore.create(path, obs, act, capacity=100, commit_interval=0) as store:
        for i in range(30):
            store.append_episode(make_episode(obs, act, 12, seed=i))
        first, end, n = store.first_episode, store.end_episode, store.num_transitions
    assert first > 0
    s = _json(capsys, "inspect", path, "--json")
    assert (s["capacity"], s["evicted"], s["first_episode"], s["end_episode"]) == (100, first, first, end)
    assert s["episodes"] == end - first and s["transitions"] == n and s["fill"] == pytest.approx(n / 100)
    assert s["statistics"]["success"] == {"known": 0, "succeeded": 0, "rate": None}  # no is_success info
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert f"{first:,} episodes evicted" in out and f"({n / 100:.1%} full)" in out


def test_inspect_a_version_1_store(capsys):
    import zarr

    path = os.path.join(ROOT, "tests", "data", "v1_store")  # chunked, not sharded, images compressed; a ring
    s = _json(capsys, "inspect", path, "--json")
    with EpisodeStore.open(path) as store:
        first, end, n = store.first_episode, store.end_episode, store.num_transitions
    assert s["format_version"] == 1 and (s["evicted"], s["end_episode"], s["transitions"]) == (first, end, n)
    pixels = next(f for f in s["fields"] if f["name"] == "pixels")
    chunks = os.path.join(path, "steps", "pixels", "c")
    disk, files = _files_under(chunks), sum(len(f) for _, _, f in os.walk(chunks))
    chunk_rows = zarr.open_array(os.path.join(path, "steps", "pixels"), mode="r").chunks[0]
    assert pixels["apparent_bytes"] == disk and pixels["compression_ratio"] == pytest.approx(
        files * chunk_rows * 3 * 8 * 8 / disk)  # a chunk is written whole: its every row counts
    assert pixels["bytes_on_disk"] == _du(chunks)


def test_an_empty_store_without_sizes(tmp_path, capsys):
    path = str(tmp_path / "empty")
    obs, act = fetch_spaces()
    EpisodeStore.create(path, obs, act).close()
    s = _json(capsys, "inspect", path, "--json", "--no-sizes")
    assert s["episodes"] == 0 and s["statistics"]["length"]["mean"] is None and s["bytes_on_disk"] is None
    assert {f["bytes_on_disk"] for f in s["fields"]} == {None}
    assert main(["inspect", path]) == 0
    assert "(empty)" in capsys.readouterr().out
    assert main(["inspect", path, "--no-sizes"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["bytes", "on", "disk", "?", "(index", "?)"] in lines
    p = _json(capsys, "inspect", path, "--episodes", "--json")
    assert (p["total"], p["pages"], p["rows"]) == (0, 1, [])
    assert main(["inspect", path, "--episodes", "--page", "0"]) == 2
    assert "count from 1" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tables_or_plain_text_without_rich(tmp_path, monkeypatch):
    pytest.importorskip("rich", reason='pip install "her_store[tools]"')
    path = str(tmp_path / "s")
    _image_store(path, [4])
    for rich_installed in (True, False):
        if not rich_installed:
            monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails, as when rich is not installed
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        assert main(["card", path]) == 0
        monkeypatch.undo()
        assert "FetchReach-v4" in terminal.getvalue() and ("│" in terminal.getvalue()) == rich_installed


def test_episode_selection_and_pages(tmp_path, capsys):
    path = str(tmp_path / "s")
    lengths = [3, 4, 5, 6, 7, 8, 9]
    _image_store(path, lengths)
    with EpisodeStore.open(path) as store:
        table = store.episodes
    p = _json(capsys, "inspect", path, "--episodes=-5:", "--page-size", "2", "--page", "3", "--json")
    assert (p["total"], p["pages"], p["page"]) == (5, 3, 3)
    assert [r["episode_id"] for r in p["rows"]] == [6]
    row = p["rows"][0]
    for name in ("start_row", "length", "return", "success", "terminated", "crc32", "created_at"):
        assert row[name] == table[name][6].item(), name
    p = _json(capsys, "inspect", path, "--page", "2", "--page-size", "3", "--json")  # a page alone: of every episode
    assert (p["total"], p["pages"], p["page"]) == (7, 3, 2) and [r["episode_id"] for r in p["rows"]] == [3, 4, 5]
    p = _json(capsys, "inspect", path, "--episodes", "0:2,5", "--json")
    assert [r["episode_id"] for r in p["rows"]] == [0, 1, 5] and p["pages"] == 1
    p = _json(capsys, "inspect", path, "--episodes", "--json")  # no selection: every episode, first page
    assert [r["length"] for r in p["rows"]] == lengths
    assert main(["inspect", path, "--episodes", "1:4"]) == 0
    out = capsys.readouterr().out
    assert "page 1 of 1 (3 episodes)" in out and out.count(f"{table['crc32'][2]:08x}") == 1
    for bad, says in (
        (["--episodes", "9"], "episode 9 is not live"),
        (["--episodes", "0:", "--page", "2"], "past the last page"),
    ):
        assert main(["inspect", path, *bad]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1


def test_plain_text_when_piped(tmp_path):
    path = str(tmp_path / "s")
    _image_store(path, [4, 6])
    r = _cli("inspect", path)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "─" not in r.stdout and "│" not in r.stdout  # no rich boxes or colours
    lines = [line.split() for line in r.stdout.splitlines()]
    version = ["format", "version", str(FORMAT_VERSION)]
    for words in (version, ["episodes", "2", "(ids", "0..1)"], ["env_id", "FetchReach-v4"]):
        assert words in lines
    r = _cli("inspect", path, "--json")
    assert json.loads(r.stdout)["transitions"] == 10


def test_rich_tables_in_a_terminal(tmp_path):
    pty = pytest.importorskip("pty")
    pytest.importorskip("rich", reason='pip install "her_store[tools]"')
    path = str(tmp_path / "s")
    _image_store(path, [4, 6])
    with EpisodeStore.open(path, mode="a") as store:
        store.update_metadata(code_permalink="[bold red]see[/]")
    parent, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "her_store.cli", "inspect", path], stdout=child,
                            stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "COLUMNS": "160", "TERM": "xterm"})
    os.close(child)
    out = b""
    while True:
        try:
            data = os.read(parent, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    os.close(parent)
    assert proc.wait(timeout=120) == 0, proc.stderr.read()
    text = out.decode()
    assert "│" in text and "━" in text  # rich's boxes and header rules
    assert "FetchReach-v4" in text and "[bold red]see[/]" in text  # a card's brackets are text, not markup


def test_card_set_and_remove_round_trip(tmp_path, capsys):
    path = str(tmp_path / "s")
    _image_store(path, [3])
    assert main(["card", path, "--set", "ref_max_score=1.5", "--set", "author=Ada",
                 "--set", 'goal_keys=["achieved_goal","desired_goal"]', "--set", "license=CC-BY-4.0"]) == 0
    capsys.readouterr()
    want = {**CARD, "ref_max_score": 1.5, "author": "Ada", "goal_keys": ["achieved_goal", "desired_goal"],
            "license": "CC-BY-4.0"}
    with EpisodeStore.open(path) as store:
        assert store.metadata == want
    assert _json(capsys, "card", path, "--json") == want
    assert main(["card", path, "--set", "license=", "--set", "author="]) == 0
    out = capsys.readouterr().out
    assert "license" not in out and ["ref_max_score", "1.5"] in [line.split() for line in out.splitlines()]
    with EpisodeStore.open(path) as store:
        assert store.metadata == {k: v for k, v in want.items() if k not in ("license", "author")}
    assert [n for n in os.listdir(path) if n.endswith((".tmp", ".partial"))] == []


def test_card_refuses_a_wrong_kind_and_leaves_the_card(tmp_path, capsys):
    path = str(tmp_path / "s")
    _image_store(path, [3])
    before = _zarr_json(path)
    r = _cli("card", path, "--set", "author=Ada", "--set", "ref_min_score=low")
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == f"her-store card: {path}: the dataset card's 'ref_min_score' is 'low'; expected number " \
                       "(reference score of a random policy); the card was not changed\n"
    assert _zarr_json(path) == before
    for assignment, field in (
        ('goal_keys=["a"]', "'goal_keys'"),
        ("reward_function=os.system('x')", "'reward_function'"),
        ("nokey", "key=value"),
    ):
        assert main(["card", path, "--set", "author=Ada", "--set", assignment]) == 2
        err = capsys.readouterr().err
        assert err.startswith("her-store card: ") and err.count("\n") == 1 and field in err, err
        assert _zarr_json(path) == before


def test_update_metadata_is_checked_and_removes(tmp_path):
    path = str(tmp_path / "s")
    _image_store(path, [3])
    with EpisodeStore.open(path, mode="a") as store:
        before = _zarr_json(path)
        with pytest.raises(ValueError, match="'success_threshold' is 'near'; expected number"):
            store.update_metadata(success_threshold="near")
        with pytest.raises(ValueError, match="not JSON"):
            store.update_metadata(extra=float("nan"))
        assert _zarr_json(path) == before and store.metadata == CARD
        store.update_metadata(author=None, success_threshold=0.05)
        assert store.metadata == {"env_id": "FetchReach-v4", "algorithm_name": "SAC+HER", "success_threshold": 0.05}
    with EpisodeStore.open(path) as store:
        assert store.metadata["success_threshold"] == 0.05 and "author" not in store.metadata


_CARD_WRITER = """
import sys
from her_store import EpisodeStore
store = EpisodeStore.open(sys.argv[1], mode="a")
i = 0
while True:
    i += 1
    store.update_metadata(counter=i, description=str(i % 10) * 400_000)
    if i == 3:
        print("writing", flush=True)
"""


def test_kill_during_card_writes_never_tears_the_card(tmp_path):
    path = str(tmp_path / "s")
    _image_store(path, [3, 4])
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", _CARD_WRITER, path], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            assert proc.stdout.readline() == "writing\n"
            seen, cards, deadline = 0, set(), time.monotonic() + 300
            while len(cards) < 5:  # a reader meanwhile finds the old card or the new, whole, as they change
                assert proc.poll() is None and time.monotonic() < deadline, f"cards seen: {sorted(cards)}"
                with EpisodeStore.open(path) as store:
                    card = store.metadata
                    assert card["counter"] >= seen and card["description"] == str(card["counter"] % 10) * 400_000
                    assert store.num_episodes == 2
                    seen = card["counter"]
                    cards.add(seen)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        with EpisodeStore.open(path) as store:
            card = store.metadata
            assert card["counter"] >= seen and card["description"] == str(card["counter"] % 10) * 400_000
        with EpisodeStore.open(path, mode="a") as store:  # the next writer removes what the killed write left
            assert [n for n in os.listdir(path) if n.endswith((".tmp", ".partial"))] == []
            store.update_metadata(counter=0)


def test_a_hostile_card_still_opens_and_inspects(tmp_path, capsys):
    path = str(tmp_path / "s")
    _image_store(path, [3, 5])
    meta = os.path.join(path, "zarr.json")
    doc = json.loads(_zarr_json(path))
    hostile = {
        "description": "x" * 5_000_000, "ref_min_score": "low", "goal_keys": ["a", "b", "c"], "author": 7,
        "score": float("nan"), "license": "\x1b[2J\x1b[31mMIT", "code_permalink": "[bold red]see[/]",
        "reward_function": "os:system; rm -rf", "versions": {"a": 1}, "nested": {"deep": [[[1]]]},
    }
    doc["attributes"]["her_store"]["metadata"] = hostile
    with open(meta, "w") as f:
        json.dump(doc, f)  # NaN written as JSON's non-standard NaN, as a careless writer would
    with EpisodeStore.open(path) as store:
        card = store.metadata
        assert card["description"] == hostile["description"] and card["author"] == 7 and np.isnan(card["score"])
        card["nested"]["deep"].append(2)
        assert store.metadata["nested"] == {"deep": [[[1]]]}  # a copy: changing it changes nothing
    s = _json(capsys, "inspect", path, "--json")
    assert s["card"]["score"] is None and s["card"]["description"] == hostile["description"] and s["episodes"] == 2
    warned = " ".join(s["card_warnings"])
    for field in ("'description'", "'ref_min_score'", "'goal_keys'", "'author'", "'score'", "'reward_function'",
                  "'versions'"):
        assert field in warned
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out, repr(out[out.find("\x1b") - 300 : out.find("\x1b") + 50])
    assert "(5,000,000 characters)" in out and len(out) < 20_000
    assert out.count("warning: ") == 7 and "[bold red]see[/]" in out
    # an edit must leave a valid card: refused while an odd field stays, accepted once every one is fixed
    assert main(["card", path, "--set", "license=MIT"]) == 2
    assert "'description'" in capsys.readouterr().err
    fix = ["description=short", "ref_min_score=0", "goal_keys=", "author=Ada", "score=", "reward_function=",
           "versions=", "license=MIT"]
    assert main(["card", path, *(a for x in fix for a in ("--set", x))]) == 0
    with EpisodeStore.open(path) as store:
        assert store.metadata == {"description": "short", "ref_min_score": 0, "author": "Ada", "license": "MIT",
                                  "code_permalink": "[bold red]see[/]", "nested": {"deep": [[[1]]]}}


@pytest.mark.slow
def test_inspect_and_card_on_s3(s3_url, capsys):
    url, opts = s3_url
    obs, act = fetch_spaces()
    with EpisodeStore.create(url, obs, act, storage_options=opts, chunk_rows=16, metadata=CARD) as store:
        for i in range(3):
            store.append_episode(make_episode(obs, act, 10 + i, seed=i))
    options = json.dumps(opts)
    assert main(["card", url, "--storage-options", options, "--set", "license=MIT"]) == 0
    capsys.readouterr()
    s = _json(capsys, "inspect", url, "--storage-options", options, "--json")
    assert s["transitions"] == 33 and s["card"] == {**CARD, "license": "MIT"}
    import s3fs

    fs = s3fs.S3FileSystem(**opts)
    root = url[len("s3://"):]
    listed = {k: v for k, v in fs.du(root, total=False).items() if "/c/" in k}
    assert s["bytes_on_disk"] == s["apparent_bytes"] == sum(listed.values()) > 0  # an object holds its every byte


@pytest.mark.slow
def test_image_shards_are_counted_alike_on_disk_on_s3_and_in_a_pack(tmp_path, s3_url, capsys):
    """Shard files are named c.<i>.0.0.0 beside the array's metadata: each listing (a directory scan, an S3 listing,
    a pack's members) counts them, and the same bytes."""
    import s3fs

    from her_store.ops.copy import copy_store
    from her_store.ops.pack import pack_store
    from her_store.ops.verify import verify

    path = str(tmp_path / "s")
    _image_store(path, [5, 17, 1, 40])
    shards = os.path.join(path, "steps", "observation")
    on_disk = sum(os.path.getsize(os.path.join(shards, n)) for n in os.listdir(shards) if n.startswith("c."))
    # files named almost like shards are no shards: a number written otherwise, too few axes, a temp file
    for name in ("c.05.0.0.0", "c.9.0.0", "c.9", "c.\u00b2.0.0.0", "c.9.0.0.0.17.tmp"):
        Path(shards, name).write_bytes(b"x" * 1000)
    url, opts = s3_url
    copy_store(path, url, dest_storage_options=opts)
    fs = s3fs.S3FileSystem(**opts)
    for name in ("c.05.0.0.0", "c.\u00b2.0.0.0"):
        fs.pipe_file(f"{url[len('s3://'):]}/steps/observation/{name}", b"x" * 1000)
    pack_store(path, path + ".zip")
    for where, extra in ((path, []), (url, ["--storage-options", json.dumps(opts)]), (path + ".zip", [])):
        s = _json(capsys, "inspect", where, "--json", *extra)
        fields = {f["name"]: f for f in s["fields"]}
        assert fields["observation"]["apparent_bytes"] == on_disk > 0, where
        report = verify(where, storage_options=opts if extra else None)
        assert report.clean and report.episodes == 4, report.summary()
