"""The packed micro-batch: the wire struct plus per-sample slots and image spans (docs/PACKING.md).

:class:`PackedMicroBatch` wraps :class:`protocol.structs.MicroBatch` (what crosses the wire) with
derived views: per-sample :class:`SampleSlot` (offsets, image counts, padding flags, the samples
themselves) and :class:`ImageSpan` (placeholder offsets rebased onto the pack).
:class:`PackedBatch` is a list of them with totals. Built by :mod:`trainer_lib.planning.packing`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import msgspec

from protocol.structs import MicroBatch, RawMMRef, TrainingSample

__all__ = ["ImageSpan", "PackedBatch", "PackedMicroBatch", "SampleSlot", "replace_loss_mask", "wire_struct"]


@dataclass(frozen=True)
class ImageSpan:
    """One image or video of a micro-batch: where its placeholder run sits in the pack (a video's
    ref has ``modality == "video"``: its tokens are the video token, typed 2 in
    ``mm_token_type_ids``).

    Example: a sample packed at offset 100 whose image run starts at token 5 of the sample and
    has 16 placeholders gives ``ImageSpan(slot=k, start=105, length=16, grid=(1, 8, 8), ...)``.
    """

    slot: int
    """Index of the owning sample in :attr:`PackedMicroBatch.slots`."""
    start: int
    """Offset of the first placeholder token in the packed sequence (sample offset + its start)."""
    length: int
    """Placeholder tokens (``t*h*w // merge**2`` for Qwen-VL)."""
    grid: tuple[int, ...]
    ref: RawMMRef | None
    """The image's ref; None for a synthetic pad image (zero features from
    ``adapter.zero_features(grid)``)."""
    runs: tuple[tuple[int, ...], ...] = ()
    """A video's placeholder runs ``(start in the pack, length)`` where it has more than one
    (Qwen3-VL: one per temporal patch, its timestamp text between; ``length`` is then their sum);
    empty: the one run ``(start, length)``."""

    @property
    def is_video(self) -> bool:
        return self.ref is not None and self.ref.modality == "video"

    @property
    def token_runs(self) -> tuple[tuple[int, ...], ...]:
        """Its placeholder runs, ``(start in the pack, length)`` each."""
        return self.runs or ((self.start, self.length),)


@dataclass(frozen=True)
class SampleSlot:
    """One packed sample."""

    sample_index: int | None
    """Which sample this is: its position in the samples given to :func:`~trainer_lib.pack_samples`
    (or :func:`~trainer_lib.plan_step`); None for a pad added by balancing. After
    :func:`~trainer_lib.rebuild_micro_batch`, its position in the micro-batch (the step-wide
    index is not on the wire)."""
    start: int
    """Offset of its first token in the packed sequence."""
    length: int
    num_images: int
    first_image: int
    """Index of its first image in :attr:`PackedMicroBatch.images`."""
    num_loss_tokens: int
    is_padding: bool
    stray_placeholders: bool
    """A text-only sample whose ids contain the placeholder token (never packed with pixels)."""
    sample: TrainingSample = field(repr=False)


class _WireStruct:
    """The :attr:`PackedMicroBatch.micro_batch` field: the struct given to the constructor, or,
    given None (the default), built from the slots and images on first read and kept
    (:func:`wire_struct`). A data descriptor as a dataclass default (the ``dataclasses`` docs,
    "Descriptor-typed fields"): ``__init__``'s value goes through :meth:`__set__`."""

    def __get__(self, obj: PackedMicroBatch | None, owner: type | None = None) -> MicroBatch | None:
        if obj is None:
            return None  # the field's default: build on first read
        wire = obj.__dict__.get("_wire")
        if wire is None:
            wire = obj.__dict__["_wire"] = wire_struct(obj.slots, obj.images)
        return wire

    def __set__(self, obj: PackedMicroBatch, value: MicroBatch | None) -> None:
        obj.__dict__["_wire"] = value


@dataclass(frozen=True)
class PackedMicroBatch:
    """A :class:`protocol.structs.MicroBatch` plus the trainer-side facts it has no field for.

    Every per-token array (``micro_batch.input_ids``, ``loss_mask``, ``advantages``,
    ``inference_logprobs`` and :attr:`mm_token_type_ids`) has :attr:`num_tokens` entries
    (``MicroBatch.__post_init__`` checks that on construction, decoding and ``msgspec.structs.replace``).
    :func:`~trainer_lib.planning.packing.build_micro_batch` derives :attr:`slots` and :attr:`images` from
    its analysis; the wire struct's per-token arrays are concatenated from the slots' samples on
    the first read of :attr:`micro_batch` (:func:`wire_struct`), so a rank that plans every rank's
    micro-batches copies the tokens of its own only (issue 43). Padding samples sit after the real
    samples. Every count below reads the slots, never the arrays.
    """

    slots: tuple[SampleSlot, ...]
    images: tuple[ImageSpan, ...]
    """Every image and video in pack order (sample order, then prompt order): the order the
    features of each modality are concatenated in and the order transformers' ``masked_scatter``
    fills each modality's placeholders. ``MicroBatch.images_per_sample`` counts both."""
    micro_batch: MicroBatch = _WireStruct()  # type: ignore[assignment]
    """The wire struct; everything above can be rebuilt from it (:func:`rebuild_micro_batch`).
    Given (decoded, or replaced), or None: :func:`wire_struct` of the slots and images, built on
    first read and kept."""

    @property
    def mm_token_type_ids(self) -> list[int]:
        """Per token: 0 text, 1 image placeholder, 2 video placeholder (transformers' convention)."""
        return self.micro_batch.mm_token_type_ids or []

    @property
    def run_id(self) -> str:
        return self.slots[0].sample.run_id

    @property
    def lora_id(self) -> str | None:
        return self.slots[0].sample.lora_id

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.slots)

    @property
    def num_loss_tokens(self) -> int:
        """Tokens with ``loss_mask`` True (a sample's first token never is)."""
        return sum(s.num_loss_tokens for s in self.slots)

    @property
    def seq_lens(self) -> list[int]:
        return [s.length for s in self.slots]

    @property
    def sample_count(self) -> int:
        """Packed samples, padding included (``MicroBatch.sample_count``)."""
        return len(self.slots)

    @property
    def num_real_samples(self) -> int:
        return sum(not s.is_padding for s in self.slots)

    @property
    def num_padding_samples(self) -> int:
        return sum(s.is_padding for s in self.slots)

    @property
    def has_pixels(self) -> bool:
        """True when the bin carries image features (its forward runs the vision tower)."""
        return bool(self.images)

    @property
    def placeholder_count(self) -> int:
        """Placeholder tokens of all images and videos (== feature rows the model scatters)."""
        return sum(im.length for im in self.images)

    @property
    def image_grids(self) -> list[tuple[int, ...]]:
        """Grids of the images (videos: :attr:`video_grids`), pack order."""
        return [im.grid for im in self.images if not im.is_video]

    @property
    def video_grids(self) -> list[tuple[int, ...]]:
        """Grids of the videos, pack order."""
        return [im.grid for im in self.images if im.is_video]

    @property
    def images_per_sample(self) -> list[int]:
        return [s.num_images for s in self.slots]

    @property
    def sample_indices(self) -> list[int]:
        """Input positions of the real samples, in pack order (pads excluded)."""
        return [s.sample_index for s in self.slots if s.sample_index is not None and not s.is_padding]


