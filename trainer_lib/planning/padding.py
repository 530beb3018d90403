"""Padding samples: zero-loss, out of metrics, never a copy of a real sample (docs/PACKING.md §3).

Every pad (:func:`make_pad_sample`) has ``is_padding=True``, ``loss_mask`` all False, advantages 0
and its own token ids, and no group, so group-relative advantages computed elsewhere never see it:

- **text pads**: ``spec.pad_tokens`` pad ids. :func:`~trainer_lib.planning.plan.mini_batch_entries` adds
  them up to :func:`padded_sample_count`, a multiple of ``lcm(dp_size, mini_batch_size[,
  critic_mini_batch_size])`` (verl's scheme: 2 tokens, independent ids);
- **synthetic-image pads** (``grid=``): ``[pad] + [placeholder] * n + [pad]`` with one synthetic
  image (zero features from ``adapter.zero_features``), so a micro-batch runs the vision
  tower (:mod:`trainer_lib.planning.ranks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from protocol.structs import TrainingSample
from trainer_lib.planning.packing import PackEntry
from trainer_lib.spec import PackingSpec

__all__ = ["make_pad_sample", "pad_key", "padded_sample_count"]


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
    spec: PackingSpec, key: tuple[str, str | None] = ("", None), *, grid: Sequence[int] | None = None
) -> PackEntry:
    """A zero-loss pad of isolation ``key`` (``(run_id, lora_id)``), ``sample_index`` None.

    Without ``grid``: a text pad of ``spec.pad_tokens`` pad ids. With ``grid``: ``[pad] +
    [placeholder] * n + [pad]`` carrying one synthetic image (``n = adapter.num_placeholders(grid)``;
    zero features from ``adapter.zero_features(grid)``, added by
    :func:`trainer_lib.materialize.materialize_micro_batch`).

    Raises:
        ValueError: ``grid`` without the spec's adapter.
    """
    pad = spec.pad_token_id
    if grid is None:
        ids = [pad] * spec.pad_tokens
    elif spec.num_placeholders is None:
        raise ValueError("a synthetic-image pad needs the spec's adapter (num_placeholders)")
    else:
        ids = [pad] + [spec.placeholder_token_id] * spec.num_placeholders(grid) + [pad]
    sample = TrainingSample(
        input_ids=ids,
        loss_mask=[False] * len(ids),
        advantages=[0.0] * len(ids),
        inference_logprobs=[0.0] * len(ids),
        run_id=key[0],
        lora_id=key[1],
        is_padding=True,
    )
    return PackEntry(sample, None, None if grid is None else tuple(int(g) for g in grid))
