"""Client threads generating until stopped, every answer counted (the weight-push test and bench).

Each thread ``k`` calls ``send(client, k, i)`` for ``i = 0, 1, ...`` until the context exits;
``send`` returns ``(route, response)``. Answers are counted by ``"<route> <status>"`` (a transport
error by ``"<route> <exception name>"``), and 200 answers kept in order of arrival.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["Traffic"]


class Traffic:
    """``clients`` threads sending requests through ``send`` until the ``with`` block ends.

    Args:
        server: a ``vllm_server.VLLMServer`` (``client(timeout)`` makes each thread's client).
        clients: how many threads.
        send: ``(client, k, i) -> (route, httpx.Response)``; raises ``httpx.HTTPError`` when the
            server drops the connection.
        timeout: each request's timeout (seconds).
    """

    def __init__(
        self,
        server: Any,
        clients: int,
        send: Callable[[httpx.Client, int, int], tuple[str, httpx.Response]],
        timeout: float = 300,
    ) -> None:
        self.server, self.send, self.timeout = server, send, timeout
        self.counts: collections.Counter[str] = collections.Counter()
        self.answers: list[tuple[str, int, int, httpx.Response]] = []
        """``(route, k, i, response)`` of every 200 answer."""
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(clients)]

    def _run(self, k: int) -> None:
        with self.server.client(timeout=self.timeout) as c:
            i = 0
            while not self.stop.is_set():
                try:
                    route, r = self.send(c, k, i)
                except httpx.HTTPError as e:
                    self.counts[f"{k} {type(e).__name__}"] += 1
                    self.stop.wait(0.2)
                    continue
                finally:
                    i += 1
                self.counts[f"{route} {r.status_code}"] += 1
                if r.status_code == 200:
                    self.answers.append((route, k, i - 1, r))

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=self.timeout)
