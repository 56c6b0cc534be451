"""A static file server on loopback with what a remote store reader uses (ETag, If-Match, Range), for the tests
of stores over HTTP and for tools/bench.py."""

from __future__ import annotations

import http.server
import os
import re

__all__ = ["RangeHandler", "Server"]


class RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with what a remote reader uses: ETag, If-Match (412) and one Range per GET (206)."""

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return
        st = os.stat(path)
        etag = f'"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"'
        if self.headers.get("If-Match") not in (None, etag, "*"):
            self.send_error(412)
            return
        size = st.st_size
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", ""))
        status, a, b = 200, 0, size
        if m and (m[1] or m[2]):
            a, b = (int(m[1]), min(size, int(m[2]) + 1 if m[2] else size)) if m[1] else (max(0, size - int(m[2])), size)
            if a >= size:
                self.send_error(416)
                return
            status = 206
        self.send_response(status)
        self.send_header("ETag", etag)
        self.send_header("Content-Length", str(b - a))
        if status == 206:
            self.send_header("Content-Range", f"bytes {a}-{b - 1}/{size}")
        self.end_headers()
        with open(path, "rb") as f:
            self.wfile.write(os.pread(f.fileno(), b - a, a))


class Server(http.server.ThreadingHTTPServer):
    request_queue_size = 128  # socketserver's 5 drops the SYNs of a gather's concurrent GETs (a 1 s retransmit)
