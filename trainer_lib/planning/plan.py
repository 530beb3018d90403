"""One training step's plan: pad, split into mini-batches, deal each to the ranks (docs/PACKING.md §3).

:func:`plan_step` runs the whole chain: pad the sample count and split into mini-batches
(:func:`mini_batch_entries`: real samples spread evenly, so no optimizer step is pads alone; the
pads from :mod:`trainer_lib.planning.padding`), and deal each
mini-batch to the data-parallel ranks as balanced micro-batches (:mod:`trainer_lib.planning.ranks`, planned
by :mod:`trainer_lib.planning.partition`). :class:`StepPlan` holds the micro-batches and reports each rank's
load and the predicted idle share at the synchronisation points (:mod:`trainer_lib.planning.cost`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from protocol.structs import TrainingSample
from trainer_lib.micro_batch import PackedBatch, PackedMicroBatch
from trainer_lib.planning.cost import CostModel, sync_idle
from trainer_lib.planning.packing import PackEntry
from trainer_lib.planning.padding import make_pad_sample, pad_key, padded_sample_count
from trainer_lib.planning.ranks import Balance, StepShape, deal_mini_batch
from trainer_lib.planning.refine import Refinement
from trainer_lib.spec import PackingSpec

__all__ = ["SEARCH", "RankLoad", "StepPlan", "encoded_image_tokens", "mini_batch_entries", "plan_step"]

SEARCH = Refinement()
""":func:`plan_step`'s default search (issue 43): the descent, then the annealing, within the
default time budget per mini-batch (``Refinement.plan_time_budget_s`` None)."""


@dataclass(frozen=True)
class RankLoad:
    """What one rank runs for one optimizer step (counts; tokens are ``input_ids`` entries)."""

    micro_batches: int
    """Forward/backward passes (the same on every rank)."""
    tokens: int
    """All tokens of its micro-batches, padding included."""
    padding_tokens: int
    """Tokens of padding samples (sample-count pads, text pads, synthetic-image pads)."""
    loss_tokens: int
    """Tokens with ``loss_mask`` True."""
    vision_tokens: int
    """Placeholder tokens of its real images (one per image slot, in merged patches; synthetic pad
    images excluded)."""
    image_slots: int = 0
    """Real image slots of its micro-batches."""
    encoded_images: int = 0
    """Images its vision tower encodes under dedup: each distinct image once per micro-batch."""

    @classmethod
    def of(cls, share: PackedBatch) -> RankLoad:
        mbs = share.micro_batches
        return cls(
            micro_batches=len(mbs),
            tokens=share.num_tokens,
            padding_tokens=share.num_padding_tokens,
            loss_tokens=share.num_loss_tokens,
            vision_tokens=sum(im.length for mb in mbs for im in mb.images if im.ref is not None),
            image_slots=sum(im.ref is not None for mb in mbs for im in mb.images),
            encoded_images=sum(len({im.ref.sha256 for im in mb.images if im.ref is not None}) for mb in mbs),
        )


@dataclass(frozen=True)
class StepPlan:
    """``mini_batches[i][rank]``: rank ``rank``'s micro-batches for optimizer step ``i``."""

    mini_batches: list[list[PackedBatch]]
    num_padding_samples: int
    """Sample-count pads added by :func:`mini_batch_entries` (micro-batch pads are counted per step)."""

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

    @property
    def rank_loads(self) -> list[list[RankLoad]]:
        """``[mini_batch][rank]``: each rank's micro-batches, tokens, loss and vision tokens."""
        return [[RankLoad.of(share) for share in ranks] for ranks in self.mini_batches]

    def sync_idle(
        self, cost_model: CostModel | None = None, mini_batch: int | None = None, *, dedup: bool = True
    ) -> float:
        """Predicted share of rank-time spent waiting at the micro-batch synchronisation points.

        ``1 - work / (dp * sum over slots of the slowest rank's time)``, where micro-batch ``k``
        of every rank is one slot (FSDP gathers parameters layer by layer, so a slot lasts as long
        as its slowest rank) and work is the real samples' cost; pads take time but do no work.
        Cost: tokens by default; with a :class:`~trainer_lib.planning.cost.CostModel`, FLOPs, with the
        vision tower and the language model synchronised separately, the tower costing each
        distinct image of a micro-batch once (``dedup``, the trainer's default; False: once per
        image slot, the per-slot layout). ``mini_batch``: one optimizer step's idle share, default
        the whole step's.
        """
        steps = self.mini_batches if mini_batch is None else [self.mini_batches[mini_batch]]
        work: list[list[list[list[float]]]] = []
        pads: list[list[list[list[float]]]] = []
        for ranks in steps:
            for stage in _stages(cost_model, dedup):
                work.append([[stage(mb, False) for mb in share.micro_batches] for share in ranks])
                pads.append([[stage(mb, True) for mb in share.micro_batches] for share in ranks])
        return sync_idle(work, pads)