@dataclass(frozen=True)
class PackedBatch:
    """Samples packed into micro-batches of one capacity, with totals: what :func:`~trainer_lib.pack_samples`
    returns, and each rank's share of a mini-batch (:mod:`trainer_lib.planning.ranks`).

    Totals are summed over the packed micro-batches (never inferred from one micro-batch's shape).
    """

    micro_batches: list[PackedMicroBatch]
    micro_batch_max_tokens: int

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches)

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def num_loss_tokens(self) -> int:
        return sum(mb.num_loss_tokens for mb in self.micro_batches)

    @property
    def num_samples(self) -> int:
        """Real samples (padding excluded)."""
        return sum(mb.num_real_samples for mb in self.micro_batches)

    @property
    def num_padding_samples(self) -> int:
        return sum(mb.num_padding_samples for mb in self.micro_batches)

    @property
    def num_padding_tokens(self) -> int:
        return sum(s.length for mb in self.micro_batches for s in mb.slots if s.is_padding)

    @property
    def capacity(self) -> int:
        """Token slots of the bins: ``sum(max(cap, len(mb)))`` (an oversized sample fills its own bin)."""
        return sum(max(self.micro_batch_max_tokens, mb.num_tokens) for mb in self.micro_batches)

    @property
    def waste(self) -> float:
        """Fraction of the bins' capacity not holding real tokens (empty room + padding samples)."""
        cap = self.capacity
        return 1.0 - (self.num_tokens - self.num_padding_tokens) / cap if cap else 0.0


