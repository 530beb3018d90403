"""Object-store roots (``protocol/roots.py``): a real S3 endpoint (moto) and a TCP proxy for its
faults."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

FIXTURE_ENV: dict[str, str] = {}
"""Variables a fixture sets in this process for as long as it lives (:meth:`MotoS3.environment`):
conftest's per-test reset of ``os.environ`` keeps them."""

__all__ = ["FIXTURE_ENV", "DelayProxy", "MotoS3"]


class MotoS3:
    """moto's standalone S3 server as its own process on 127.0.0.1 (the S3 wire protocol, request
    signing and error codes over HTTP), for obstore's real S3 client.

    :meth:`env` is what a party needs to reach it through the standard AWS environment chain.
    """

    def __init__(self, log_path: Path, *, timeout: float = 60.0) -> None:
        import subprocess
        import time

        import httpx

        from vllm_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "wb")  # closed by stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.process.returncode}: {log_path}")
            try:
                httpx.get(f"{self.url}/moto-api/", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"moto_server not up within {timeout} s") from None
                time.sleep(0.1)

    def env(self, endpoint: str | None = None) -> dict[str, str]:
        """AWS chain variables for this endpoint (or another one, e.g. a proxy in front of it)."""
        return {
            "AWS_ENDPOINT_URL": endpoint or self.url,
            "AWS_ACCESS_KEY_ID": "mmref-test-key",
            "AWS_SECRET_ACCESS_KEY": "mmref-test-secret",
            "AWS_REGION": "us-east-1",
            "MMREF_STORE_ALLOW_HTTP": "1",
        }

    @contextlib.contextmanager
    def environment(self) -> Iterator[None]:
        """:meth:`env` set in this process (the AWS chain of obstore's clients here), restored after."""
        import os

        saved = {k: os.environ.get(k) for k in self.env()}
        os.environ.update(self.env())
        FIXTURE_ENV.update(self.env())
        try:
            yield
        finally:
            for k, v in saved.items():
                FIXTURE_ENV.pop(k, None)
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def make_bucket(self, name: str) -> str:
        """Create a bucket with a plain HTTP PUT; returns ``s3://<name>``."""
        import httpx

        httpx.put(f"{self.url}/{name}", timeout=10.0).raise_for_status()
        return f"s3://{name}"

    def object_url(self, bucket: str, key: str) -> str:
        """The plain HTTP URL of an object (path style): tests delete or replace objects with it."""
        return f"{self.url}/{bucket}/{key}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except Exception:
            self.process.kill()
            self.process.wait(10)
        self._log.close()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port``, for store faults: ``delay_s`` holds
    every upstream answer that long (a slow endpoint; read at each chunk, so it may be changed
    while connections are open); :meth:`close` stops listening (endpoint down: connection
    refused), :meth:`reopen` listens again on the same port. Threads, bounded by the test's own
    timeouts; stops with the test."""

    def __init__(self, upstream_port: int, *, delay_s: float = 0.0) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.port = 0
        self._listen()
        self.url = f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        import socket
        import threading

        self._listener = socket.create_server(("127.0.0.1", self.port))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def reopen(self) -> None:
        """Listen again, on the same port (after :meth:`close`; the old listener's accept thread
        lets go of the port within moments)."""
        import time

        deadline = time.monotonic() + 5.0
        while True:
            try:
                return self._listen()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            self._sockets += [client, upstream]
            closed = self._closed
            threading.Thread(target=self._pipe, args=(client, upstream, False, closed), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True, closed), daemon=True).start()

    def _pipe(self, src, dst, delayed: bool, closed) -> None:
        try:
            while chunk := src.recv(65536):
                if delayed and self.delay_s:
                    closed.wait(self.delay_s)  # woken early by close()
                if closed.is_set():
                    return
                dst.sendall(chunk)
        except OSError:
            return
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening and drop every connection (the endpoint is down from now on)."""
        import socket

        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
