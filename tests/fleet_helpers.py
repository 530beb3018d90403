"""The fleet of ``tests/test_fleet.py``: two plugin replicas behind vllm-router, one S3 bucket, and
the calls its tests make (the router's command line, /metrics counters, v2 refs offloaded to S3,
request bodies by ref and by cache handle, killing a replica)."""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from helpers import REPO, DelayProxy, VLLMServer, photo_array
from vllm_server import free_port

__all__ = [
    "DEADLINE_S",
    "GREEDY",
    "HOLD_DOWN_S",
    "LONG",
    "PAD",
    "ROUTER",
    "ROUTER_FLAGS",
    "STORE",
    "TEXT",
    "Fleet",
    "RouterAnswer",
    "body",
    "by_handle",
    "counters",
    "delta",
    "kill",
    "metric",
    "offload",
    "post",
    "resolved_hash",
    "s3_offloader",
    "start_router",
    "store_key",
    "through",
    "tokens",
    "unique_image",
    "wait_running",
]


ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
"""vllm-router's console script (the ``dev`` extra)."""


def readme_router_flags() -> list[str]:
    """The README's Fleet router command, less what names this machine's ports and workers
    (``--host``, ``--port``, ``--worker-urls``, ``--prometheus-port``): the flags every router here
    runs with, as written."""
    fleet = (REPO / "README.md").read_text().split("### Fleet\n", 1)[1]
    (command,) = [b for b in re.findall(r"^```bash\n(.*?)^```$", fleet, re.S | re.M) if "vllm-router" in b]
    words = shlex.split(command.replace("\\\n", " "))[1:]
    flags, skip = [], False
    for word in words:
        if word.startswith("--"):
            skip = word in ("--host", "--port", "--worker-urls", "--prometheus-port")
        if not skip:
            flags.append(word)
    return flags


ROUTER_FLAGS = readme_router_flags()
"""``--policy consistent_hash --disable-circuit-breaker --disable-retries ...`` (docs/SCALING.md §7)."""

OLD_ROUTER_FLAGS = [
    "--policy", "consistent_hash", "--cb-failure-threshold", "1", "--cb-timeout-duration-secs", "2",
    "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
]  # fmt: skip
"""The README's flags before issue 47 (breaker after one 5xx, the router's retries on): measured
beside :data:`ROUTER_FLAGS` in ``tests/test_fleet.py``."""


STORE = {
    "MMREF_STORE_TIMEOUT_S": "1",
    "MMREF_STORE_CONNECT_TIMEOUT_S": "0.5",
    "MMREF_STORE_MAX_RETRIES": "1",
    "MMREF_STORE_RETRY_TIMEOUT_S": "2",
    "MMREF_STORE_HOLD_DOWN_S": "1",
}
"""The replicas' object-store requests: one read of one root ends within 3 s; a root found down
is held down 1 s (:data:`HOLD_DOWN_S`)."""

HOLD_DOWN_S = 1.0


DEADLINE_S = 3.0 + 2.0
"""That bound, plus slack for a loaded 2-core machine."""


GREEDY = {"temperature": 0, "max_tokens": 4}

TEXT = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
"""A request that needs no store."""


PAD = 261


@dataclass
class Fleet:
    a: VLLMServer
    b: VLLMServer
    router: str
    router_process: subprocess.Popen
    proxy: DelayProxy
    """B's way to the store (cut or slowed by the fault tests)."""
    proxy_a: DelayProxy
    """A's way to the store (cut with B's: the store stopped)."""
    s3: str
    """The shared root, ``s3://<bucket>/fleet``."""
    bucket: object
    """obstore's handle on the whole bucket: the tests' hands behind the parties' backs."""
    mount_a: Path
    trainer_mount: Path

    def replica(self, name: str) -> VLLMServer:
        return {"a": self.a, "b": self.b}[name]

    def stop_store(self) -> None:
        """The S3 endpoint down for both replicas (connections refused, as for a stopped server)."""
        self.proxy.close()
        self.proxy_a.close()

    def start_store(self) -> None:
        """The endpoint back (each proxy listening again; one already listening is left alone)."""
        for proxy in (self.proxy, self.proxy_a):
            if proxy._closed.is_set():
                proxy.reopen()


