"""Pack training samples into multimodal micro-batches (docs/PACKING.md §1).

Samples are placed first-fit-decreasing (by token count) into bins of at most
``micro_batch_max_tokens`` tokens (default ``seq_len``; a larger cap is an error). A sample
longer than the cap gets a bin of its own. Three rules keep a bin runnable:

- **isolation**: samples of different ``(run_id, lora_id)`` never share a bin;
- **stray placeholders**: a text-only sample whose ids contain the image placeholder token
  (e.g. a literal ``<|image_pad|>`` inside tool-call text) never shares a bin with pixel
  features: transformers locates image slots by ``input_ids == image_token_id`` before its
  ``masked_scatter``, so that sample would add a token and the scatter would count N+1 vs N;
- **located image runs**: each sample's images are found by ``mm_token_type_ids`` when given,
  else by the placeholder token, and every run is split by the refs' grid-derived
  placeholder counts (adjacent images share one run). A mismatch raises
  :class:`protocol.errors.PlaceholderMismatch` naming the sample, the token id and both counts.
  Videos (issue 44) are located the same way under the spec's video token (typed 2, transformers'
  convention), each in its runs (``adapter.video_token_runs``), and sit among the images' spans in
  prompt order; a text sample holding the video token is a stray placeholder too.

The output wraps the wire struct :class:`protocol.structs.MicroBatch` in a trainer-side
:class:`PackedMicroBatch`, which adds derived views: per-sample slots (offsets, image counts,
padding flags, the samples themselves) and the image spans (placeholder offsets rebased onto the
pack). Everything those views derive from is on the wire, so a micro-batch shipped to another
rank comes back whole with :func:`rebuild_micro_batch`. Pure Python + numpy; no torch.

Example::

    spec = PackingSpec.from_adapter(adapter, model.config, pad_token_id=tokenizer.pad_token_id)
    step = pack_samples(samples, spec, seq_len=8192)
    for mb in step.micro_batches:
        mb.micro_batch.seq_lens, mb.num_tokens, mb.num_loss_tokens, mb.images
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from protocol.placeholder_counts import (
    check_no_typed_images,
    check_placeholder_counts,
    grid_placeholder_count,
)
from protocol.placeholders import locate_image_runs, locate_video_runs
from protocol.structs import MicroBatch, MMRefs, RawMMRef, TrainingSample
from trainer_lib.micro_batch import ImageSpan, PackedBatch, PackedMicroBatch, SampleSlot
from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY, bin_capacity, plan_bins
from trainer_lib.spec import PackingSpec

__all__ = [
    "PackEntry",
    "SampleAnalysis",
    "analyze_entry",
    "build_micro_batch",
    "pack_samples",
    "rebuild_micro_batch",
]


@dataclass(frozen=True)
class PackEntry:
    """One sample to pack; ``synthetic_grid`` makes it a pad carrying one zero-feature image."""

    sample: TrainingSample
    sample_index: int | None = None
    synthetic_grid: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SampleAnalysis:
    """What packing needs to know of one sample, found once by :func:`analyze_entry`."""

    length: int
    """Tokens (``len(input_ids)``)."""
    kind: int
    """:data:`~trainer_lib.planning.bins.PIXELS` (images, real or synthetic), ``STRAY`` (text holding the
    placeholder token) or ``NEUTRAL``."""
    spans: list[tuple[int, int, tuple[int, ...], RawMMRef | None]]
    """(start in sample, length, grid, ref) per image or video, in prompt order; a video's
    ``length`` is all its placeholder tokens (its runs: :attr:`runs`)."""
    runs: dict[int, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    """Per span index, a video's placeholder runs (start in sample, length) where it has more than
    one (Qwen3-VL: one per temporal patch, its timestamp text between)."""

    @property
    def image_tokens(self) -> list[int]:
        """Placeholder tokens per image or video (what its vision encode costs)."""
        return [span[1] for span in self.spans]

    @property
    def image_key(self) -> tuple[str, ...] | None:
        """The sha256 of each real image or video, prompt order (samples with equal keys show the same
        images: one encode per micro-batch under dedup); None without real images."""
        return tuple(span[3].sha256 for span in self.spans if span[3] is not None) or None


def analyze_entry(entry: PackEntry, spec: PackingSpec, position: int | None) -> SampleAnalysis:
    """Check one sample and locate its image runs (``position`` names it in errors); with the
    spec's adapter, every ref's ``num_placeholders`` is checked against its grid.

    Raises:
        ValueError: an empty sample, a loss on its first token, a pad (``is_padding``) with a loss
            token (pads are zero-loss and out of every count), or a synthetic pad without the
            spec's adapter or with refs, or a video ref with a spec that has no video token id.
        PlaceholderMismatch: image or video tokens that do not match the refs (see
            :func:`locate_image_runs`, :func:`locate_video_runs`).
    """
    placeholder_token_id, num_placeholders = spec.placeholder_token_id, spec.num_placeholders
    s = entry.sample
    n = len(s.input_ids)
    if not n:
        raise ValueError(f"sample {position} is empty")
    if s.loss_mask[0]:
        raise ValueError(
            f"sample {position}: loss_mask[0] is True, but a sample's first token has no logprob "
            f"(nothing precedes it); the prompt's tokens take no loss"
        )
    if s.is_padding and any(s.loss_mask):
        raise ValueError(
            f"sample {position} is a pad (is_padding=True) with {sum(s.loss_mask)} loss token(s): pads "
            f"take no loss and are left out of every count (make_pad_sample builds them)"
        )
    refs = list(s.mm_refs.items) if s.mm_refs is not None else []
    type_ids = s.mm_refs.mm_token_type_ids if s.mm_refs is not None else None
    if entry.synthetic_grid is not None:
        if refs:
            raise ValueError("a synthetic pad image cannot be combined with refs")
        grid = tuple(entry.synthetic_grid)
        if num_placeholders is None:
            raise ValueError("a synthetic pad image needs the spec's adapter (num_placeholders)")
        count = grid_placeholder_count(num_placeholders, grid, sample=position)
        runs = locate_image_runs(s.input_ids, [], placeholder_token_id, counts=[count], sample=position)
        return SampleAnalysis(n, PIXELS, [(runs[0][0], runs[0][1], grid, None)])
    if not refs:
        check_no_typed_images(type_ids, sample=position)
        stray = placeholder_token_id in s.input_ids or (
            spec.video_token_id is not None and spec.video_token_id in s.input_ids
        )
        return SampleAnalysis(n, STRAY if stray else NEUTRAL, [])
    images = [r for r in refs if r.modality != "video"]
    if num_placeholders is not None:
        check_placeholder_counts(images, num_placeholders, sample=position)
    runs = locate_image_runs(
        s.input_ids, images, placeholder_token_id, mm_token_type_ids=type_ids, sample=position
    )
    spans = [(start, length, tuple(r.grid), r) for (start, length), r in zip(runs, images, strict=True)]
    if len(images) == len(refs):
        return SampleAnalysis(n, PIXELS, spans)
    videos = [r for r in refs if r.modality == "video"]
    ordered = sorted(
        [(span, ()) for span in spans] + _video_spans(s.input_ids, videos, type_ids, spec, position),
        key=lambda pair: pair[0][0],
    )
    multi = {k: video_runs for k, (_, video_runs) in enumerate(ordered) if len(video_runs) > 1}
    return SampleAnalysis(n, PIXELS, [span for span, _ in ordered], multi)


def _video_spans(
    input_ids: list[int],
    videos: list[RawMMRef],
    type_ids: list[int] | None,
    spec: PackingSpec,
    position: int | None,
) -> list[tuple[tuple[int, int, tuple[int, ...], RawMMRef], tuple[tuple[int, int], ...]]]:
    """Each video's span ``(first start, tokens, grid, ref)`` and its runs, located under the
    spec's video token (:func:`protocol.placeholders.locate_video_runs`); with the spec's adapter
    each ref's count is checked against ``adapter.video_num_placeholders`` and its runs are
    ``adapter.video_token_runs`` (without it: one run of ``num_placeholders``).

    Raises:
        ValueError: the spec has no video token id.
        PlaceholderMismatch: see :func:`locate_video_runs`.
    """
    if spec.video_token_id is None:
        raise ValueError(
            f"sample {position} has {len(videos)} video ref(s) but the spec has no video token id "
            f"(PackingSpec.from_adapter with an adapter that has a video processor)"
        )
    token_runs = spec.video_token_runs
    if token_runs is not None:
        check_placeholder_counts(videos, spec.adapter.video_num_placeholders, sample=position)  # type: ignore[union-attr]
    runs = [token_runs(r.grid) if token_runs is not None else [r.num_placeholders] for r in videos]
    found = locate_video_runs(
        input_ids, videos, spec.video_token_id, runs=runs, mm_token_type_ids=type_ids, sample=position
    )
    return [
        ((per[0][0], sum(n for _, n in per), tuple(r.grid), r), tuple(per))
        for per, r in zip(found, videos, strict=True)
    ]


def build_micro_batch(
    entries: Sequence[PackEntry], spec: PackingSpec, analyses: Sequence[SampleAnalysis] | None = None
) -> PackedMicroBatch:
    """Lay entries out (in the given order) as one :class:`PackedMicroBatch` (``analyses``: the
    entries', when already made by :func:`analyze_entry`): its slots and image spans now, its wire
    struct's per-token arrays concatenated on the first read of ``.micro_batch``
    (:func:`~trainer_lib.micro_batch.wire_struct`; a :class:`~protocol.structs.TrainingSample`'s
    arrays were checked aligned when it was made).

    Raises:
        ValueError: entries of different ``(run_id, lora_id)``, pixels mixed with a stray
            placeholder sample, an empty sample, or a loss on a sample's first token (it has no
            logprob).
        PlaceholderMismatch: see :func:`locate_image_runs`.
    """
    if not entries:
        raise ValueError("a micro-batch needs at least one sample")
    if analyses is None:
        analyses = [analyze_entry(e, spec, e.sample_index) for e in entries]
    keys = {e.sample.isolation_key for e in entries}
    if len(keys) != 1:
        raise ValueError(
            f"samples of different (run_id, lora_id) in one micro-batch: {sorted(keys, key=str)}"
        )
    if {PIXELS, STRAY} <= {a.kind for a in analyses}:
        raise ValueError(
            f"a text sample containing the placeholder token {spec.placeholder_token_id} cannot share a "
            f"micro-batch with image features"
        )
    slots, images = _layout(entries, analyses)
    return PackedMicroBatch(slots=slots, images=images)  # the wire struct on first read


def _layout(
    entries: Sequence[PackEntry], analyses: Sequence[SampleAnalysis]
) -> tuple[tuple[SampleSlot, ...], tuple[ImageSpan, ...]]:
    """Each entry's slot and each image's span, at their offsets in the concatenation."""
    slots: list[SampleSlot] = []
    images: list[ImageSpan] = []
    start = 0
    for e, a in zip(entries, analyses, strict=True):
        first = len(images)
        for k, (offset, n, grid, ref) in enumerate(a.spans):
            runs = tuple((start + o, m) for o, m in a.runs.get(k, ()))
            images.append(ImageSpan(len(slots), start + offset, n, grid, ref, runs))
        slots.append(
            SampleSlot(
                sample_index=e.sample_index,
                start=start,
                length=a.length,
                num_images=len(a.spans),
                first_image=first,
                num_loss_tokens=e.sample.loss_mask.count(True),
                is_padding=e.sample.is_padding,
                stray_placeholders=a.kind == STRAY,
                sample=e.sample,
            )
        )
        start += a.length
    return tuple(slots), tuple(images)


def pack_samples(
    samples: Sequence[TrainingSample | PackEntry],
    spec: PackingSpec,
    *,
    seq_len: int,
    micro_batch_max_tokens: int | None = None,
) -> PackedBatch:
    """Pack samples into micro-batches, first-fit-decreasing (see the module docstring); samples
    showing the same images first try the micro-batches already holding them (the trainer then
    encodes each such image once per micro-batch).

    Args:
        samples: training samples (or :class:`PackEntry`, e.g. synthetic-image pads); padding
            samples (``is_padding``) are packed like any other and placed after the real samples
            of their bin.
        spec: the family's facts (the placeholder id; with its adapter, every ref's
            ``num_placeholders`` is checked against its grid and synthetic pads are counted).
        seq_len: the trainer's sequence length.
        micro_batch_max_tokens: bin size; default ``seq_len``; must be ``<= seq_len``.

    Returns:
        A :class:`PackedBatch`; each sample lands in exactly one micro-batch.

    Raises:
        ValueError: a bad cap (see :func:`bin_capacity`), an empty sample, a loss on a
            sample's first token (it has no logprob), or a pad with a loss token.
        PlaceholderMismatch: a sample whose image tokens do not match its refs.
    """
    cap = bin_capacity(seq_len, micro_batch_max_tokens)
    entries = [e if isinstance(e, PackEntry) else PackEntry(e, i) for i, e in enumerate(samples)]
    analyses = [
        analyze_entry(e, spec, i if e.sample_index is None else e.sample_index) for i, e in enumerate(entries)
    ]
    lengths = [a.length for a in analyses]
    keys = [e.sample.isolation_key for e in entries]
    kinds = [a.kind for a in analyses]
    bins = plan_bins(lengths, cap, keys=keys, kinds=kinds, groups=[a.image_key for a in analyses])
    micro_batches = []
    for b in bins:
        b = sorted(b, key=lambda i: (entries[i].sample.is_padding, i))
        micro_batches.append(build_micro_batch([entries[i] for i in b], spec, [analyses[i] for i in b]))
    return PackedBatch(micro_batches=micro_batches, micro_batch_max_tokens=cap)


def rebuild_micro_batch(micro_batch: MicroBatch, spec: PackingSpec) -> PackedMicroBatch:
    """The :class:`PackedMicroBatch` of a micro-batch that crossed the wire.

    A packer (one process, or rank 0) ships ``encode(packed.micro_batch)``; the rank that runs
    it calls ``rebuild_micro_batch(decode_microbatch(data), spec)`` and gets the slots, image spans
    and accounting back. The samples are re-cut from the per-token arrays by ``seq_lens`` and
    re-packed with :func:`build_micro_batch`, so every packing check runs again, and the result
    must encode to the very micro-batch received. ``SampleSlot.sample_index`` becomes the sample's
    position in this micro-batch (the step-wide index is not on the wire).

    Args:
        micro_batch: as built by :func:`build_micro_batch` (``mm_token_type_ids``,
            ``images_per_sample`` and ``is_padding`` set; ``synthetic_grids`` for pad images).
        spec: the family's facts; its adapter is required when ``synthetic_grids`` is set.

    Raises:
        ValueError: a field :func:`build_micro_batch` always sets is missing, a sample mixes ref'd
            and synthetic images, or the rebuilt micro-batch differs from ``micro_batch`` (the
            message names the first differing field).
        PlaceholderMismatch: a sample's image tokens do not match its refs (see
            :func:`locate_image_runs`).
    """
    entries = _recut(micro_batch)
    packed = build_micro_batch(entries, spec)
    for name in MicroBatch.__struct_fields__:
        if getattr(packed.micro_batch, name) != getattr(micro_batch, name):
            raise ValueError(f"the micro-batch does not rebuild to itself: {name} differs")
    return dataclasses.replace(packed, micro_batch=micro_batch)


def _recut(mb: MicroBatch) -> list[PackEntry]:
    """The samples of a micro-batch, cut from its per-token arrays by ``seq_lens``; refs are dealt
    by ``images_per_sample``, then the synthetic grids (a pad's one image)."""
    types = mb.mm_token_type_ids
    if types is None or mb.images_per_sample is None or mb.is_padding is None:
        raise ValueError(
            "rebuilding needs mm_token_type_ids, images_per_sample and is_padding "
            "(build_micro_batch sets them)"
        )
    refs, grids = iter(mb.mm_refs), iter(mb.synthetic_grids or ())
    entries: list[PackEntry] = []
    start = 0
    rows = zip(mb.seq_lens, mb.images_per_sample, mb.is_padding, strict=True)
    for i, (length, n_images, pad) in enumerate(rows):
        end = start + length
        own_refs = list(itertools.islice(refs, n_images))  # refs first, then the synthetic grids
        synthetic = [tuple(g) for g in itertools.islice(grids, n_images - len(own_refs))]
        if synthetic and (own_refs or len(synthetic) != 1):
            raise ValueError(
                f"sample {i}: a pad carries exactly one synthetic image and no refs, got "
                f"{len(own_refs)} ref(s) and {len(synthetic)} synthetic image(s)"
            )
        sample = TrainingSample(
            input_ids=mb.input_ids[start:end],
            loss_mask=mb.loss_mask[start:end],
            advantages=mb.advantages[start:end],
            inference_logprobs=mb.inference_logprobs[start:end],
            mm_refs=None if synthetic else MMRefs(items=own_refs, mm_token_type_ids=types[start:end]),
            run_id=mb.run_id,
            lora_id=mb.lora_id,
            is_padding=pad,
        )
        entries.append(PackEntry(sample, i, synthetic[0] if synthetic else None))
        start = end
    return entries
