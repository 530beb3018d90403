"""One training step's plan: pad, split into mini-batches, pack, deal to ranks, balance (docs/PACKING.md §3).

:func:`plan_step` runs the whole chain: pad the sample count (:mod:`trainer_lib.padding`), split
into mini-batches (real samples spread evenly, so no optimizer step is pads alone), pack each
mini-batch (first-fit-decreasing, bins spread to a multiple of ``dp_size``;
:mod:`trainer_lib.packing`), deal the micro-batches to the ranks and balance them
(:mod:`trainer_lib.ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.structs import TrainingSample
from trainer_lib.bins import bin_capacity
from trainer_lib.micro_batch import PackedBatch
from trainer_lib.packing import PackEntry, pack_samples
from trainer_lib.padding import make_pad_sample, padded_sample_count
from trainer_lib.ranks import balance_micro_batches, split_micro_batches

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True)
class StepPlan:
    """``mini_batches[i][rank]``: rank ``rank``'s micro-batches for optimizer step ``i``."""

    mini_batches: list[list[PackedBatch]]
    num_padding_samples: int
    """Sample-count pads added by :func:`pad_samples` (micro-batch pads are counted per step)."""

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for mb in self.mini_batches for s in mb)

    @property
    def num_loss_tokens(self) -> int:
        return sum(s.num_loss_tokens for mb in self.mini_batches for s in mb)

    @property
    def num_samples(self) -> int:
        """Real samples (padding excluded)."""
        return sum(s.num_samples for mb in self.mini_batches for s in mb)

    @property
    def num_loss_tokens_per_mini_batch(self) -> list[int]:
        """Loss tokens of each optimizer step, all ranks together (a per-step loss normalizer)."""
        return [sum(s.num_loss_tokens for s in ranks) for ranks in self.mini_batches]


def _mini_batch_indices(num_real: int, num_padded: int, mini_batch_size: int) -> list[list[int]]:
    """Indices of each mini-batch: the real samples in order, spread as evenly as possible
    (``floor`` or ``ceil`` of ``num_real / k`` each), each topped up with pads (indices
    ``>= num_real``). Only with fewer real samples than mini-batches is one all padding."""
    k = num_padded // mini_batch_size
    q, r = divmod(num_real, k) if k else (0, 0)
    out, real, pad = [], 0, num_real
    for j in range(k):
        n = q + (j < r)
        out.append([*range(real, real + n), *range(pad, pad + mini_batch_size - n)])
        real, pad = real + n, pad + mini_batch_size - n
    return out


def plan_step(
    samples: Sequence[TrainingSample],
    *,
    dp_size: int,
    mini_batch_size: int,
    seq_len: int,
    placeholder_token_id: int,
    pad_token_id: int,
    micro_batch_max_tokens: int | None = None,
    critic_mini_batch_size: int | None = None,
    adapter: Any = None,
    synthetic_image_grid: Sequence[int] | None = None,
    pad_tokens: int = 2,
) -> StepPlan:
    """Pad, split into mini-batches, pack each, deal its micro-batches to the ranks, balance.

    The real samples keep their order and are spread evenly over the mini-batches; the
    sample-count pads top each one up to ``mini_batch_size``, so no optimizer step is made of
    pads alone unless there are fewer real samples than mini-batches (then
    :attr:`StepPlan.num_loss_tokens_per_mini_batch` shows a 0: skip that ``optimizer.step()``;
    every rank computes the same plan, so they agree). Sample ``i`` of the input is
    ``slot.sample_index == i`` wherever it lands; pads have indices ``>= len(samples)`` (sample-count
    pads) or None (micro-batch pads). ``critic_mini_batch_size`` only enters the padded count
    (a critic cuts its own mini-batches from the same padded samples).

    Raises:
        ValueError, PlaceholderMismatch: see :func:`pack_samples` and :func:`balance_micro_batches`.
    """
    cap = bin_capacity(seq_len, micro_batch_max_tokens)
    target = padded_sample_count(
        len(samples),
        dp_size=dp_size,
        mini_batch_size=mini_batch_size,
        critic_mini_batch_size=critic_mini_batch_size,
    )
    mini_batches = []
    for chunk in _mini_batch_indices(len(samples), target, mini_batch_size):
        packed = pack_samples(
            _chunk_entries(samples, chunk, pad_token_id, pad_tokens),
            placeholder_token_id=placeholder_token_id,
            seq_len=seq_len,
            micro_batch_max_tokens=cap,
            num_placeholders=adapter.num_placeholders if adapter is not None else None,
            bins_multiple_of=dp_size,
        )
        mini_batches.append(
            balance_micro_batches(
                split_micro_batches(packed, dp_size),
                pad_token_id=pad_token_id,
                placeholder_token_id=placeholder_token_id,
                adapter=adapter,
                synthetic_image_grid=synthetic_image_grid,
                pad_tokens=pad_tokens,
            )
        )
    return StepPlan(mini_batches=mini_batches, num_padding_samples=target - len(samples))


def _chunk_entries(
    samples: Sequence[TrainingSample], chunk: list[int], pad_token_id: int, pad_tokens: int
) -> list[PackEntry]:
    """One mini-batch's entries; indices ``>= len(samples)`` are text pads keyed like the chunk's
    last real sample (so pads never open a bin just for isolation)."""
    n = len(samples)
    last = samples[max((i for i in chunk if i < n), default=n - 1)] if n else None
    pad = make_pad_sample(
        pad_token_id=pad_token_id,
        num_tokens=pad_tokens,
        run_id=last.run_id if last else "",
        lora_id=last.lora_id if last else None,
    )
    return [PackEntry(samples[i] if i < n else pad, i) for i in chunk]
