"""Bounded loopback load test of a running vLLM server with the mmref plugin.

Sends ``--requests`` generate requests (default 500) from ``--concurrency`` clients (default 16)
to 127.0.0.1 only: a mix of valid refs (a few images, repeated as in RL groups) and invalid ones
(hash mismatch, traversal, missing file, placeholder mismatch). Reports status counts, latency
percentiles, and the server's RSS (API server + engine processes) before and after.

Library use (the test suite): ``report = asyncio.run(run_load(url, cases, ...))``.
CLI: ``python scripts/load_test.py --url http://127.0.0.1:PORT --cases cases.json --pid PID``
where ``cases.json`` is a list of ``{"body": {...}, "expect": status}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import psutil

__all__ = ["LoadReport", "rss_bytes", "run_load"]


@dataclass
class LoadReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    unexpected: list[tuple[int, int, str]] = field(default_factory=list)
    """(expected status, got status, body prefix) for every answer that was not the expected one."""
    latencies_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    rss_before: int = 0
    rss_after: int = 0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def percentile(self, q: float) -> float:
        data = sorted(self.latencies_ms)
        return data[min(len(data) - 1, int(q * len(data)))] if data else 0.0

    def summary(self) -> str:
        rate = self.requests / max(self.wall_s, 1e-9)
        return (
            f"{self.requests} requests in {self.wall_s:.1f} s ({rate:.1f}/s); "
            f"statuses {dict(sorted(self.statuses.items()))}; unexpected {len(self.unexpected)}; "
            f"latency p50 {self.percentile(0.5):.0f} ms, p95 {self.percentile(0.95):.0f} ms, "
            f"mean {statistics.fmean(self.latencies_ms) if self.latencies_ms else 0:.0f} ms; "
            f"server RSS {self.rss_before / 2**20:.0f} -> {self.rss_after / 2**20:.0f} MiB "
            f"({(self.rss_after - self.rss_before) / 2**20:+.0f} MiB)"
        )


def rss_bytes(pid: int) -> int:
    """Resident set size of a process and all its children (the OS's accounting, via psutil)."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


async def run_load(
    url: str,
    cases: list[tuple[dict, int]],
    *,
    requests: int = 500,
    concurrency: int = 16,
    server_pid: int | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> LoadReport:
    """Send ``requests`` bodies drawn from ``cases`` (``(body, expected_status)``) with ``concurrency``.

    Raises:
        ValueError: ``url`` is not a loopback address (this tool never loads anything else).
    """
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise ValueError(f"load tests target loopback only, not {host!r}")
    rng = random.Random(seed)
    plan = [rng.choice(cases) for _ in range(requests)]
    report = LoadReport(requests=requests)
    if server_pid is not None:
        report.rss_before = rss_bytes(server_pid)
    queue: asyncio.Queue[tuple[dict, int]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)

    async def worker(client: httpx.AsyncClient) -> None:
        while True:
            try:
                body, expect = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            r = await client.post("/inference/v1/generate", json=body)
            report.latencies_ms.append((time.perf_counter() - start) * 1000)
            report.statuses[r.status_code] += 1
            if r.status_code != expect:
                report.unexpected.append((expect, r.status_code, r.text[:200]))

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), timeout_s)
    report.wall_s = time.perf_counter() - start
    if server_pid is not None:
        report.rss_after = rss_bytes(server_pid)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of {body, expect}")
    parser.add_argument("--pid", type=int, help="server pid, for RSS")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with open(args.cases) as f:
        cases = [(c["body"], int(c["expect"])) for c in json.load(f)]
    report = asyncio.run(
        run_load(args.url, cases, requests=args.requests, concurrency=args.concurrency, server_pid=args.pid)
    )
    print(report.summary())
    raise SystemExit(1 if report.server_errors or report.unexpected else 0)


if __name__ == "__main__":
    main()