def start_router(
    workers: list[str], log: Path, flags: list[str] = ROUTER_FLAGS
) -> tuple[str, subprocess.Popen]:
    """vllm-router on a free port in front of ``workers``, with ``flags`` (the README's)."""
    port = free_port()
    cmd = [
        ROUTER, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
        "--prometheus-port", str(free_port()), *flags,
    ]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return url, process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise TimeoutError(f"vllm-router not up: {log.read_text()[-3000:]}")


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series on ``url``'s /metrics (label values must match when given)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def counters(fleet: Fleet, name: str, **labels: str) -> dict[str, float]:
    return {k: metric(fleet.replica(k).url, name, **labels) for k in ("a", "b")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def unique_image(tag: str) -> bytes:
    """A real photo (112x112 PNG) with one pixel set from ``tag``: a content no other test stored."""
    import io

    from PIL import Image

    photo = photo_array(("astronaut", "coffee", "chelsea", "rocket")[int(tag[-1:], 36) % 4])
    image = Image.fromarray(photo).resize((112, 112))
    image.putpixel((0, 0), tuple(hashlib.sha256(tag.encode()).digest()[:3]))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def offload(fleet: Fleet, adapter, tag: str):
    """``tag``'s image offloaded as the rollout side does here: to S3 only, a v2 ref."""
    from protocol.adapters import offload_image
    from protocol.roots import ObjectRoot, StoreClientConfig

    return offload_image(
        unique_image(tag), ObjectRoot(fleet.s3, StoreClientConfig(allow_http=True)), adapter, form="v2"
    )


def body(ref, *more, **sampling) -> dict:
    """A generate body of ``ref`` (and ``more`` refs), each image in its own vision span."""
    ids = [1]
    for r in (ref, *more):
        ids += [259, *[PAD] * r.num_placeholders, 260]
    return {
        "token_ids": [*ids, 2],
        "mm_refs": [r.ref for r in (ref, *more)],
        "sampling_params": {**GREEDY, **sampling},
    }


def tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text[:400]
    return response.json()["choices"][0]["token_ids"]


def post(url: str, payload: dict, session: str | None = None, **kwargs) -> httpx.Response:
    headers = {"X-Session-ID": session} if session else {}
    return httpx.post(f"{url}/inference/v1/generate", json=payload, headers=headers, timeout=120, **kwargs)


def s3_offloader(fleet: Fleet, adapter):
    """The rollout client's offloader as the rollout party runs it here: v2 refs, to S3 only."""
    from protocol.roots import ObjectRoot, StoreClientConfig
    from rollout_client import Offloader

    root = ObjectRoot(fleet.s3, StoreClientConfig(allow_http=True))
    return Offloader(fleet.a.model, root, adapter=adapter, form="v2")


def store_key(ref) -> str:
    from protocol.refs import parse_ref

    return parse_ref(ref.ref).key


def resolved_hash(url: str, ref) -> str:
    r = httpx.post(
        f"{url}/inference/v1/resolve", json={k: v for k, v in body(ref).items() if k != "sampling_params"}
    )
    assert r.status_code == 200, r.text[:300]
    return r.json()["features"]["mm_hashes"]["image"][0]


def by_handle(ref, mm_hash: str) -> dict:
    ids = body(ref)["token_ids"]
    features = {
        "mm_hashes": {"image": [mm_hash]},
        "mm_placeholders": {"image": [{"offset": ids.index(PAD), "length": ref.num_placeholders}]},
        "kwargs_data": {"image": [None]},
    }
    return {"token_ids": ids, "features": features, "sampling_params": GREEDY}


LONG = {"temperature": 1.0, "max_tokens": 192, "ignore_eos": True}
"""Long enough to be in flight when the replica dies (~2-4 s on the tiny model, 2 cores)."""


def kill(server: VLLMServer) -> None:
    """SIGKILL the API server and its engine processes (no shutdown: a crashed machine)."""
    import psutil

    parent = psutil.Process(server.process.pid)
    for process in [parent, *parent.children(recursive=True)]:
        process.kill()


def wait_running(server: VLLMServer, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(server.url, "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, "no request ever ran on the replica"
        time.sleep(0.05)


@dataclass
class RouterAnswer:
    """One request through a router (:func:`through`), and the session's next text-only request."""

    status: int
    code: str | None
    """The plugin's ``mmref_code`` when the body is the plugin's; None for a 200 or the router's own."""
    content_type: str
    replica_answers: int
    """How many answers the replicas gave it (their refusal and success counters): > 1 is a retry."""
    next_status: int
    next_on: list[str]
    """The replicas that answered the session's next text-only request."""
    router_text: str = ""
    """The router's own answer's first characters (not the plugin's)."""

    def __str__(self) -> str:
        got = f"{self.status} {self.code or ''}".strip()
        own = f" ({self.router_text!r})" if self.router_text else ""
        return f"client gets {got}{own} [{self.content_type}], replica answers {self.replica_answers}, " \
               f"next text-only request {self.next_status} on {self.next_on or 'none'}"  # fmt: skip


def through(fleet: Fleet, router: str, payload: dict, session: str) -> RouterAnswer:
    """``payload`` through ``router`` under ``session``, then a text-only request under it."""
    from helpers import refusal

    def answers() -> float:
        success = counters(fleet, "vllm:request_success_total")
        return sum(success.values()) + sum(counters(fleet, "mmref_ref_errors_total").values())

    before = answers()
    r = post(router, payload, session)
    seen = answers() - before
    served = counters(fleet, "vllm:request_success_total")
    after = post(router, TEXT, session)
    landed = [k for k, d in delta(counters(fleet, "vllm:request_success_total"), served).items() if d]
    typed = r.status_code != 200 and r.headers.get("content-type", "").startswith("application/json")
    code = refusal(r)[1] if typed else None
    own = "" if typed or r.status_code == 200 else r.text[:60]
    return RouterAnswer(r.status_code, code, r.headers.get("content-type", ""), int(seen), after.status_code,
                        landed, own)  # fmt: skip