def _stages(cost_model: CostModel | None, dedup: bool = True) -> list:
    """Per-micro-batch cost functions ``(mb, padding) -> cost`` of the real (or the padding) samples,
    one per synchronous stage."""

    def tokens(mb: PackedMicroBatch, padding: bool) -> float:
        return sum(s.length for s in mb.slots if s.is_padding == padding)

    if cost_model is None:
        return [tokens]

    def language(mb: PackedMicroBatch, padding: bool) -> float:
        return sum(cost_model.language(s.length) for s in mb.slots if s.is_padding == padding)

    def vision(mb: PackedMicroBatch, padding: bool) -> float:
        return cost_model.vision(encoded_image_tokens(mb, padding=padding, dedup=dedup))

    return [vision, language]


def encoded_image_tokens(mb: PackedMicroBatch, *, padding: bool = False, dedup: bool = True) -> list[int]:
    """Placeholder tokens of each image the vision tower encodes for ``mb``'s real samples (or its
    padding samples' synthetic images): each distinct image once with ``dedup`` (by sha256), every
    image slot without."""
    images = [im for im in mb.images if mb.slots[im.slot].is_padding == padding]
    if not dedup:
        return [im.length for im in images]
    distinct = {(im.ref.sha256 if im.ref is not None else id(im)): im.length for im in images}
    return list(distinct.values())


