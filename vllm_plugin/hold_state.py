"""The weight-update hold of one server, shared by all its API processes (docs/WEIGHT-UPDATES.md,
"Several API processes").

With ``--api-server-count N`` every API process has its own admission gate, and a client's hold and
its release may reach different processes. The hold is therefore one record for the whole server:
a small JSON file in ``/dev/shm`` (memory; a temporary folder where there is none), read and written
under an exclusive ``flock``, named by the server's port and its launcher's pid (the API processes
of one ``vllm serve`` share both). It holds:

- ``state``: ``idle``; ``closing`` (a hold or update drains: every process closes its gate and
  reports its admitted requests); ``held``; ``updating`` (an update reloads: it releases the server
  itself); ``releasing`` (a release resets caches and resumes);
- ``owner`` (the pid that took it), ``token`` (one per hold), ``since`` (wall clock, for the lease);
- ``members``: each live API process's pid and its count of admitted requests.

Each process's :class:`~vllm_plugin.updates.WeightUpdates` changes the record; a watcher task per
process (``updates.py``) follows it: closes its gate while the server is not idle, reports its count,
opens it again once idle, and releases a hold whose lease ran out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["HoldRecord", "SharedHold", "State", "new_token", "now"]

State = Literal["idle", "closing", "held", "updating", "releasing"]


@dataclass
class HoldRecord:
    """The server's hold (see the module doc)."""

    state: State = "idle"
    owner: int | None = None
    token: str | None = None
    since: float = 0.0
    """``time.time()`` when the hold was taken (wall clock: processes share it)."""
    members: dict[str, list] = field(default_factory=dict)
    """pid (as text: JSON keys) -> ``[admitted requests, the token its gate closed for]`` of that
    API process (the token None while its gate follows no hold)."""


class SharedHold:
    """The record of one server, for this process.

    Args:
        path: the record's file (created empty if missing).
        pid: this process's pid.
    """

    def __init__(self, path: Path, pid: int | None = None) -> None:
        self.path = path
        self.pid = os.getpid() if pid is None else pid
        path.touch(exist_ok=True)

    @classmethod
    def for_server(cls, port: int) -> SharedHold:
        """The record of the server listening on ``port`` whose launcher is this process's parent."""
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        return cls(folder / f"mmref-hold-{port}-{os.getppid()}.json")

    @contextlib.contextmanager
    def edit(self) -> Iterator[HoldRecord]:
        """The record under the lock, written back on exit; dead processes' entries dropped (a hold
        whose owner died while draining, updating or releasing: held, its lease run out)."""
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                record = _parse(f.read())
                _drop_dead(record)
                yield record
                f.seek(0)
                f.truncate()
                f.write(json.dumps(asdict(record)))
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def read(self) -> HoldRecord:
        """The record as it is now (a shared lock: never half-written)."""
        with open(self.path) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
            try:
                return _parse(f.read())
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def join(self) -> None:
        """Register this process (no request admitted, its gate following no hold)."""
        with self.edit() as record:
            record.members[str(self.pid)] = [0, None]

    def report(self, admitted: int, token: str | None) -> None:
        """This process's count of admitted requests, its gate closed for the hold ``token``."""
        with self.edit() as record:
            record.members[str(self.pid)] = [admitted, token]


def new_token() -> str:
    """A new hold's token."""
    return uuid.uuid4().hex


def now() -> float:
    """Wall-clock seconds (the processes of one server share the clock; ``since`` and leases)."""
    return time.time()


def _parse(text: str) -> HoldRecord:
    if not text.strip():
        return HoldRecord()
    data = json.loads(text)
    return HoldRecord(**data)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _drop_dead(record: HoldRecord) -> None:
    """Forget processes that died; a hold whose owner died while draining, updating or releasing
    (the engine may be paused) becomes held with its lease run out: the next watcher releases it."""
    record.members = {p: n for p, n in record.members.items() if _alive(int(p))}
    dead_owner = record.owner is not None and not _alive(record.owner)
    if dead_owner and record.state in ("closing", "updating", "releasing"):
        record.state, record.since = "held", 0.0
