"""A static file server on loopback with what a remote store reader uses (ETag, If-Match, Range): the server of
tools/bench.py's remote sampling and of the tests of stores over HTTP (tests/http_server.py serves with it)."""

from __future__ import annotations

import http.server
import os
import re

__all__ = ["RangeHandler", "Server"]


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with what a remote reader uses: ETag, If-Match (412) and one Range per GET (206)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self, body: bool = True) -> None:
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        with open(path, "rb") as f:  # opened before its stat: a file replaced meanwhile is served whole, old or new
            self._send(f.fileno(), body)

    def do_HEAD(self) -> None:
        """GET's headers (ETag included, as servers send them), without its body (hostile subclasses' GETs aside)."""
        RangeHandler.do_GET(self, body=False)

    def asked(self, size: int) -> tuple[int, int] | None:
        """The bytes ``a .. b`` (end exclusive) the request's Range asks of an object of ``size`` bytes, cut at its
        end (None: no Range, the whole object)."""
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        if m is None or not (m[1] or m[2]):
            return None
        return (int(m[1]), min(size, int(m[2]) + 1 if m[2] else size)) if m[1] else (max(0, size - int(m[2])), size)

    def _send(self, fd: int, body: bool) -> None:
        st = os.fstat(fd)
        etag = f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'
        if self.headers.get("If-Match") not in (None, etag, "*"):
            self.send_error(412)
            return
        size = st.st_size
        asked = self.asked(size)
        status, (a, b) = (200, (0, size)) if asked is None else (206, asked)
        if asked is not None and a >= size:
            self.send_error(416)
            return
        self.send_response(status)
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(b - a))
        if status == 206:
            self.send_header("Content-Range", f"bytes {a}-{b - 1}/{size}")
        self.end_headers()
        if body:
            self.wfile.write(os.pread(fd, b - a, a))


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # socketserver's 5 drops the SYNs of a gather's concurrent GETs (a 1 s retransmit)
