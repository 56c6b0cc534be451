"""moto's S3 server on loopback, in its own process, for the tests of stores on object storage and for
tools/bench.py (a server thread inside the process would share its interpreter with the code under test)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["CREDENTIALS", "moto_server"]

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_server(timeout: float = 180.0) -> Iterator[str]:
    """Start ``python -m moto.server`` on a free loopback port; yields its endpoint URL, stops it on exit.

    Raises
    ------
    RuntimeError
        The server exited, or did not accept connections within ``timeout`` seconds.
    """
    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's S3 server did not start (exit status {server.poll()})")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait()
