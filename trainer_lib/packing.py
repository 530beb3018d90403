"""Pack training samples into multimodal micro-batches (DESIGN §6, docs/PACKING.md).

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

The output wraps the wire struct :class:`protocol.structs.MicroBatch` in a trainer-side
:class:`PackedMicroBatch`, which adds derived views: per-sample slots (offsets, image counts,
padding flags, the samples themselves) and the image spans (placeholder offsets rebased onto the
pack). Everything those views derive from is on the wire, so a micro-batch shipped to another
rank comes back whole with :func:`rebuild_micro_batch`. Pure Python + numpy; no torch.

Example::

    step = pack_samples(samples, placeholder_token_id=261, seq_len=8192)
    for mb in step.micro_batches:
        mb.micro_batch.seq_lens, mb.num_tokens, mb.num_loss_tokens, mb.images
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from protocol.errors import PlaceholderMismatch
from protocol.placeholders import locate_image_runs
from protocol.structs import MicroBatch, MMRefs, RawMMRef, TrainingSample

__all__ = [
    "NEUTRAL",
    "PIXELS",
    "STRAY",
    "ImageSpan",
    "PackEntry",
    "PackedMicroBatch",
    "PackedStep",
    "SampleSlot",
    "build_micro_batch",
    "check_placeholder_alignment",
    "pack_samples",
    "plan_bins",
    "rebuild_micro_batch",
    "replace_loss_mask",
    "resolve_cap",
]

NEUTRAL, PIXELS, STRAY = 0, 1, 2
"""Bin-compatibility classes: text without placeholder tokens joins any bin; a sample with
images (``PIXELS``) never joins a bin holding a ``STRAY`` text sample, and vice versa."""


@dataclass(frozen=True)
class ImageSpan:
    """One image of a micro-batch: where its placeholder run sits in the pack.

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
    ``adapter.synthesize_placeholder(grid)``)."""


@dataclass(frozen=True)
class SampleSlot:
    """One packed sample."""

    index: int | None
    """Position of the sample in the list given to :func:`pack_samples`; None for a pad made here."""
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


@dataclass(frozen=True)
class PackedMicroBatch:
    """A :class:`protocol.structs.MicroBatch` plus the trainer-side facts it has no field for.

    Every per-token array (``micro_batch.input_ids``, ``loss_mask``, ``advantages``,
    ``inference_logprobs`` and :attr:`mm_token_type_ids`) has ``num_tokens`` entries (checked on
    construction). Padding samples sit after the real samples of the bin.
    """

    micro_batch: MicroBatch
    """The wire struct; everything below can be rebuilt from it (:func:`rebuild_micro_batch`)."""
    slots: tuple[SampleSlot, ...]
    images: tuple[ImageSpan, ...]
    """Every image in pack order (sample order, then prompt order): the order the features are
    concatenated in and the order transformers' ``masked_scatter`` fills the placeholders."""
    run_id: str
    lora_id: str | None
    num_tokens: int
    num_loss_tokens: int

    @property
    def mm_token_type_ids(self) -> list[int]:
        """Per token: 0 text, 1 image placeholder (transformers' convention)."""
        return self.micro_batch.mm_token_type_ids or []

    def __post_init__(self) -> None:
        mb = self.micro_batch
        n = len(mb.input_ids)
        if n != self.num_tokens or len(self.mm_token_type_ids) != n:
            raise ValueError(
                f"per-token arrays misaligned: input_ids {n}, mm_token_type_ids "
                f"{len(self.mm_token_type_ids)}, num_tokens {self.num_tokens}"
            )
        for name in ("loss_mask", "advantages", "inference_logprobs"):  # MicroBatch checks these too
            if len(getattr(mb, name)) != n:
                raise ValueError(
                    f"per-token arrays misaligned: {name} {len(getattr(mb, name))}, input_ids {n}"
                )
        if len(self.slots) != mb.sample_count or [s.length for s in self.slots] != mb.seq_lens:
            raise ValueError("slots do not match seq_lens")
        n_typed = self.mm_token_type_ids.count(1)
        if n_typed != sum(im.length for im in self.images):
            raise ValueError(
                f"{n_typed} image-typed tokens for image spans of {self.placeholder_count} tokens"
            )
        if sum(im.ref is not None for im in self.images) != len(mb.mm_refs):
            raise ValueError(f"{len(mb.mm_refs)} mm_refs for {len(self.images)} images")

    @property
    def seq_lens(self) -> list[int]:
        return self.micro_batch.seq_lens

    @property
    def sample_count(self) -> int:
        """Packed samples, padding included (``MicroBatch.sample_count``)."""
        return self.micro_batch.sample_count

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
        """Placeholder tokens of all images (== feature rows the model scatters)."""
        return sum(im.length for im in self.images)

    @property
    def image_grids(self) -> list[tuple[int, ...]]:
        return [im.grid for im in self.images]

    @property
    def images_per_sample(self) -> list[int]:
        return [s.num_images for s in self.slots]

    @property
    def sample_indices(self) -> list[int]:
        """Input positions of the real samples, in pack order (pads excluded)."""
        return [s.index for s in self.slots if s.index is not None and not s.is_padding]


