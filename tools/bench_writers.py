"""The aggregate append rate of N writer processes, each into its own shard of one sharded dataset (tools/bench.py's
``writers`` figure).

N = 1, 2 and 4 writers append FetchReach-shaped 50-step episodes as fast as they can for a fixed time, on local disk
and on S3 (moto's server on loopback, in its own process), with ``commit_interval=1``; the rate counts the episodes
committed once every writer has closed (its last commit included). On S3 each writer also counts the requests it
makes (s3fs logs every call it makes to S3 at DEBUG level): per commit and for creating its shard.

    python tools/bench_writers.py [--quick]        # or: python tools/bench.py --only writers
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EP_LEN = 50
WRITERS = (1, 2, 4)
COMMIT_INTERVAL = 1.0
# s3fs call names by request kind
_KINDS = {"put_object": "PUT", "get_object": "GET", "head_object": "HEAD", "list_objects_v2": "LIST"}


class _S3Calls(logging.Handler):
    """Counts the S3 calls s3fs makes (its ``CALL: <method> - <args> - <kwargs>`` debug lines) by kind, and the
    commits (PUTs of a commit record)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("CALL") or len(record.args or ()) < 3:
            return
        method, _, kwargs = record.args[:3]  # type: ignore[index]
        self.counts[_KINDS.get(method, method)] += 1
        if method == "put_object" and str(kwargs.get("Key", "")).endswith("/commit.json"):
            self.counts["commits"] += 1


def writer(root: str, shard: str, seconds: float, options: dict[str, Any] | None) -> dict[str, Any]:
    """One writer process: open its shard, say ``ready``, wait for a line on stdin, append episodes for ``seconds``,
    close; returns what it did (its requests too, on object storage)."""
    import numpy as np
    from bench import ACT, OBS, fetch_episode  # tools/bench.py: the FetchReach-shaped episodes of every figure

    from her_store import open_store

    calls = _S3Calls()
    log = logging.getLogger("s3fs")
    log.addHandler(calls)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    rng = np.random.default_rng(int(shard.rsplit("-", 1)[1]))
    pool = [fetch_episode(rng, EP_LEN) for _ in range(64)]
    store = open_store(root, OBS, ACT, shard=shard, commit_interval=COMMIT_INTERVAL, storage_options=options)
    calls.counts.pop("commits", None)  # the create's own commit record is one of its PUTs
    create = dict(calls.counts)
    calls.counts.clear()
    print("ready", flush=True)
    sys.stdin.readline()
    t = time.perf_counter()
    n = 0
    while time.perf_counter() - t < seconds:
        store.append_episode(pool[n % len(pool)])
        n += 1
    store.close()
    return {
        "episodes": n,
        "transitions": n * EP_LEN,
        "seconds": time.perf_counter() - t,
        "create": create,
        "run": dict(calls.counts),
    }


def _run(root: str, n: int, seconds: float, options: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``n`` writer processes into ``root``, started together once each has opened its shard."""
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--writer", root, f"actor-{k}", str(seconds),
             json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        for k in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", "a writer failed to open its shard"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=seconds + 300)
            if p.returncode != 0:
                raise RuntimeError(f"a writer process exited with {p.returncode}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _commit_bytes(shard: str, options: dict[str, Any]) -> int:
    """Bytes one commit of a shard on object storage PUTs: a commit rewrites the current chunk of each array whole
    (data and index columns; an object cannot be appended to), so this is one chunk object of each array."""
    import s3fs

    from her_store.format.keys import is_chunk_key

    fs = s3fs.S3FileSystem(**options)
    largest: dict[str, int] = {}
    prefix = shard.split("://", 1)[-1].rstrip("/") + "/"  # fsspec lists keys without the protocol
    for path, info in fs.find(shard, detail=True).items():
        key = path[len(prefix) :]
        if path.startswith(prefix) and is_chunk_key(key):  # <array>/c/<i>/... or <array>/c.<i>.0...
            array = key.partition("/c/")[0] if "/c/" in key else key.rpartition("/")[0]
            largest[array] = max(largest.get(array, 0), int(info["size"]))
    return sum(largest.values()) + len(fs.cat_file(f"{shard}/commit.json"))


def bench_writers(workdir: str, quick: bool) -> dict[str, Any]:
    """N writer processes (1, 2, 4), one shard each, local disk and S3 (loopback): aggregate appends/s, scaling."""
    seconds = 3.0 if quick else 15.0
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        os.environ.setdefault(k, v)  # moto accepts any credentials; the writer processes inherit these
    out: dict[str, Any] = {"seconds per run": seconds, "commit_interval s": COMMIT_INTERVAL, "cores": os.cpu_count()}
    from bench import moto_s3  # tools/bench.py, which imports this module

    with moto_s3() as opts:
        for where in ("local", "s3"):
            base = None
            for n in WRITERS:
                root = os.path.join(workdir, f"writers-{n}") if where == "local" else f"s3://bench/writers-{n}"
                runs = _run(root, n, seconds, None if where == "local" else opts)
                wall = max(r["seconds"] for r in runs)
                episodes = sum(r["episodes"] for r in runs)
                rate = sum(r["transitions"] for r in runs) / wall
                base = base or rate
                out[f"{where} N={n} transitions/s"] = rate
                out[f"{where} N={n} episodes/s"] = episodes / wall
                out[f"{where} N={n} / N=1"] = rate / base
                if where == "s3":
                    run = collections.Counter()
                    for r in runs:
                        run.update(r["run"])
                    commits = max(run.pop("commits", 0), 1)
                    out[f"s3 N={n} commits/s per writer"] = commits / n / wall
                    out[f"s3 N={n} requests per commit"] = " ".join(
                        f"{k}={v / commits:.1f}" for k, v in sorted(run.items())
                    )
                    if n == 1:
                        out["s3 requests to create a shard"] = " ".join(
                            f"{k}={v}" for k, v in sorted(runs[0]["create"].items())
                        )
                        out["s3 bytes PUT per commit"] = _commit_bytes(f"{root}/shards/actor-0", opts)
                else:
                    shutil.rmtree(root)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--writer"]:
        root, shard, secs, options = sys.argv[2:6]
        print(json.dumps(writer(root, shard, float(secs), json.loads(options))))
    else:
        import tempfile

        workdir = tempfile.mkdtemp(prefix="her_store_bench_")
        try:
            print(json.dumps(bench_writers(workdir, "--quick" in sys.argv), indent=1))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
