"""A real HTTP server on 127.0.0.1 in front of a real vLLM server: answers scripted faults, then proxies.

Each request to the proxy takes the next action of its script (then ``"forward"`` once the script is
spent): ``"forward"`` (send it upstream as is and answer what upstream answered), ``"503"`` /
``"429"`` (answer that status with vLLM's error body shape and ``Retry-After: 0``), ``"sleep:S"``
(wait S seconds, then forward), ``"version:V"`` (set upstream's weight version to V with
``POST /update_weight_version``, then forward). Every request's path and headers are recorded.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

__all__ = ["FaultProxy"]

_KEEP = ("content-type", "x-mmref-weight-version", "retry-after")


class FaultProxy:
    """``with FaultProxy(upstream, ["503", "503"]) as proxy: ... proxy.url ...``"""

    def __init__(self, upstream: str, script: list[str] | None = None) -> None:
        self.upstream = upstream
        self.script = list(script or [])
        self.seen: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                with proxy._lock:
                    proxy.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
                    action = proxy.script.pop(0) if proxy.script else "forward"
                if action in ("503", "429"):
                    status = int(action)
                    error = {
                        "message": "scripted",
                        "type": "ServiceUnavailableError",
                        "param": None,
                        "code": status,
                    }
                    self._answer(
                        status,
                        {"content-type": "application/json", "retry-after": "0"},
                        json.dumps({"error": error}).encode(),
                    )
                    return
                if action.startswith("sleep:"):
                    time.sleep(float(action.split(":", 1)[1]))
                if action.startswith("version:"):
                    httpx.post(
                        f"{proxy.upstream}/update_weight_version",
                        json={"new_version": action.split(":", 1)[1]},
                        timeout=60,
                    ).raise_for_status()
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                try:
                    r = httpx.post(proxy.upstream + self.path, content=body, headers=headers, timeout=600)
                except httpx.HTTPError:
                    return  # the client went away (a timeout test)
                self._answer(r.status_code, {k: r.headers[k] for k in _KEEP if k in r.headers}, r.content)

            def _answer(self, status: int, headers: dict[str, str], content: bytes) -> None:
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("content-length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