@dataclass(frozen=True)
class PackedStep:
    """The micro-batches of one step (or of one rank's share of a mini-batch), with totals.

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


@dataclass(frozen=True)
class PackEntry:
    """One sample to pack; ``synthetic_grid`` makes it a pad carrying one zero-feature image."""

    sample: TrainingSample
    index: int | None = None
    synthetic_grid: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _Analysis:
    length: int
    kind: int
    spans: list[tuple[int, int, tuple[int, ...], RawMMRef | None]]
    """(start in sample, length, grid, ref) per image, in prompt order."""


def resolve_cap(seq_len: int, micro_batch_max_tokens: int | None = None) -> int:
    """The bin size: ``micro_batch_max_tokens`` or ``seq_len``.

    Raises:
        ValueError: a non-positive value, or a cap larger than ``seq_len`` (prime-rl #2183).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    cap = seq_len if micro_batch_max_tokens is None else micro_batch_max_tokens
    if cap < 1:
        raise ValueError(f"micro_batch_max_tokens must be >= 1, got {cap}")
    if cap > seq_len:
        raise ValueError(
            f"micro_batch_max_tokens {cap} is larger than seq_len {seq_len}; it must be <= seq_len"
        )
    return cap


def check_placeholder_alignment(
    input_ids: Any,
    placeholder_token_id: int,
    features: Any,
    *,
    mm_token_type_ids: Any = None,
    merge_size: int | None = None,
) -> int:
    """The tripwire before ``masked_scatter``: placeholder tokens must equal feature rows.

    transformers (``Qwen2VLModel.get_placeholder_mask`` in 5.19) checks this too, but only after
    the vision tower ran and with a message that names neither the token nor the shapes; on a
    data-parallel rank that raise comes after collectives have started. Call this first.

    Args:
        input_ids: ``[L]`` or ``[1, L]`` ids (torch tensor, numpy array or list).
        placeholder_token_id: e.g. the id of ``<|image_pad|>`` (``config.image_token_id``).
        features: the rows that will be scattered: image embeddings ``[N, hidden]`` (a tensor or
            array: ``N = shape[0]``), an int ``N``, or the family's feature mapping with an
            ``image_grid_thw`` ``[num_images, 3]`` entry (``N = sum(t*h*w) // merge_size**2``).
        mm_token_type_ids: optional ``[L]``/``[1, L]``; when given, its image positions must be
            exactly the placeholder-token positions.
        merge_size: spatial merge size, required with a grid mapping.

    Returns:
        The placeholder count ``N``.

    Raises:
        ValueError: the counts (or the typed positions) differ; the message names the token id,
            both counts and the shapes.
    """
    ids = _as_array(input_ids)
    n_tokens = int((ids == placeholder_token_id).sum())
    if isinstance(features, Mapping):
        grid = _as_array(features["image_grid_thw"]) if "image_grid_thw" in features else None
        if grid is None or merge_size is None:
            raise ValueError("a feature mapping needs an 'image_grid_thw' entry and merge_size")
        n_features = int(grid.prod(-1).sum()) // merge_size**2 if len(grid) else 0
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in features.items() if hasattr(v, "shape"))
    elif isinstance(features, int):
        n_features, shapes = features, f"{features} rows"
    else:
        n_features, shapes = int(features.shape[0]), f"features {tuple(features.shape)}"
    if n_tokens != n_features:
        raise ValueError(
            f"image placeholder token id {placeholder_token_id}: {n_tokens} tokens in input_ids "
            f"{tuple(ids.shape)} but {n_features} feature rows ({shapes})"
        )
    if mm_token_type_ids is not None:
        types = _as_array(mm_token_type_ids)
        typed = types == 1
        is_tok = ids == placeholder_token_id
        if typed.shape != is_tok.shape or bool((typed != is_tok).any()):
            raise ValueError(
                f"image placeholder token id {placeholder_token_id}: {int(is_tok.sum())} tokens in "
                f"input_ids {tuple(ids.shape)} but {int(typed.sum())} image-typed positions in "
                f"mm_token_type_ids {tuple(types.shape)} (not the same positions); features: {shapes}"
            )
    return n_tokens