def plan_step(
    samples: Sequence[TrainingSample],
    spec: PackingSpec,
    shape: StepShape,
    *,
    cost_model: CostModel | None = None,
    balance: Balance = "compute",
    refine: Refinement | None = SEARCH,
) -> StepPlan:
    """Pad, split into mini-batches, deal each to the ranks as balanced micro-batches.

    The real samples keep their order and are spread evenly over the mini-batches; the
    sample-count pads top each one up to ``shape.mini_batch_size``, so no optimizer step is made of
    pads alone unless there are fewer real samples than mini-batches (then
    :attr:`StepPlan.num_loss_tokens_per_mini_batch` shows a 0: skip that ``optimizer.step()``;
    every rank computes the same plan, so they agree). Each mini-batch goes to
    :func:`~trainer_lib.planning.ranks.deal_mini_batch`: every rank gets the same number of micro-batches,
    the fewest the cap allows under the packing rules, with nearly equal tokens in micro-batch
    ``k`` on every rank (docs/PACKING.md §3 states the bound). Sample ``i`` of the input is
    ``slot.sample_index == i`` wherever it lands; pads have indices ``>= len(samples)``
    (sample-count pads) or None (micro-batch pads). ``shape.critic_mini_batch_size`` only enters
    the padded count (a critic cuts its own mini-batches from the same padded samples).

    Args:
        spec: the family's facts: placeholder and pad ids, pad length; its adapter checks every
            ref's count and makes the synthetic-image pads (needed when ``dp_size > 1`` and some
            micro-batch must run the vision tower without an image).
        shape: the step's sizes (:class:`~trainer_lib.planning.ranks.StepShape`): ``dp_size``,
            ``mini_batch_size``, ``seq_len`` and ``micro_batch_max_tokens`` (the cap),
            ``critic_mini_batch_size``, and ``stretch_cap``: off by default. On: in a micro-batch
            slot where some rank runs a sample longer than the cap, the other ranks'
            micro-batches may hold up to that sample's length instead of idling (no micro-batch
            exceeds the step's longest sample, which one rank must hold anyway, so peak memory
            is unchanged; docs/PACKING.md §3).
        cost_model: e.g. ``CostModel.from_config(model.config)``: the partition's cost in FLOPs
            (language and vision terms, attention's quadratic terms); default tokens and image
            tokens.
        balance: ``"compute"`` (default): samples sharing an image kept together, each slot's
            language cost levelled and its ranks' vision cost alike, each distinct image costed
            once per micro-batch (the trainer's dedup); ``"tokens"``: issue 13's token-balanced
            plan (each slot's tokens even, vision slots grouped by vision cost).
        refine: with ``"compute"``, search each mini-batch's plan for a shorter predicted step
            (:class:`~trainer_lib.planning.refine.Refinement`: the descent, then the annealing;
            docs/PACKING.md §3.8), for at most ``refine.plan_time_budget_s`` seconds per
            mini-batch, counted in iterations at measured rates, so the plan is deterministic.
            Default :data:`SEARCH` (``Refinement()``: 2% of the mini-batch's predicted step on
            ``cost_model``'s card, 2-45 ms); None: the plan as constructed, no search.

    Raises:
        ValueError, PlaceholderMismatch, GridMismatch: see
            :func:`~trainer_lib.planning.ranks.deal_mini_batch`.
    """
    chunks = mini_batch_entries(
        samples,
        spec,
        dp_size=shape.dp_size,
        mini_batch_size=shape.mini_batch_size,
        critic_mini_batch_size=shape.critic_mini_batch_size,
    )
    mini_batches = [
        deal_mini_batch(entries, spec, shape, cost_model=cost_model, balance=balance, refine=refine)
        for entries in chunks
    ]
    pads = sum(e.sample.is_padding for entries in chunks for e in entries)
    return StepPlan(mini_batches=mini_batches, num_padding_samples=pads)


def mini_batch_entries(
    samples: Sequence[TrainingSample],
    spec: PackingSpec,
    *,
    dp_size: int,
    mini_batch_size: int,
    critic_mini_batch_size: int | None = None,
) -> list[list[PackEntry]]:
    """The one way a step is padded: its samples padded to
    :func:`~trainer_lib.planning.padding.padded_sample_count` and cut into mini-batches: the real samples in
    order, spread as evenly as possible (``floor`` or ``ceil`` of ``N / k`` each), each topped up
    with text pads (:func:`~trainer_lib.planning.padding.make_pad_sample`) keyed like its last real sample
    (:func:`~trainer_lib.planning.padding.pad_key`: so pads never open a bin just for isolation).
    ``PackEntry.sample_index`` is the sample's input position; pads have indices
    ``>= len(samples)``. Only with fewer real samples than mini-batches is one all padding.

    Raises:
        ValueError: a size below 1 (see :func:`~trainer_lib.planning.padding.padded_sample_count`).
    """
    n = len(samples)
    total = padded_sample_count(
        n, dp_size=dp_size, mini_batch_size=mini_batch_size, critic_mini_batch_size=critic_mini_batch_size
    )
    k = total // mini_batch_size
    q, r = divmod(n, k) if k else (0, 0)
    out, real, pad_index = [], 0, n
    for j in range(k):
        m = q + (j < r)
        pad = make_pad_sample(spec, pad_key(samples[real + m - 1] if real + m else None)).sample
        entries = [PackEntry(samples[i], i) for i in range(real, real + m)]
        entries += [PackEntry(pad, pad_index + i) for i in range(mini_batch_size - m)]
        out.append(entries)
        real, pad_index = real + m, pad_index + mini_batch_size - m
    return out
