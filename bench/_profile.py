"""py-spy helpers: record a process tree as collapsed stacks, then summarize where time goes.

``py-spy record --format raw --subprocesses`` writes one line per distinct stack,
``frame;frame;... count``, each stack starting with ``process PID:"cmdline"``. The summary
gives, per process, the share of samples whose stack contains each function (inclusive)
and the functions most often on top (self), which is what the report quotes.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

__all__ = ["Recorder", "py_spy", "summarize"]


def py_spy() -> str | None:
    """The py-spy executable: on PATH or beside this interpreter (the venv's bin); None if absent."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


class Recorder:
    """``with Recorder(pid, out_file): ...`` samples ``pid`` and its children (non-blocking, 100 Hz)."""

    def __init__(self, pid: int, out: Path, rate: int = 100, native: bool = False) -> None:
        self.pid, self.out, self.rate, self.native = pid, out, rate, native
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Recorder:
        spy = py_spy()
        if spy is None:
            raise FileNotFoundError("py-spy not found (the bench extra: bash scripts/install.sh bench)")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [spy, "record", "-p", str(self.pid), "-o", str(self.out), "-f", "raw", "-r", str(self.rate)]
        cmd += ["--subprocesses", "--nonblocking"] + (["--native"] if self.native else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.5)  # attach
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_FRAME = re.compile(r"^(?P<fn>[^ ]+) \((?P<file>[^:]+)(?::\d+)?\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    file = m["file"]
    for marker in ("site-packages/", "/work/main/"):
        if marker in file:
            file = file.split(marker, 1)[1]
    return f"{m['fn']} ({file})"


def _process(frame: str) -> str:
    """A readable name for a ``process PID:"cmdline"`` frame."""
    cmd = frame.split(":", 1)[1].strip('"') if ":" in frame else frame
    if "EngineCore" in cmd:
        return "engine core"
    if "Worker" in cmd:
        return "model worker"
    if "api_server" in cmd:
        return "api server"
    return cmd[:40]


def summarize(path: Path, *, top: int = 25, keep: tuple[str, ...] = ()) -> str:
    """Text summary of a raw py-spy file: per process, top inclusive and self functions."""
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    self_: dict[str, Counter[str]] = defaultdict(Counter)
    totals: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        proc = _process(procs[-1]) if procs else "?"  # children nest under their parent's frame
        frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        totals[proc] += n
        for fn in dict.fromkeys(_short(f) for f in frames):
            inclusive[proc][fn] += n
        if frames:
            self_[proc][_short(frames[-1])] += n
    lines = []
    for proc, total in totals.most_common():
        lines.append(f"== {proc}: {total} samples")
        lines.append("   inclusive:")
        shown = [(fn, c) for fn, c in inclusive[proc].most_common() if not keep or any(k in fn for k in keep)]
        lines += [f"     {c / total * 100:5.1f}%  {fn}" for fn, c in shown[:top]]
        lines.append("   self:")
        lines += [f"     {c / total * 100:5.1f}%  {fn}" for fn, c in self_[proc].most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), top=int(sys.argv[2]) if len(sys.argv) > 2 else 25))
