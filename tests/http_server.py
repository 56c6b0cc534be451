"""The static file server of tools/http_server.py on loopback, in threads of the test's process, for the tests of
stores over HTTP."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

from tools.http_server import RangeHandler, Server

__all__ = ["RangeHandler", "Server", "serving"]


@contextlib.contextmanager
def serving(directory: str, handler: type[RangeHandler] = RangeHandler) -> Iterator[str]:
    """Serve ``directory`` from a Server on loopback, in threads of this process, for the block; its base URL. The
    test skips without aiohttp, which her_store reads HTTP through (an optional dependency)."""
    import pytest

    pytest.importorskip("aiohttp", reason='pip install "her_store[http]"')
    server = Server(("127.0.0.1", 0), functools.partial(handler, directory=directory))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