def _as_array(x: Any) -> Any:
    """Tensors and arrays pass through (comparisons and sums work on both); lists become arrays."""
    return x if hasattr(x, "shape") else np.asarray(x)


def _grid_count(
    num_placeholders: Callable[[Sequence[int]], int],
    grid: Sequence[int],
    position: int | None,
    ref: RawMMRef | None = None,
) -> int:
    """``num_placeholders(grid)``; a grid the adapter cannot read is a :class:`PlaceholderMismatch`."""
    try:
        return int(num_placeholders(grid))
    except (TypeError, ValueError) as e:
        raise PlaceholderMismatch(
            f"sample {position}: grid {list(grid)} gives no placeholder count ({e})",
            ref=None if ref is None else ref.ref,
        ) from e


def _analyze(
    entry: PackEntry,
    placeholder_token_id: int,
    num_placeholders: Callable[[Sequence[int]], int] | None,
    position: int | None,
) -> _Analysis:
    s = entry.sample
    n = len(s.input_ids)
    if not n:
        raise ValueError(f"sample {position} is empty")
    if s.loss_mask[0]:
        raise ValueError(
            f"sample {position}: loss_mask[0] is True, but a sample's first token has no logprob "
            f"(nothing precedes it); the prompt's tokens take no loss"
        )
    refs = list(s.mm_refs.items) if s.mm_refs is not None else []
    type_ids = s.mm_refs.mm_token_type_ids if s.mm_refs is not None else None
    if entry.synthetic_grid is not None:
        if refs:
            raise ValueError("a synthetic pad image cannot be combined with refs")
        grid = tuple(entry.synthetic_grid)
        if num_placeholders is None:
            raise ValueError("a synthetic pad image needs num_placeholders (the adapter's)")
        count = _grid_count(num_placeholders, grid, position)
        runs = locate_image_runs(s.input_ids, [], placeholder_token_id, counts=[count], sample=position)
        return _Analysis(n, PIXELS, [(runs[0][0], runs[0][1], grid, None)])
    if not refs:
        if type_ids is not None and any(type_ids):
            raise PlaceholderMismatch(
                f"sample {position}: mm_token_type_ids marks {sum(type_ids)} image token(s) but the "
                f"sample has no images"
            )
        stray = placeholder_token_id in s.input_ids
        return _Analysis(n, STRAY if stray else NEUTRAL, [])
    counts = [r.num_placeholders for r in refs]
    if num_placeholders is not None:
        for r in refs:
            want = _grid_count(num_placeholders, r.grid, position, r)
            if want != r.num_placeholders:
                raise PlaceholderMismatch(
                    f"sample {position}: ref claims {r.num_placeholders} placeholders, its grid "
                    f"{r.grid} gives {want}",
                    ref=r.ref,
                )
    runs = locate_image_runs(
        s.input_ids,
        refs,
        placeholder_token_id,
        mm_token_type_ids=type_ids,
        counts=counts,
        sample=position,
    )
    spans = [(start, length, tuple(r.grid), r) for (start, length), r in zip(runs, refs, strict=True)]
    return _Analysis(n, PIXELS, spans)


