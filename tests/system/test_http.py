"""Stores opened in place over HTTP (a real http.server on loopback) and read-only over S3: episodes bit-exact,
sampling through the cache, ranged and conditional reads, no writes, and a hostile server's answers refused."""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
from gymnasium import spaces

from her_store import EpisodeStore
from her_store.errors import CorruptStoreError, ReadOnlyStoreError
from her_store.sampling.sampler import HerSampler
from her_store.store.cached_rows import RangedArray
from her_store.store.frame_rows import FrameArray
from tests.conftest import ROOT, assert_episode_equal, fetch_spaces, make_episode, remote_handle_forks
from tests.http_server import RangeHandler, Server

pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')


class PlainHandler(http.server.SimpleHTTPRequestHandler):
    """python's own file server: no Range, no ETag."""

    def log_message(self, *args: object) -> None:
        pass


class GarbageHandler(RangeHandler):
    """Every object's bytes replaced by noise of the same length, except the two records that get a store opened."""

    def do_GET(self) -> None:
        if self.path.endswith(".json"):
            super().do_GET()
            return
        n = os.path.getsize(self.translate_path(self.path)) if os.path.isfile(self.translate_path(self.path)) else 64
        body = np.random.default_rng(0).integers(0, 256, min(n, 1 << 16), np.uint8).tobytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class TruncatingHandler(RangeHandler):
    """Announces a body's length, sends half of it, then closes the connection."""

    def do_GET(self) -> None:
        path = self.translate_path(self.path)
        if self.path.endswith("zarr.json") or not os.path.isfile(path):
            super().do_GET()
            return
        with open(path, "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.close_connection = True


@pytest.fixture
def serve():
    """serve(directory, handler) -> base URL of a threaded HTTP server on loopback; all stopped at teardown."""
    servers = []

    def start(directory: str, handler: type = RangeHandler) -> str:
        server = Server(("127.0.0.1", 0), functools.partial(handler, directory=directory))
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


IMAGE_OBS = spaces.Dict(
    {
        "observation": spaces.Box(0, 255, (3, 24, 24), np.uint8),
        "achieved_goal": spaces.Box(-1, 1, (3,), np.float32),
        "desired_goal": spaces.Box(-1, 1, (3,), np.float32),
    }
)


def _fill(path: str, obs: spaces.Dict, act: spaces.Space, n: int, **kw) -> None:
    with EpisodeStore.create(path, obs, act, info_keys=["is_success"], **kw) as s:
        for i in range(n):
            s.append_episode(make_episode(obs, act, 5 + i % 17, i, ("is_success",)))


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """A low-dimensional store with the default local chunks (1,048,576 rows) and an image store (LZ4 shards)."""
    root = tmp_path_factory.mktemp("served")
    obs, act = fetch_spaces()
    _fill(str(root / "low"), obs, act, 40)
    _fill(str(root / "img"), IMAGE_OBS, act, 40)
    return str(root)


def _reward(a, d, infos):
    return -(np.linalg.norm(a - d, axis=-1) > 0.05).astype(np.float32)


@pytest.mark.parametrize("name", ["low", "img"])
def test_a_store_served_over_http_reads_bit_exact_and_samples(stores, serve, name):
    base = serve(stores)
    with EpisodeStore.open(f"{base}/{name}") as remote, EpisodeStore.open(f"{stores}/{name}") as local:
        assert remote.schema.fields == local.schema.fields and remote.metadata == local.metadata
        np.testing.assert_array_equal(remote.episodes["crc32"], local.episodes["crc32"])
        assert remote.backend.ranged
        for i in range(local.num_episodes):
            assert_episode_equal(remote.episode(i), local.episode(i))
        with HerSampler(remote, 256, reward_fn=_reward, seed=1) as sampler:
            kinds = {type(a) for a in sampler.reader.arrays.values()}
            assert RangedArray in kinds and (FrameArray in kinds) == (name == "img")
            episodes = {i: local.episode(i) for i in range(local.num_episodes)}
            for _ in range(3):
                b = sampler.sample()
                for j, (e, t) in enumerate(zip(b.episode_ids.tolist(), b.steps.tolist())):
                    ep = episodes[e]
                    np.testing.assert_array_equal(b.observations["observation"][j].numpy(), ep["observation"][t])
                    np.testing.assert_array_equal(
                        b.next_observations["observation"][j].numpy(), ep["observation"][t + 1]
                    )
                    np.testing.assert_array_equal(b.actions[j].numpy(), ep["action"][t])
                    np.testing.assert_array_equal(b.observations["achieved_goal"][j].numpy(), ep["achieved_goal"][t])
            blocks = sampler.reader.arrays["packs/float32"]
            # a 1,048,576-row chunk is read as ~1 MiB blocks by range: only the one block holding the rows
            assert blocks.chunk_rows < local.layout.arrays[0].chunk_rows and blocks.misses == 1
            if name == "img":
                frames = sampler.reader.arrays["steps/observation"]
                assert frames._ranged is True  # the server honours If-Match: frames are read by conditional ranges


def test_a_server_without_range_or_etag_still_serves_whole_objects(stores, serve):
    base = serve(stores, PlainHandler)
    with EpisodeStore.open(f"{base}/img") as remote, EpisodeStore.open(f"{stores}/img") as local:
        assert not remote.backend.ranged
        assert_episode_equal(remote.episode(3), local.episode(3))
        with HerSampler(remote, 256, reward_fn=_reward, seed=1) as sampler:
            b = sampler.sample()
            frames = sampler.reader.arrays["steps/observation"]
            assert frames._ranged is False
            for j, (e, t) in enumerate(zip(b.episode_ids.tolist()[:32], b.steps.tolist()[:32])):
                np.testing.assert_array_equal(
                    b.observations["observation"][j].numpy(), local.episode(e)["observation"][t]
                )


def test_a_store_served_over_http_created_again_under_a_reader_is_refused(tmp_path, serve):
    """A served store deleted and created again (a published dataset replaced) under an open reader: refresh says so
    (the root object's ETag, then its created_at) rather than pair the new index with chunks it cached."""
    obs, act = fetch_spaces()
    path = tmp_path / "pub"
    _fill(str(path / "s"), obs, act, 4)
    base = serve(str(path))
    with EpisodeStore.open(f"{base}/s") as reader:
        assert reader.num_episodes == 4 and reader.refresh() == 0
        shutil.rmtree(path / "s")
        _fill(str(path / "s"), obs, act, 6)
        with pytest.raises(CorruptStoreError, match="created again since this handle opened it"):
            reader.refresh()


class SlowIndexHandler(RangeHandler):
    """A distant server, once ``armed``: each GET of an index column's chunk is held until ``hold`` of them are in
    flight at once, counting the most in flight. A client asking for them one after the other has its first answer
    held for ``patience`` seconds, and the rest not (the test then fails on the count, not on a timeout)."""

    cond = threading.Condition()
    armed = False
    hold, patience = 5, 30.0
    in_flight = most = 0

    def do_GET(self, body: bool = True) -> None:
        cls = type(self)
        if not cls.armed or "/episodes/" not in self.path or self.path.endswith("zarr.json"):
            super().do_GET(body)
            return
        with cls.cond:
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
            cls.cond.notify_all()
            if not cls.cond.wait_for(lambda: cls.most >= cls.hold, timeout=cls.patience):
                cls.armed = False
        try:
            super().do_GET(body)
        finally:
            with cls.cond:
                cls.in_flight -= 1


def test_a_refresh_over_http_reads_the_index_columns_at_once(tmp_path, serve):
    """A reader's refresh reads the new rows of all ten index columns in one round of requests, not ten rounds one
    after the other: each round is a round trip to the server, every second for a sampler on object storage."""
    obs, act = fetch_spaces()
    _fill(str(tmp_path / "s"), obs, act, 4)
    base = serve(str(tmp_path), SlowIndexHandler)
    with EpisodeStore.open(f"{base}/s") as reader, EpisodeStore.open(str(tmp_path / "s"), mode="a") as writer:
        for i in range(3):
            writer.append_episode(make_episode(obs, act, 7, 100 + i, ("is_success",)))
        writer.flush()
        SlowIndexHandler.most, SlowIndexHandler.armed = 0, True
        assert reader.refresh() == 3
        SlowIndexHandler.armed = False
        assert reader.num_episodes == 7
        assert_episode_equal(reader.episode(6), make_episode(obs, act, 7, 102, ("is_success",)))
    assert SlowIndexHandler.most >= 5, f"at most {SlowIndexHandler.most} index requests were in flight at once"


class OutageHandler(RangeHandler):
    """Answers 503 for the root zarr.json while the class's ``down`` is set (a passing outage)."""

    down = False

    def do_GET(self, body: bool = True) -> None:
        if type(self).down and self.path.endswith("/zarr.json") and self.path.count("/") == 2:
            self.send_error(503)
            return
        super().do_GET(body)

    def do_HEAD(self) -> None:
        self.do_GET(body=False)


def test_a_passing_outage_of_the_root_object_is_no_removed_store(tmp_path, serve):
    """The root zarr.json unreachable for a while (503) is nothing to tell a store by: refresh goes on from the
    commit record rather than call the store removed, and still refuses a store created again afterwards."""
    obs, act = fetch_spaces()
    _fill(str(tmp_path / "s"), obs, act, 4)
    base = serve(str(tmp_path), OutageHandler)
    with EpisodeStore.open(f"{base}/s") as reader:
        OutageHandler.down = True
        try:
            assert reader.refresh() == 0 and reader.num_episodes == 4
        finally:
            OutageHandler.down = False
        shutil.rmtree(tmp_path / "s")
        _fill(str(tmp_path / "s"), obs, act, 6)
        with pytest.raises(CorruptStoreError, match="created again"):
            reader.refresh()


def test_a_store_over_http_is_never_written(stores, serve):
    base = serve(stores)
    before = sorted((d, f, os.path.getmtime(os.path.join(d, f))) for d, _, fs in os.walk(stores) for f in fs)
    with pytest.raises(ReadOnlyStoreError, match="HTTP, which is read-only"):
        EpisodeStore.open(f"{base}/low", mode="a")
    obs, act = fetch_spaces()
    with pytest.raises(ReadOnlyStoreError, match="read-only"):
        EpisodeStore.create(f"{base}/new", obs, act)
    with EpisodeStore.open(f"{base}/low") as remote, pytest.raises(ReadOnlyStoreError):
        remote.append_episode(make_episode(obs, act, 3, 0, ("is_success",)))
    after = sorted((d, f, os.path.getmtime(os.path.join(d, f))) for d, _, fs in os.walk(stores) for f in fs)
    assert after == before


class RedirectLoopHandler(RangeHandler):
    """Answers every request for a chunk with a redirect to itself; metadata is served as it is."""

    def do_GET(self, body: bool = True) -> None:
        if "/c/" in self.path:
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET(body)


def test_a_server_that_redirects_in_a_loop_is_an_error_saying_so(stores, serve):
    """aiohttp gives up after its redirects with an error whose text is empty: the error names the URL and the loop."""
    base = serve(stores, RedirectLoopHandler)
    with pytest.raises(OSError, match=r"GET http://.+/c/\S+ failed: redirected \d+ times \(a redirect loop\?\)"):
        with EpisodeStore.open(f"{base}/low") as store:
            store.episode(0)


class ShiftedRangeHandler(RangeHandler):
    """Answers a range that starts past byte 0 with the bytes one before it, and a Content-Range that says so."""

    def do_GET(self) -> None:
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if m is None or int(m[1]) == 0:
            super().do_GET()
            return
        path = self.translate_path(self.path)
        size, a, b = os.path.getsize(path), int(m[1]) - 1, int(m[2]) - 1
        self.send_response(206)
        self.send_header("Content-Length", str(b - a + 1))
        self.send_header("Content-Range", f"bytes {a}-{b}/{size}")
        self.end_headers()
        with open(path, "rb") as f:
            self.wfile.write(os.pread(f.fileno(), b - a + 1, a))


def test_a_range_other_than_the_one_asked_for_is_refused(stores, serve):
    base = serve(stores, ShiftedRangeHandler)
    with EpisodeStore.open(f"{base}/low") as remote:
        key = "packs/float32/c/0/0"
        assert remote.backend.read_ranges([key], [0], [8])[0] == open(f"{stores}/low/packs/float32/c/0/0", "rb").read(8)
        with pytest.raises(CorruptStoreError, match="the range asked for"):
            remote.backend.read_ranges([key], [100], [164])


@pytest.mark.parametrize("handler", [GarbageHandler, TruncatingHandler])
def test_a_hostile_server_gives_corrupt_store_error(stores, serve, handler):
    base = serve(stores, handler)
    with pytest.raises(CorruptStoreError), EpisodeStore.open(f"{base}/img") as remote:
        remote.episode(0)
        with HerSampler(remote, 256, reward_fn=_reward) as sampler:
            sampler.sample()


@pytest.mark.slow
def test_a_read_only_open_on_s3_writes_nothing(s3_url):
    import s3fs

    url, opts = s3_url
    act = fetch_spaces()[1]
    _fill(url, IMAGE_OBS, act, 12, storage_options=opts)
    fs = s3fs.S3FileSystem(**opts)
    root = url[len("s3://") :]
    before = {k: v["ETag"] for k, v in fs.find(root, detail=True).items()}
    with EpisodeStore.open(url, storage_options=opts) as store:
        with HerSampler(store, 256, reward_fn=_reward, seed=0) as sampler:
            b = sampler.sample()
            e, t = int(b.episode_ids[0]), int(b.steps[0])
            np.testing.assert_array_equal(b.observations["observation"][0].numpy(), store.episode(e)["observation"][t])
        with pytest.raises(ReadOnlyStoreError):
            store.append_episode(make_episode(IMAGE_OBS, act, 3, 0, ("is_success",)))
    fs.invalidate_cache()
    assert {k: v["ETag"] for k, v in fs.find(root, detail=True).items()} == before


def test_a_store_served_over_http_copies_to_local_disk(stores, serve, tmp_path):
    from her_store.ops.copy import copy_store

    base = serve(stores)
    r = copy_store(f"{base}/img", str(tmp_path / "img"))
    assert r.episodes == 40 and r.passes == 1
    with EpisodeStore.open(str(tmp_path / "img")) as copy, EpisodeStore.open(f"{stores}/img") as local:
        assert copy.metadata == local.metadata and copy.commit_record == local.commit_record
        for i in range(local.num_episodes):
            assert_episode_equal(copy.episode(i), local.episode(i))


class PaddedHandler(RangeHandler):
    """Ignores Range: every object but the JSON records whole, followed by 32 MiB of zeros; records, per GET, the
    bytes its client took before it closed the connection."""

    sent: ClassVar[list[int]] = []

    def do_GET(self, body: bool = True) -> None:
        path = self.translate_path(self.path)
        if self.path.endswith(".json") or not os.path.isfile(path) or not body:
            super().do_GET(body)
            return
        with open(path, "rb") as f:
            data = f.read()
        pad = 32 << 20
        self.send_response(200)
        self.send_header("Content-Length", str(len(data) + pad))
        self.end_headers()
        out = 0
        try:
            self.wfile.write(data)
            out += len(data)
            zeros = bytes(1 << 20)
            for _ in range(pad >> 20):
                self.wfile.write(zeros)
                out += len(zeros)
        except OSError:  # the client closed the connection
            pass
        finally:
            type(self).sent.append(out)


def test_a_whole_object_sent_for_a_range_is_read_no_further_than_the_range(stores, serve):
    """A server that ignores Range and sends more than the object (here 32 MiB past each one) was read to the end
    of its answer, up to 1 GiB a GET, ten index columns at once: an open grew to 10 GB. A ranged GET answered with a
    whole object now reads it no further than the range's end, and the rows are the store's."""
    base = serve(stores, PaddedHandler)
    PaddedHandler.sent.clear()
    with EpisodeStore.open(f"{base}/low") as remote, EpisodeStore.open(f"{stores}/low") as local:
        assert_episode_equal(remote.episode(7), local.episode(7))
        with HerSampler(remote, 64, reward_fn=_reward, seed=1) as sampler:
            b = sampler.sample()
            for j, (e, t) in enumerate(zip(b.episode_ids.tolist()[:16], b.steps.tolist()[:16])):
                np.testing.assert_array_equal(
                    b.observations["observation"][j].numpy(), local.episode(e)["observation"][t]
                )
    assert PaddedHandler.sent and max(PaddedHandler.sent) < 16 << 20, sorted(PaddedHandler.sent)[-3:]


# Opens a store by URL and samples one batch in a process of its own under an address-space cap, whatever the
# server sends: prints what it raised (or None) and how far its peak RSS rose above what it held before opening.
BOUNDED_SAMPLE = """
import json, resource, sys
import numpy as np
from her_store import EpisodeStore, HerSampler, StoreError

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

url, batch = sys.argv[1], int(sys.argv[2])
before = status("VmRSS")
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (2 << 30), hard))
got = {"error": None}
try:
    with EpisodeStore.open(url) as store, HerSampler(
        store, batch, reward_fn=lambda a, d, i: -(np.linalg.norm(a - d, axis=-1) > 0.05).astype(np.float32), seed=0
    ) as sampler:
        sampler.sample()
except BaseException as e:
    got = {"error": type(e).__name__, "store_error": isinstance(e, StoreError), "message": str(e)}
got["grew"] = status("VmHWM") - before  # this image's peak RSS (ru_maxrss keeps the forking parent's across exec)
print(json.dumps(got))
"""


class EndlessRangeHandler(RangeHandler):
    """Answers a Range of the objects ``hostile`` matches (a pattern of "<path> <Range>") with 206 and exactly the
    Content-Range asked for, then zeros without end (no Content-Length: the body would end with the connection)."""

    hostile: ClassVar[str] = "$^"

    def do_GET(self, body: bool = True) -> None:
        path = self.translate_path(self.path)
        rng = self.headers.get("Range", "")
        if not body or not rng or not os.path.isfile(path) or not re.search(self.hostile, f"{self.path} {rng}"):
            super().do_GET(body)
            return
        size = os.path.getsize(path)
        a, b = self.asked(size) or (0, size)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {a}-{b - 1}/{size}")
        self.end_headers()
        zeros = bytes(1 << 16)
        with contextlib.suppress(OSError):  # until the client closes the connection
            while True:
                self.wfile.write(zeros)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("hostile", "batch"),
    [
        (r"^/img/zarr\.json bytes=0-0$", 256),  # the probe of whether the server honours Range
        (r"^/img/episodes/\w+/c/", 256),  # the ten index columns, read together at open
        (r"^/img/packs/", 256),  # a batch's low-dimensional rows, ~1 MiB blocks read together
        (r"^/img/steps/.* bytes=\d+-\d+$", 1),  # a batch's frames (one row: one range of its shard)
    ],
    ids=["probe", "index", "rows", "frames"],
)
def test_an_endless_206_body_is_read_no_further_than_the_range(stores, serve, hostile, batch):
    """A server that names exactly the range asked for in Content-Range, then never ends the body: each ranged GET
    was read up to 1 GiB (the probe, index columns and rows; a shard's bound for frames), several at once, and a
    sample grew past 5 GB to MemoryError. The body is now read no further than its range (and a byte), and the
    reader gets a CorruptStoreError naming the object and the range, its memory hardly grown."""
    EndlessRangeHandler.hostile = hostile
    base = serve(stores, EndlessRangeHandler)
    run = subprocess.run(
        [sys.executable, "-c", BOUNDED_SAMPLE, f"{base}/img", str(batch)],
        check=False, capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["grew"] < 256 << 20, f"peak RSS grew by {got['grew'] / 2**20:.0f} MiB: {got}"
    assert got["error"] == "CorruptStoreError" and got["store_error"], got
    named = re.match(rf"{re.escape(base)}(/\S+): a ranged GET \((bytes=\d*-\d*)\) answered more than", got["message"])
    assert named and re.search(hostile, f"{named[1]} {named[2]}"), got["message"]  # the object and the range


class DripHandler(RangeHandler):
    """Sends an object's headers at once, then its body one byte every ``pause`` seconds (each well within the
    60 s idle timeout); sets ``closed`` when its client has closed the connection."""

    pause: ClassVar[float] = 1.0
    closed: ClassVar[threading.Event] = threading.Event()

    def do_GET(self, body: bool = True) -> None:
        path = self.translate_path(self.path)
        if not body or not os.path.isfile(path):
            super().do_GET(body)
            return
        with open(path, "rb") as f:
            data = f.read()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            for i in range(len(data)):
                self.wfile.write(data[i : i + 1])
                time.sleep(self.pause)
        except OSError:
            type(self).closed.set()


# Opens a store by URL with a 2 s request deadline; prints what that raised, then waits for its stdin to close.
DEADLINE_OPEN = """
import json, sys
from her_store import EpisodeStore, StoreError
got = {"error": None}
try:
    EpisodeStore.open(sys.argv[1], storage_options={"request_deadline": 2}).close()
except Exception as e:
    kinds = [isinstance(e, StoreError), isinstance(e, TimeoutError)]
    got = {"error": type(e).__name__, "kinds": kinds, "message": str(e)}
print(json.dumps(got), flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_a_server_that_drips_its_answer_is_given_up_at_the_request_deadline(stores, serve):
    """A server that sends a byte every second never trips the 60 s idle timeout: an open read its first record for
    the record's length in seconds (a byte every 50 s: hours). Every request has a deadline now (here 2 s, from
    storage_options): the open fails with a StoreTimeoutError naming the object and the deadline, and the
    connection is closed (the server sees it) while the reader lives on."""
    DripHandler.closed.clear()
    base = serve(stores, DripHandler)
    child = subprocess.Popen(
        [sys.executable, "-c", DEADLINE_OPEN, f"{base}/low"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    hang = threading.Timer(300, child.kill)  # without a deadline the open reads on for an hour: end it there
    hang.start()
    try:
        line = child.stdout.readline()
        assert line, f"the open never ended: {child.stderr.read()[-3000:]}"
        got = json.loads(line)
        assert got["error"] == "StoreTimeoutError" and got["kinds"] == [True, True], got
        named = rf"GET {re.escape(base)}/low/\S+: no whole answer within the request deadline of 2 s \(storage_options"
        assert re.match(named, got["message"]), got["message"]
        assert DripHandler.closed.wait(60), "the server never saw the connection closed"
    finally:
        hang.cancel()
        child.kill()
        child.communicate()


class HeaderCheckingHandler(RangeHandler):
    """Refuses (403) every request without the header ``X-Token: t``; counts the requests it answered."""

    answered: ClassVar[list[str]] = []

    def do_GET(self, body: bool = True) -> None:
        if self.headers.get("X-Token") != "t":
            self.send_error(403)
            return
        type(self).answered.append(self.command)
        super().do_GET(body)

    def do_HEAD(self) -> None:
        self.do_GET(body=False)


def test_storage_options_over_http_keep_reaching_every_request(stores, serve):
    """``request_deadline`` is the reader's own; every other storage option still goes with every request (here a
    header the server requires), and a deadline that is not a positive number of seconds is refused."""
    base = serve(stores, HeaderCheckingHandler)
    HeaderCheckingHandler.answered.clear()
    opts = {"headers": {"X-Token": "t"}, "request_deadline": 30}
    with EpisodeStore.open(f"{base}/img", storage_options=opts) as remote, EpisodeStore.open(f"{stores}/img") as local:
        assert_episode_equal(remote.episode(3), local.episode(3))
        with HerSampler(remote, 16, reward_fn=_reward, seed=0) as sampler:
            sampler.sample()
        assert remote.refresh() == 0
    assert {"GET", "HEAD"} <= set(HeaderCheckingHandler.answered)
    for bad in (0, -1, float("inf"), "30", None):
        with pytest.raises(ValueError, match="request_deadline"):
            EpisodeStore.open(f"{base}/img", storage_options={**opts, "request_deadline": bad})


def test_a_handle_and_a_sampler_over_http_read_in_a_forked_child(stores, serve):
    """Made in the parent, used in a forked child: refresh, an episode, the parent's sampler and a new one all read
    (they raised fsspec's "not fork-safe" or an aiohttp error of a future on another loop)."""
    base = serve(stores)
    remote_handle_forks(f"{base}/img", None)
