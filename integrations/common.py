"""What every framework adapter shares: settings, the version gate, weight pushes, rows' logprobs
from the packed forward, and the stand-in for a dataset row whose image cannot be read.

Frameworks batch *rows*: one prompt + completion per row, the prompt left-padded and the
completion right-padded into ``[B, C]`` tensors (TRL's ``completion_ids``, verl's ``responses``).
mmref's trainer runs packs. :func:`completion_rows` is the bridge back: the per-sample results of
:func:`trainer_lib.sample_logprobs` cut to each row's completion and right-padded to the
framework's width, gradients kept.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from prometheus_client import Counter

from protocol.errors import AssetTooLarge, ImageUnreadable
from protocol.structs import TrainingSample
from rollout_client.weights import push_weights
from trainer_lib import MaterializeConfig

__all__ = [
    "IMAGE_READ_ERRORS",
    "UNREADABLE_ROWS",
    "FrameworkVersionError",
    "MMRefSettings",
    "PushRecord",
    "WeightPusher",
    "completion_rows",
    "require_version",
    "stand_in_sample",
    "text_only",
    "write_safetensors",
]

_log = logging.getLogger("integrations")

IMAGE_READ_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError,  # protocol.errors.AssetNotFound too
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    ImageUnreadable,
    AssetTooLarge,
)
"""What reading a dataset row's image may raise when the *row* is bad (a path that is gone, bytes
no decoder reads, an image over the size limit): the row becomes a zero-loss stand-in. A store
outage (``StoreUnavailable``) and every other error are not in it: they stop the step."""

UNREADABLE_ROWS = Counter(
    "mmref_integration_unreadable_rows",
    "Dataset rows whose image could not be read; each trained with zero loss.",
    ["framework"],
)


class FrameworkVersionError(RuntimeError):
    """The installed framework is outside the range this integration is tested with."""


def require_version(framework: str, installed: str, supported: str) -> None:
    """Stop unless ``installed`` lies in ``supported`` (a PEP 440 specifier, e.g. ``">=1.16,<1.17"``).

    Raises:
        FrameworkVersionError: naming the framework, its installed version and the tested range.
    """
    if Version(installed) not in SpecifierSet(supported):
        raise FrameworkVersionError(
            f"{framework} {installed} is installed, but mmref's {framework} integration is tested with "
            f"{framework}{supported} only (install that range: `bash scripts/install.sh {framework}`)"
        )


@dataclass(frozen=True)
class MMRefSettings:
    """Where the rollouts go and where the trainer reads them.

    Attributes:
        server_url: the mmref server (``VLLM_PLUGINS=mmref``, ``VLLM_SERVER_DEV_MODE=1`` for the
            weight pushes, ``--logprobs-mode processed_logprobs`` for the importance ratio).
        model_dir: the served model's folder (tokenizer, chat template, image processor config).
        output_root: the server's ``MMREF_ASSET_ROOT``; the trainer reads refs under it.
        asset_root: where rollout images are offloaded (default ``output_root/run_1/assets``; an
            object-store URL with ``form="v2"``).
        weights_dir: where each pushed checkpoint is written, as the server sees it (default
            ``output_root/weights``).
        seq_len: the packed forward's token cap per micro-batch (a longer row gets its own).
        push_timeout_s: the server's bound on the drain of a weight push.
        keep_checkpoints: pushed checkpoints kept on disk (older ones are deleted).
        version_prefix: pushed weights are named ``<version_prefix><global_step>`` (new for every
            set of weights: give each run sharing a server its own prefix).
        form: the refs' form (``"v1"``: a path under ``output_root``; ``"v2"``: named by content).
        materialize: the trainer's materialize settings (default: ``MMREF_*`` variables with
            ``asset_root=output_root``).
        client_kwargs: more arguments of :class:`rollout_client.RolloutClient` (retry, timeout...).
    """

    server_url: str
    model_dir: Path
    output_root: Path
    asset_root: Path | str | None = None
    weights_dir: Path | None = None
    seq_len: int = 8192
    push_timeout_s: float = 120.0
    keep_checkpoints: int = 2
    version_prefix: str = "step-"
    form: str = "v1"
    materialize: MaterializeConfig | None = None
    client_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def rollout_asset_root(self) -> Path | str:
        return self.asset_root if self.asset_root is not None else self.output_root / "run_1" / "assets"

    def materialize_config(self) -> MaterializeConfig:
        return self.materialize or MaterializeConfig(asset_root=self.output_root)

    def checkpoints(self) -> Path:
        return self.weights_dir or self.output_root / "weights"


@dataclass(frozen=True)
class PushRecord:
    """One weight push: the version the server now serves, the seconds the save and the push took,
    and the route's answer (``drained_requests``, ``held_seconds``...)."""

    version: str
    save_seconds: float
    push_seconds: float
    answer: Mapping[str, Any]