def plan_bins(
    lengths: Sequence[int],
    cap: int,
    *,
    keys: Sequence[Any] | None = None,
    kinds: Sequence[int] | None = None,
) -> list[list[int]]:
    """First-fit-decreasing bin assignment; returns bins of indices into ``lengths``.

    Items are visited by decreasing length (ties: input order); each goes into the first open bin
    of its key with room and a compatible kind, else opens a bin. An item longer than ``cap`` gets
    a bin of its own that nothing else joins. Bins are ordered by key (first-seen order), then by
    creation; indices inside a bin are ascending.

    Args:
        lengths: token count per item.
        cap: bin size in tokens.
        keys: isolation key per item (``(run_id, lora_id)``); items of different keys never share.
        kinds: :data:`NEUTRAL`, :data:`PIXELS` or :data:`STRAY` per item; PIXELS and STRAY never share.
    """
    n = len(lengths)
    lengths_list = [int(x) for x in lengths]
    kinds_list = [NEUTRAL] * n if kinds is None else [int(k) for k in kinds]
    groups: dict[Any, list[int]] = {}
    for i, key in enumerate(keys if keys is not None else [None] * n):
        groups.setdefault(key, []).append(i)
    out: list[list[int]] = []
    for members in groups.values():
        order = sorted(members, key=lambda i: -lengths_list[i])  # stable: ties keep input order
        m = len(order)
        # Remaining room per bin as seen by each kind (-1 where the kind may not join): one
        # vectorized first-fit search per item, no per-bin Python loop.
        room = {kind: np.full(m, -1, dtype=np.int64) for kind in (NEUTRAL, PIXELS, STRAY)}
        has_pix = [False] * m
        has_stray = [False] * m
        bins: list[list[int]] = []
        max_room = -1  # upper bound on any open bin's room (refreshed when a search fails)
        for i in order:
            size = lengths_list[i]
            kind = kinds_list[i]
            nb = len(bins)
            j = nb
            if size <= max_room:
                k = int((room[kind][:nb] >= size).argmax())
                if room[kind][k] >= size:
                    j = k
                else:
                    max_room = int(room[NEUTRAL][:nb].max())
            if j == nb:
                bins.append([i])
                left = cap - size if size <= cap else -1  # an oversized item closes its bin
                room[NEUTRAL][j] = room[PIXELS][j] = room[STRAY][j] = left
                max_room = max(max_room, left)
            else:
                bins[j].append(i)
                left = int(room[NEUTRAL][j]) - size  # NEUTRAL room is the bin's true room
                room[NEUTRAL][j] = left
                if not has_stray[j]:
                    room[PIXELS][j] = left
                if not has_pix[j]:
                    room[STRAY][j] = left
            if kind == PIXELS and not has_pix[j]:
                has_pix[j] = True
                room[STRAY][j] = -1
            elif kind == STRAY and not has_stray[j]:
                has_stray[j] = True
                room[PIXELS][j] = -1
        out.extend(sorted(b) for b in bins)
    return out


def build_micro_batch(
    entries: Sequence[PackEntry],
    analyses: Sequence[_Analysis] | None = None,
    *,
    placeholder_token_id: int,
    num_placeholders: Callable[[Sequence[int]], int] | None = None,
) -> PackedMicroBatch:
    """Concatenate entries (in the given order) into one :class:`PackedMicroBatch`.

    Raises:
        ValueError: entries of different ``(run_id, lora_id)``, pixels mixed with a stray
            placeholder sample, misaligned per-token arrays, an empty sample, or a loss on a
            sample's first token (it has no logprob).
        PlaceholderMismatch: see :func:`locate_image_runs`.
    """
    if not entries:
        raise ValueError("a micro-batch needs at least one sample")
    if analyses is None:
        analyses = [_analyze(e, placeholder_token_id, num_placeholders, e.index) for e in entries]
    keys = {(e.sample.run_id, e.sample.lora_id) for e in entries}
    if len(keys) != 1:
        raise ValueError(
            f"samples of different (run_id, lora_id) in one micro-batch: {sorted(keys, key=str)}"
        )
    (run_id, lora_id), kinds = next(iter(keys)), {a.kind for a in analyses}
    if PIXELS in kinds and STRAY in kinds:
        raise ValueError(
            f"a text sample containing the placeholder token {placeholder_token_id} cannot share a "
            f"micro-batch with image features"
        )
    input_ids: list[int] = []
    loss_mask: list[bool] = []
    advantages: list[float] = []
    logprobs: list[float] = []
    seq_lens: list[int] = []
    refs: list[RawMMRef] = []
    slots: list[SampleSlot] = []
    images: list[ImageSpan] = []
    n_loss = 0
    for e, a in zip(entries, analyses, strict=True):
        s = e.sample
        start = len(input_ids)
        input_ids.extend(s.input_ids)
        loss_mask.extend(s.loss_mask)
        advantages.extend(s.advantages)
        logprobs.extend(s.inference_logprobs)
        seq_lens.append(a.length)
        sample_loss = s.loss_mask.count(True)
        n_loss += sample_loss
        first = len(images)
        for sp_start, sp_len, grid, ref in a.spans:
            images.append(
                ImageSpan(slot=len(slots), start=start + sp_start, length=sp_len, grid=grid, ref=ref)
            )
            if ref is not None:
                refs.append(ref)
        slots.append(
            SampleSlot(
                index=e.index,
                start=start,
                length=a.length,
                num_images=len(a.spans),
                first_image=first,
                num_loss_tokens=sample_loss,
                is_padding=s.is_padding,
                stray_placeholders=a.kind == STRAY,
                sample=s,
            )
        )
    type_ids = [0] * len(input_ids)  # 0 text, 1 image placeholder
    for im in images:
        type_ids[im.start : im.start + im.length] = [1] * im.length
    mb = MicroBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        advantages=advantages,
        inference_logprobs=logprobs,
        seq_lens=seq_lens,
        sample_count=len(slots),
        mm_refs=refs,
        mm_token_type_ids=type_ids,
        images_per_sample=[s.num_images for s in slots],
        is_padding=[s.is_padding for s in slots],
        synthetic_grids=[list(im.grid) for im in images if im.ref is None] or None,
        run_id=run_id,
        lora_id=lora_id,
    )
    return PackedMicroBatch(
        micro_batch=mb,
        slots=tuple(slots),
        images=tuple(images),
        run_id=run_id,
        lora_id=lora_id,
        num_tokens=len(input_ids),
        num_loss_tokens=n_loss,
    )


