"""A real HTTP server on 127.0.0.1 in front of a real vLLM server: answers scripted faults, then proxies.

Each request to the proxy takes the next action of its script (then ``"forward"`` once the script is
spent): ``"forward"`` (send it upstream as is and answer what upstream answered), ``"503"`` /
``"429"`` (answer that status with vLLM's error body shape and ``Retry-After: 0``), ``"sleep:S"``
(wait S seconds, then forward), ``"push:V"`` (push ``weights_dir`` as version V with the plugin's
one call, ``POST /mmref/v1/weights/update``, then forward), ``"hold:V:S"`` (hold upstream for a
weight update, ``POST /mmref/v1/weights/hold``; forward the request, which waits at upstream's gate;
release as V after S seconds), ``"drain_timeout"`` (answer the plugin's 503 ``drain_timeout`` body),
``"cut"`` (forward it, then close the connection unanswered: the answer is lost).
Every request's path and headers are recorded.
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

    def __init__(self, upstream: str, script: list[str] | None = None, weights_dir: str = "") -> None:
        self.upstream = upstream
        self.weights_dir = weights_dir
        self.script = list(script or [])
        self.seen: list[tuple[str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def next_action(self, path: str, headers: dict[str, str]) -> str:
        """Record a request; its action."""
        with self._lock:
            self.seen.append((path, headers))
            return self.script.pop(0) if self.script else "forward"

    def update(self, version: str, hold_s: str | None = None) -> None:
        """The one call (``push:V``), or a hold released as ``version`` after ``hold_s`` seconds."""
        if hold_s is None:
            body = {"weights_path": self.weights_dir, "version": version, "timeout_s": 120}
            httpx.post(f"{self.upstream}/mmref/v1/weights/update", json=body, timeout=300).raise_for_status()
            return
        httpx.post(f"{self.upstream}/mmref/v1/weights/hold", json={}, timeout=300).raise_for_status()

        def release() -> None:
            time.sleep(float(hold_s))
            httpx.post(f"{self.upstream}/mmref/v1/weights/release", json={"version": version}, timeout=300)

        threading.Thread(target=release, daemon=True).start()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        action = proxy.next_action(self.path, {k.lower(): v for k, v in self.headers.items()})
        if action in ("503", "429", "drain_timeout"):
            self._answer(*_fault(action))
            return
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":", 1)[1]))
        if action.startswith(("push:", "hold:")):
            proxy.update(*action.split(":")[1:])
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
        try:
            r = httpx.post(proxy.upstream + self.path, content=body, headers=headers, timeout=600)
        except httpx.HTTPError:
            return  # the client went away (a timeout test)
        if action == "cut":
            self.close_connection = True
            return
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


def _fault(action: str) -> tuple[int, dict[str, str], bytes]:
    """A scripted error answer: vLLM's error body for ``503`` / ``429`` (with ``Retry-After: 0``),
    the plugin's for ``drain_timeout``."""
    json_type = {"content-type": "application/json"}
    if action == "drain_timeout":
        return 503, json_type, _drain_timeout_body()
    status = int(action)
    error = {"message": "scripted", "type": "ServiceUnavailableError", "param": None, "code": status}
    return status, {**json_type, "retry-after": "0"}, json.dumps({"error": error}).encode()


def _drain_timeout_body() -> bytes:
    from protocol.errors import DrainTimeout
    from vllm_plugin.protocol import error_body

    error = DrainTimeout("2 requests admitted before the update still run after 0.1 s; nothing was changed")
    return json.dumps(error_body(error, error.message)).encode()
