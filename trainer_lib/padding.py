"""Padding samples: zero-loss, out of metrics, never a copy of a real sample (docs/PACKING.md §3).

Every pad has ``is_padding=True``, ``loss_mask`` all False, advantages 0 and its own token ids,
and no group, so group-relative advantages computed elsewhere never see it:

- **text pads** (:func:`make_pad_sample`): ``pad_tokens`` pad ids. :func:`pad_samples` appends
  them up to :func:`padded_sample_count`, a multiple of ``lcm(dp_size, mini_batch_size[,
  critic_mini_batch_size])`` (verl's scheme: 2 tokens, independent ids);
- **synthetic-image pads** (:func:`synthetic_image_pad`): ``[pad] + [placeholder] * n + [pad]`` with one
  synthetic image (zero features from ``adapter.synthesize_placeholder``), so a micro-batch runs
  the vision tower (:mod:`trainer_lib.ranks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from protocol.structs import TrainingSample
from trainer_lib.packing import PackEntry

__all__ = [
    "make_pad_sample",
    "pad_key",
    "pad_samples",
    "padded_sample_count",
    "smallest_image_grid",
    "synthetic_image_pad",
]


def padded_sample_count(
    num_samples: int, *, dp_size: int, mini_batch_size: int, critic_mini_batch_size: int | None = None
) -> int:
    """``num_samples`` rounded up to a multiple of ``lcm(dp_size, mini_batch_size[, critic])``.

    Raises:
        ValueError: a size below 1 or a negative sample count.
    """
    sizes = [dp_size, mini_batch_size] + (
        [critic_mini_batch_size] if critic_mini_batch_size is not None else []
    )
    if num_samples < 0 or min(sizes) < 1:
        raise ValueError(f"need num_samples >= 0 and sizes >= 1, got {num_samples}, {sizes}")
    multiple = math.lcm(*sizes)
    return -(-num_samples // multiple) * multiple


def pad_key(last: TrainingSample | None) -> tuple[str, str | None]:
    """The isolation key pads take: ``last``'s (the last real sample beside them, so they pack
    with it and never open a bin of their own just for isolation), ``("", None)`` without one."""
    return last.isolation_key if last is not None else ("", None)


def make_pad_sample(
    *, pad_token_id: int, num_tokens: int = 2, run_id: str = "", lora_id: str | None = None
) -> TrainingSample:
    """A minimal zero-loss text sample: ``num_tokens`` pad ids, ``is_padding=True``.

    Raises:
        ValueError: ``num_tokens < 1``.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    return TrainingSample(
        input_ids=[pad_token_id] * num_tokens,
        loss_mask=[False] * num_tokens,
        advantages=[0.0] * num_tokens,
        inference_logprobs=[0.0] * num_tokens,
        run_id=run_id,
        lora_id=lora_id,
        is_padding=True,
    )


def smallest_image_grid(adapter: Any) -> tuple[int, ...]:
    """The smallest grid the family's processor produces (a 1x1 image after its resize rules).

    Qwen-VL: ``smart_resize`` lifts tiny images to ``min_pixels``; released Qwen2-VL gives
    ``(1, 4, 4)`` = 4 placeholder tokens.
    """
    return tuple(adapter.grid_for_size(1, 1))


def synthetic_image_pad(
    adapter: Any,
    *,
    grid: Sequence[int],
    pad_token_id: int,
    placeholder_token_id: int,
    run_id: str = "",
    lora_id: str | None = None,
) -> PackEntry:
    """A zero-loss pad carrying one synthetic image: ``[pad] + [placeholder] * n + [pad]``.

    Its features are ``adapter.synthesize_placeholder(grid)`` (zeros of the right shapes), added
    by :func:`trainer_lib.forward.materialize_micro_batch`.
    """
    n = adapter.num_placeholders(grid)
    ids = [pad_token_id] + [placeholder_token_id] * n + [pad_token_id]
    sample = TrainingSample(
        input_ids=ids,
        loss_mask=[False] * len(ids),
        advantages=[0.0] * len(ids),
        inference_logprobs=[0.0] * len(ids),
        run_id=run_id,
        lora_id=lora_id,
        is_padding=True,
    )
    return PackEntry(sample, None, tuple(int(g) for g in grid))


def pad_samples(
    samples: Sequence[TrainingSample],
    *,
    dp_size: int,
    mini_batch_size: int,
    critic_mini_batch_size: int | None = None,
    pad_token_id: int,
    pad_tokens: int = 2,
) -> list[TrainingSample]:
    """``samples`` followed by text pads up to :func:`padded_sample_count`.

    Pads take the ``run_id``/``lora_id`` of the last sample (so they pack with it and never
    open a bin of their own just for isolation).
    """
    target = padded_sample_count(
        len(samples),
        dp_size=dp_size,
        mini_batch_size=mini_batch_size,
        critic_mini_batch_size=critic_mini_batch_size,
    )
    run_id, lora_id = pad_key(samples[-1] if samples else None)
    pads = [
        make_pad_sample(pad_token_id=pad_token_id, num_tokens=pad_tokens, run_id=run_id, lora_id=lora_id)
        for _ in range(target - len(samples))
    ]
    return [*samples, *pads]