def pack_samples(
    samples: Sequence[TrainingSample | PackEntry],
    *,
    placeholder_token_id: int,
    seq_len: int,
    micro_batch_max_tokens: int | None = None,
    num_placeholders: Callable[[Sequence[int]], int] | None = None,
    bins_multiple_of: int = 1,
) -> PackedStep:
    """Pack samples into micro-batches, first-fit-decreasing (see the module docstring).

    Args:
        samples: training samples (or :class:`PackEntry`, e.g. synthetic-image pads); padding
            samples (``is_padding``) are packed like any other and placed after the real samples
            of their bin.
        placeholder_token_id: the image placeholder id (``adapter.placeholder_token_id(config)``).
        seq_len: the trainer's sequence length.
        micro_batch_max_tokens: bin size; default ``seq_len``; must be ``<= seq_len``.
        num_placeholders: ``adapter.num_placeholders``; when given, every ref's
            ``num_placeholders`` is checked against its grid (and synthetic pads are counted).
        bins_multiple_of: e.g. the data-parallel size. When the FFD bin count ``B`` is not a
            multiple, the bins are re-planned with the smallest bin size (never above the cap)
            that still needs at most the next multiple ``T`` of bins: the same tokens spread
            evenly over ``T`` micro-batches instead of ``B`` full ones plus ``T - B`` pads.

    Returns:
        A :class:`PackedStep`; each sample lands in exactly one micro-batch.

    Raises:
        ValueError: a bad cap (see :func:`resolve_cap`), an empty sample, or a loss on a
            sample's first token (it has no logprob).
        PlaceholderMismatch: a sample whose image tokens do not match its refs.
    """
    cap = resolve_cap(seq_len, micro_batch_max_tokens)
    entries = [e if isinstance(e, PackEntry) else PackEntry(e, i) for i, e in enumerate(samples)]
    analyses = [
        _analyze(e, placeholder_token_id, num_placeholders, i if e.index is None else e.index)
        for i, e in enumerate(entries)
    ]
    lengths = [a.length for a in analyses]
    keys = [(e.sample.run_id, e.sample.lora_id) for e in entries]
    kinds = [a.kind for a in analyses]
    bins = plan_bins(lengths, cap, keys=keys, kinds=kinds)
    target = -(-len(bins) // bins_multiple_of) * bins_multiple_of
    if len(bins) < target:
        bins = _spread_bins(lengths, cap, keys, kinds, target) or bins
    micro_batches = []
    for b in bins:
        b = sorted(b, key=lambda i: (entries[i].sample.is_padding, i))
        micro_batches.append(
            build_micro_batch(
                [entries[i] for i in b], [analyses[i] for i in b], placeholder_token_id=placeholder_token_id
            )
        )
    return PackedStep(micro_batches=micro_batches, micro_batch_max_tokens=cap)


def rebuild_micro_batch(
    micro_batch: MicroBatch,
    *,
    placeholder_token_id: int,
    num_placeholders: Callable[[Sequence[int]], int] | None = None,
) -> PackedMicroBatch:
    """The :class:`PackedMicroBatch` of a micro-batch that crossed the wire.

    A packer (one process, or rank 0) ships ``encode(packed.micro_batch)``; the rank that runs
    it calls ``rebuild_micro_batch(decode_microbatch(data), ...)`` and gets the slots, image spans
    and accounting back. The samples are re-cut from the per-token arrays by ``seq_lens`` and
    re-packed with :func:`build_micro_batch`, so every packing check runs again, and the result
    must encode to the very micro-batch received. ``SampleSlot.index`` becomes the sample's
    position in this micro-batch (the step-wide index is not on the wire).

    Args:
        micro_batch: as built by :func:`build_micro_batch` (``mm_token_type_ids``,
            ``images_per_sample`` and ``is_padding`` set; ``synthetic_grids`` for pad images).
        placeholder_token_id: the image placeholder id.
        num_placeholders: ``adapter.num_placeholders``; required when ``synthetic_grids`` is set.

    Raises:
        ValueError: a field :func:`build_micro_batch` always sets is missing, a sample mixes ref'd
            and synthetic images, or the rebuilt micro-batch differs from ``micro_batch`` (the
            message names the first differing field).
        PlaceholderMismatch: a sample's image tokens do not match its refs (see
            :func:`locate_image_runs`).
    """
    mb = micro_batch
    types = mb.mm_token_type_ids
    if types is None or mb.images_per_sample is None or mb.is_padding is None:
        raise ValueError(
            "rebuilding needs mm_token_type_ids, images_per_sample and is_padding "
            "(build_micro_batch sets them)"
        )
    refs, grids = iter(mb.mm_refs), iter(mb.synthetic_grids or ())
    entries, start = [], 0
    rows = zip(mb.seq_lens, mb.images_per_sample, mb.is_padding, strict=True)
    for i, (length, n_images, pad) in enumerate(rows):
        end = start + length
        sample_types = types[start:end]
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
            mm_refs=None if synthetic else MMRefs(items=own_refs, mm_token_type_ids=sample_types),
            run_id=mb.run_id,
            lora_id=mb.lora_id,
            is_padding=pad,
        )
        entries.append(PackEntry(sample, i, synthetic[0] if synthetic else None))
        start = end
    if not entries:
        raise ValueError("a micro-batch needs at least one sample")
    packed = build_micro_batch(
        entries, placeholder_token_id=placeholder_token_id, num_placeholders=num_placeholders
    )
    for name in MicroBatch.__struct_fields__:
        if name != "position_ids" and getattr(packed.micro_batch, name) != getattr(mb, name):
            raise ValueError(f"the micro-batch does not rebuild to itself: {name} differs")
    return dataclasses.replace(packed, micro_batch=mb)