def replace_loss_mask(packed: PackedMicroBatch, loss_mask: list[bool]) -> PackedMicroBatch:
    """A copy with another loss mask (e.g. after materialization zeroed a sample), re-accounted.

    Args:
        loss_mask: bool ``[num_tokens]``.

    Raises:
        ValueError: ``loss_mask`` does not have ``num_tokens`` entries, or is True at a sample's
            first token (it has no logprob: the packed forward drops it from its loss mask, so
            ``num_loss_tokens`` would count a token no loss sees).
    """
    if len(loss_mask) != packed.num_tokens:
        raise ValueError(f"{len(loss_mask)} loss-mask entries for {packed.num_tokens} tokens")
    _refuse_loss_at_starts(packed.slots, loss_mask)
    slots = tuple(
        dataclasses.replace(s, num_loss_tokens=loss_mask[s.start : s.start + s.length].count(True))
        for s in packed.slots
    )
    micro_batch = msgspec.structs.replace(packed.micro_batch, loss_mask=loss_mask)
    return PackedMicroBatch(micro_batch=micro_batch, slots=slots, images=packed.images)


def _refuse_loss_at_starts(slots: tuple[SampleSlot, ...], loss_mask: list[bool]) -> None:
    """Raises ValueError where ``loss_mask`` is True at a slot's first token."""
    for i, s in enumerate(slots):
        if s.length and loss_mask[s.start]:
            raise ValueError(
                f"loss_mask is True at position {s.start}, the first token of packed sample {i}: it "
                f"has no logprob (nothing precedes it) and takes no loss"
            )


def wire_struct(slots: tuple[SampleSlot, ...], images: tuple[ImageSpan, ...]) -> MicroBatch:
    """The wire struct of a micro-batch: its slots' samples' per-token arrays concatenated (in slot
    order), one ``seq_lens`` entry per slot, the refs in pack order, ``mm_token_type_ids`` from
    the image spans' runs (0 text, 1 image, 2 video: transformers' convention) and the synthetic
    pads' grids. ``(run_id, lora_id)``: the first slot's (the packer keeps one per micro-batch).

    Raises:
        IndexError: no slots (a micro-batch holds at least one sample).
    """
    input_ids: list[int] = []
    loss_mask: list[bool] = []
    advantages: list[float] = []
    logprobs: list[float] = []
    for slot in slots:  # list += list copies in C: ~6x faster than chaining iterators
        input_ids += slot.sample.input_ids
        loss_mask += slot.sample.loss_mask
        advantages += slot.sample.advantages
        logprobs += slot.sample.inference_logprobs
    type_ids = [0] * len(input_ids)
    for im in images:
        for start, length in im.token_runs:
            type_ids[start : start + length] = [2 if im.is_video else 1] * length
    first = slots[0].sample
    return MicroBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        advantages=advantages,
        inference_logprobs=logprobs,
        seq_lens=[s.length for s in slots],
        sample_count=len(slots),
        mm_refs=[im.ref for im in images if im.ref is not None],
        mm_token_type_ids=type_ids,
        images_per_sample=[s.num_images for s in slots],
        is_padding=[s.is_padding for s in slots],
        synthetic_grids=[list(im.grid) for im in images if im.ref is None] or None,
        run_id=first.run_id,
        lora_id=first.lora_id,
    )
