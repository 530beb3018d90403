"""An object-store endpoint for refusal tests: an ``http://`` asset root (obstore's HTTP store) on
127.0.0.1 that holds nothing and, for chosen images, is unreachable.

Every ``GET``/``HEAD`` is answered 404 (the root holds nothing: refs resolve as without it), except
for a key naming a content in :attr:`KeyFaultStore.dead`, where the connection is dropped without
an answer, every time: the server's retries all fail and the read ends ``store_unavailable``
(503), as for an endpoint that is down. One process-wide server, threads, stopped with the test.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["KeyFaultStore"]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _answer(self) -> None:
        if any(sha16 in self.path for sha16 in self.server.dead):
            self.close_connection = True  # no status line: the client sees the connection closed
            return
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _answer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        return


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    dead: set[str]


class KeyFaultStore:
    """The endpoint; :attr:`url` + a prefix is the root (``http://127.0.0.1:PORT/store``)."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.dead = set()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def kill(self, sha256: str) -> None:
        """Make the image with this sha256 unreachable (its key holds ``sha256[:16]``)."""
        self._server.dead.add(sha256[:16])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