def _spread_bins(
    lengths: list[int], cap: int, keys: list[Any], kinds: list[int], target: int
) -> list[list[int]] | None:
    """FFD bins at the smallest bin size in ``[total / target, cap]`` that needs ``<= target`` bins
    (binary search; FFD's count is almost monotonic in the size, the result is checked)."""
    fitting = [n for n in lengths if n <= cap]
    lo = max([-(-sum(fitting) // target), *fitting], default=1)
    hi, best = cap, None
    while lo <= hi:
        mid = (lo + hi) // 2
        bins = plan_bins(lengths, mid, keys=keys, kinds=kinds)
        if len(bins) <= target:
            best, hi = bins, mid - 1
        else:
            lo = mid + 1
    return best


def replace_loss_mask(packed: PackedMicroBatch, loss_mask: list[bool]) -> PackedMicroBatch:
    """A copy with another loss mask (e.g. after materialization zeroed a sample), re-accounted."""
    if len(loss_mask) != packed.num_tokens:
        raise ValueError(f"{len(loss_mask)} loss-mask entries for {packed.num_tokens} tokens")
    slots = tuple(_replace_slot(s, loss_mask[s.start : s.start + s.length].count(True)) for s in packed.slots)
    return PackedMicroBatch(
        micro_batch=msgspec.structs.replace(packed.micro_batch, loss_mask=loss_mask),
        slots=slots,
        images=packed.images,
        run_id=packed.run_id,
        lora_id=packed.lora_id,
        num_tokens=packed.num_tokens,
        num_loss_tokens=loss_mask.count(True),
    )


def _replace_slot(slot: SampleSlot, num_loss_tokens: int) -> SampleSlot:
    return dataclasses.replace(slot, num_loss_tokens=num_loss_tokens)