class WeightPusher:
    """Writes the trainer's weights as a checkpoint and makes the server serve them
    (:func:`rollout_client.push_weights`: drain, reload, cache resets, version, resume): from a
    model (:meth:`push`) or from named tensors in the checkpoint's key names (:meth:`push_tensors`,
    what a framework's weight-sync hook hands over).

    Args:
        http: an ``httpx.Client`` on the server's base URL.
        weights_dir: checkpoints go to ``weights_dir/<version>``.
        timeout_s: the server's bound on the drain.
        keep: checkpoints kept; older ones are deleted after a successful push.
    """

    def __init__(self, http: httpx.Client, weights_dir: Path, *, timeout_s: float, keep: int = 2) -> None:
        self.http = http
        self.weights_dir = Path(weights_dir)
        self.timeout_s = timeout_s
        self.keep = max(1, keep)
        self._written: list[Path] = []

    def push(
        self, model: Any, version: str, state_dict: Mapping[str, torch.Tensor] | None = None
    ) -> PushRecord:
        """Save ``model`` (``save_pretrained``; ``state_dict`` when sharded weights were gathered)
        under ``version`` and push it.

        Raises:
            httpx.HTTPStatusError, httpx.TransportError: see :func:`rollout_client.push_weights`.
        """
        target = self.weights_dir / version
        t0 = time.monotonic()
        model.save_pretrained(target, state_dict=state_dict, safe_serialization=True)
        return self._publish(target, version, time.monotonic() - t0)

    def push_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]], version: str, *, shard_bytes: int = 2 << 30
    ) -> PushRecord:
        """Write ``(name, tensor)`` pairs (checkpoint key names, e.g. verl's
        ``get_per_tensor_param``) as safetensors shards of at most ``shard_bytes`` each (a larger
        tensor gets its own) under ``version`` and push them. Tensors are copied to CPU one shard
        at a time: peak host memory is one shard.

        Raises:
            ValueError: a name given twice.
            httpx.HTTPStatusError, httpx.TransportError: see :func:`rollout_client.push_weights`.
        """
        target = self.weights_dir / version
        t0 = time.monotonic()
        write_safetensors(tensors, target, shard_bytes=shard_bytes)
        return self._publish(target, version, time.monotonic() - t0)

    def _publish(self, target: Path, version: str, save_seconds: float) -> PushRecord:
        t1 = time.monotonic()
        answer = push_weights(self.http, target, version, self.timeout_s)
        push_seconds = time.monotonic() - t1
        self._written.append(target)
        while len(self._written) > self.keep:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        _log.info("mmref: pushed %s (save %.2f s, push %.2f s)", version, save_seconds, push_seconds)
        return PushRecord(answer.get("weight_version", version), save_seconds, push_seconds, answer)


def write_safetensors(
    tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, *, shard_bytes: int = 2 << 30
) -> list[Path]:
    """``(name, tensor)`` pairs as ``model-00001.safetensors``, ... in ``folder`` (created), each
    shard at most ``shard_bytes`` (a larger tensor alone); the files vLLM's ``reload_weights`` reads.

    Raises:
        ValueError: a name given twice.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    shard: dict[str, torch.Tensor] = {}
    size, seen = 0, set()

    def flush() -> None:
        nonlocal shard, size
        if shard:
            files.append(folder / f"model-{len(files) + 1:05d}.safetensors")
            save_file(shard, str(files[-1]))
        shard, size = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} given twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        size += nbytes
    flush()
    return files


def completion_rows(
    values: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    completion_lengths: Sequence[int],
    width: int,
) -> torch.Tensor:
    """``[B, width]``: row ``b`` holds ``values[b][P_b : P_b + C_b]`` (its completion's positions of
    a per-sample tensor over ``P_b + C_b`` tokens), then zeros; gradients flow to ``values``.

    Raises:
        ValueError: the lengths do not fit (a row's tensor is not ``P_b + C_b`` long, or ``C_b`` is
            over ``width``).
    """
    rows = []
    for v, p, c in zip(values, prompt_lengths, completion_lengths, strict=True):
        if v.shape[0] != p + c or c > width:
            raise ValueError(
                f"a row of {v.shape[0]} tokens for a {p}-token prompt and a {c}-token completion"
                f" (width {width})"
            )
        rows.append(torch.nn.functional.pad(v[p:], (0, width - c)))
    return torch.stack(rows)


def text_only(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` without their image parts (a stand-in row's prompt)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [p for p in content if not (isinstance(p, Mapping) and p.get("type") == "image")]
        out.append({**m, "content": content})
    return out


def stand_in_sample(
    prompt_ids: Sequence[int], eos_token_id: int, temperature: float, error: BaseException, framework: str
) -> TrainingSample:
    """The row of a dataset row whose image could not be read: its text-only prompt and a one-token
    completion (``eos_token_id``, logprob 0), loss mask all False; logged and counted
    (:data:`UNREADABLE_ROWS`)."""
    UNREADABLE_ROWS.labels(framework).inc()
    _log.warning(
        "mmref: a dataset row's image cannot be read (%s: %s): the row gets zero loss",
        type(error).__name__,
        error,
    )
    sample = TrainingSample.from_rollout(
        list(prompt_ids), [eos_token_id], [0.0], sampling_temperature=temperature
    )
    return msgspec.structs.replace(sample, loss_mask=[False] * len(sample.input_ids))
