"""Rematerialize image features from refs, exactly as the server computed them (docs/PROTOCOL.md).

Each distinct ref in a batch (a step, with a shared :data:`Resolved`) is read, hash-checked,
decoded and processed once, by :meth:`protocol.adapters.ImageAdapter.resolve_raw` — the same
function the server plugin runs — on a thread pool the process keeps across calls. By default
(``dedup=True``) the features hold each distinct image once, written into them as soon as it is
processed (:mod:`trainer_lib.collate`), with an ``image_index`` per image slot, and the packed
forward runs the vision tower once per distinct image (docs/PACKING.md §6); ``dedup=False`` gives
one copy per slot, for a model forward that takes no precomputed image embeddings (none of the
families that pack: Kimi-VL and Kimi K2.5, which do not pack, or a plain HF forward).

Bytes come from the trainer's asset roots (:class:`protocol.roots.AssetRoots`:
``MMREF_ASSET_ROOTS`` folders and object stores through the node's read cache, v1 refs at
their path under ``MMREF_ASSET_ROOT`` or by content). A missing or unreadable image is either an
error naming the ref and the roots checked (``policy="error"``) or replaced by zero features of
the ref's grid with that sample's whole loss mask zeroed (``policy="placeholder_zero_loss"``,
one WARNING per batch): the sample still runs through the model (shapes and collectives stay
aligned) but trains nothing. An unreachable store (``StoreUnavailable``) is never replaced: the
image may exist, so the step must be retried.

How a batch is read is one value, :class:`~trainer_lib.config.MaterializeOptions` (policy, workers,
pixel mode, placeholder check, limits; ``MaterializeConfig.options()`` from ``MMREF_*``); where,
the ``source`` argument. The results are placed into the batch's slots by
:mod:`trainer_lib.assemble`, videos read by :mod:`trainer_lib.materialize_video`.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.adapters import ImageAdapter, ProcessedImage, ProcessedVideo
from protocol.adapters.values import CheckedRef
from protocol.errors import MMRefError
from protocol.store import ImageSource
from protocol.structs import TrainingSample
from trainer_lib import metrics
from trainer_lib.assemble import MaterializedBatch, MaterializeStats, assemble_images
from trainer_lib.collate import FeatureWriter
from trainer_lib.config import (
    DEFAULT_MATERIALIZE_OPTIONS,
    MaterializeConfig,
    MaterializeOptions,
    MissingPolicy,
)
from trainer_lib.materialize_video import add_videos, materialize_videos, split_video_features, video_refs
from trainer_lib.micro_batch import PackedMicroBatch, SampleSlot, replace_loss_mask
from trainer_lib.pool import run_on_pool
from trainer_lib.sources import checked_refs, describe_source, image_source
from trainer_lib.spec import PackingSpec

__all__ = [
    "MaterializeOptions",
    "MaterializeStats",
    "MaterializedBatch",
    "MaterializedMicroBatch",
    "MissingPolicy",
    "Resolved",
    "materialize",
    "materialize_micro_batch",
]

Resolved = dict[str, ProcessedImage | ProcessedVideo | MMRefError]
"""Refs already resolved in this step (ref string -> processed image, or the replaceable error
that stood for it): pass one dict to every :func:`materialize` / :func:`materialize_micro_batch`
call of a step and each distinct image is read, decoded and processed once per step."""

_log = logging.getLogger(__name__)


def materialize(
    samples: Sequence[TrainingSample],
    adapter: ImageAdapter,
    source: str | os.PathLike[str] | ImageSource,
    options: MaterializeOptions = DEFAULT_MATERIALIZE_OPTIONS,
    *,
    dedup: bool = True,
    resolved: Resolved | None = None,
) -> MaterializedBatch:
    """Resolve every sample's refs into model-ready features.

    Example: ``materialize(samples, adapter, cfg.image_source(), cfg.options())`` with the
    ``MMREF_*`` settings (:class:`~trainer_lib.MaterializeConfig`), or
    ``materialize(samples, adapter, output_root, MaterializeOptions(policy="error"))``.

    Args:
        samples: training samples; ``mm_refs`` may be None (text-only).
        adapter: the family's adapter (``protocol.adapters.load_adapter(model_dir)``); its
            fingerprint must match the refs'.
        source: where images are read: the trainer's :class:`protocol.roots.AssetRoots`
            (``MaterializeConfig.image_source()``) or one :class:`AssetStore`, an object-store
            URL, or a folder: v1 refs at their ``file://`` path inside it, else by content under
            it (a store copied or mounted elsewhere), v2 refs at ``images/<sha256[:16]><ext>``
            under it (:func:`trainer_lib.sources.image_source`).
        options: how they are read (:class:`~trainer_lib.config.MaterializeOptions`: the
            missing-image policy, workers, pixel mode, placeholder check, the server's limits).
        dedup: (default) each distinct image's features once plus ``image_index`` (an RL group of
            8 sharing an image: 8x fewer pixel bytes, one vision forward per image); False: one
            copy per image slot (a forward without precomputed image embeddings).
        resolved: refs already resolved this step, read and added to (:data:`Resolved`): each
            distinct image processed once per step, not once per call. Without it, each image's
            own tensors are freed once written into the features (``dedup``).

    Raises:
        MMRefError subclasses: under ``"error"`` any ref that fails; under either policy a ref
            that is invalid, outside the root, or for another family/fingerprint/grid, and
            ``StoreUnavailable`` (a root could not be asked: retry the step). The error's ``ref``
            names the ref, a read error's message the roots checked.
        GridMismatch, PlaceholderMismatch: a ``RawMMRef`` whose ``grid``/``num_placeholders``
            disagree with its ref string, or a sample whose prompt does not fit its refs.
    """
    per_sample, bodies, grids = checked_refs(samples, adapter, options.placeholder_token_id)
    keep = resolved is not None  # the caller's cache holds each processed image for the step
    resolved = {} if resolved is None else resolved
    todo = [(ref, CheckedRef(body, grids[ref])) for ref, body in bodies.items() if ref not in resolved]
    writer = FeatureWriter(adapter, grids) if dedup and grids else None  # rows: first-seen order
    store = image_source(source)
    resolve = functools.partial(
        _resolve, adapter=adapter, store=store, roots=describe_source(store), options=options
    )
    if writer is not None:  # each image copied into the collated features as it is processed
        resolve = functools.partial(_write, resolve=resolve, writer=writer, keep=keep)
    done = dict(zip((ref for ref, _ in todo), run_on_pool(resolve, todo, options.max_workers), strict=True))
    resolved.update((ref, r) for ref, r in done.items() if r is not None)
    results = {ref: done[ref] if ref in done else resolved[ref] for ref in bodies}
    written = {ref for ref, r in done.items() if not isinstance(r, MMRefError)}
    batch = assemble_images(samples, per_sample, results, grids, adapter, writer=writer)
    batch.stats.processed = len(written)
    if any(video_refs(s) for s in samples):  # issue 44: the same pool, policy and step cache
        videos = materialize_videos(samples, adapter, store, options, dedup=dedup, resolved=resolved)
        add_videos(batch, videos)
    metrics.IMAGES_MATERIALIZED.inc(batch.stats.processed)
    if batch.stats.placeholders:
        _warn_replaced(batch.stats, len(samples), describe_source(store))
    return batch


def _warn_replaced(stats: MaterializeStats, n_samples: int, roots: list[str]) -> None:
    """The one WARNING of a batch with replaced images: counts by error code, zeroed samples, roots."""
    _log.warning(
        "materialize: %d distinct image(s) replaced by zero features (%s; %d image slot(s)); loss zeroed "
        "for %d of %d sample(s); asset roots checked: %s",
        sum(stats.failed_by_code.values()),
        ", ".join(f"{code} {n}" for code, n in sorted(stats.failed_by_code.items())),
        stats.placeholders,
        stats.zeroed_samples,
        n_samples,
        ", ".join(roots) or "none",
    )


def _resolve(
    ref_and_body: tuple[str, CheckedRef],
    *,
    adapter: ImageAdapter,
    store: ImageSource,
    roots: list[str],
    options: MaterializeOptions,
) -> ProcessedImage | MMRefError:
    """``adapter.resolve_raw`` of one ref with ``options``' pixel mode and limits; with
    ``options.replace_missing``, a replaceable error is returned, not raised; a raised one names
    the roots checked (same type, code and ref)."""
    ref, body = ref_and_body
    try:
        return adapter.resolve_raw(
            body,
            store,
            ref=ref,
            raw_pixels=options.raw_pixels,
            max_bytes=options.max_image_bytes,
            max_pixels=options.max_image_pixels,
        )
    except MMRefError as e:
        if options.replaces(e):
            return e
        raise type(e)(f"{e.message} (trainer asset roots checked: {', '.join(roots)})", ref=e.ref) from e


def _write(
    ref_and_body: tuple[str, CheckedRef],
    *,
    resolve: Callable[[tuple[str, CheckedRef]], ProcessedImage | MMRefError],
    writer: FeatureWriter,
    keep: bool,
) -> ProcessedImage | MMRefError | None:
    """``resolve``, then (on the pool) the processed image copied into ``writer``; None in place
    of the image unless ``keep`` (its tensors freed now)."""
    result = resolve(ref_and_body)
    if isinstance(result, MMRefError):
        return result
    writer.put(ref_and_body[0], result)
    return result if keep else None


@dataclass(frozen=True)
class MaterializedMicroBatch:
    """A packed micro-batch with its image features (pack order) and the updated loss mask."""

    packed: PackedMicroBatch
    """Loss mask zeroed for samples whose image was replaced (``placeholder_zero_loss``), re-accounted."""
    features: dict[str, torch.Tensor]
    """Qwen-VL: ``pixel_values`` float32 ``[sum(t*h*w), C*T*P*P]``, ``image_grid_thw`` int64 ``[N, 3]``;
    empty without images. With ``dedup`` each distinct image once (see :attr:`image_index`)."""
    stats: MaterializeStats
    image_index: torch.Tensor | None = None
    """int64 ``[num images of the micro-batch]`` with ``dedup``: row of ``image_grid_thw`` per image
    (pass it to :func:`~trainer_lib.packed_inputs`)."""
    video_index: torch.Tensor | None = None
    """The same for videos (``features`` then holds ``pixel_values_videos``, ``video_grid_thw``
    and Qwen2.5-VL's ``second_per_grid_ts``, each distinct video once): pass it as
    ``packed_inputs(..., video_index=m.video_index)``."""


def materialize_micro_batch(
    packed: PackedMicroBatch,
    spec: PackingSpec,
    config: MaterializeConfig,
    *,
    dedup: bool = True,
    resolved: Resolved | None = None,
) -> MaterializedMicroBatch:
    """Features for every image and video of the micro-batch, in pack order.

    Real images go through :func:`materialize` with ``spec.adapter``, the pixel mode
    ``spec.raw_pixels`` and the settings of ``config`` (asset root, missing-image policy,
    workers, limits); synthetic pad images (``ImageSpan.ref is None``) are
    ``adapter.zero_features(grid)``, the grid bounded by ``adapter.check_grid`` first.
    ``dedup=True`` (default): each distinct image's features once plus ``image_index``;
    :func:`~trainer_lib.packed_logprobs` then runs the vision tower once per distinct image of the
    micro-batch and indexes its embeddings per image (gradients accumulate into that one forward).
    ``resolved``: one dict for every micro-batch of a step (:data:`Resolved`): each distinct image
    decoded once per step.

    Raises:
        MMRefError subclasses: see :func:`materialize`; GridMismatch for a synthetic grid the
            processor cannot produce.
        ValueError: a synthetic image before a real one (pads must follow the real samples), or
            a spec without an adapter.
    """
    adapter = spec.adapter
    if adapter is None:
        raise ValueError("materializing features needs the spec's adapter")
    kinds = [im.ref is None for im in packed.images]
    if kinds != sorted(kinds):
        raise ValueError("synthetic pad images must follow every real image of the micro-batch")
    real_slots = [s for s in packed.slots if s.num_images and packed.images[s.first_image].ref is not None]
    batch = materialize(
        [s.sample for s in real_slots],
        adapter,
        config.image_source(),
        config.options(raw_pixels=spec.raw_pixels),
        dedup=dedup,
        resolved=resolved,
    )
    synthetic = [  # a grid from the wire is bounded before anything is sized by it
        adapter.zero_features(adapter.check_grid(im.grid)).tensors for im in packed.images if im.ref is None
    ]
    images, videos = split_video_features(batch.features)
    parts: list[Mapping[str, torch.Tensor]] = ([images] if images else []) + synthetic
    if len(parts) > 1:  # real and pad images: one concatenation
        features = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    else:  # no second copy of the real images' features
        features = dict(parts[0]) if parts else {}
    image_index = None
    if dedup and features:
        real = batch.image_index if batch.image_index is not None else torch.empty(0, dtype=torch.int64)
        n_real = len(images.get(adapter.grid_field, ()))
        image_index = torch.cat([real, torch.arange(n_real, n_real + len(synthetic), dtype=torch.int64)])
    packed = _zero_losses(packed, real_slots, batch.samples)
    return MaterializedMicroBatch(
        packed=packed,
        features={**features, **videos},
        stats=batch.stats,
        image_index=image_index,
        video_index=batch.video_index,
    )


def _zero_losses(
    packed: PackedMicroBatch, slots: Sequence[SampleSlot], samples: Sequence[TrainingSample]
) -> PackedMicroBatch:
    """``packed`` with the loss masks :func:`materialize` zeroed (``samples`` for ``slots``) copied in."""
    loss_mask = None
    for slot, sample in zip(slots, samples, strict=True):
        if sample is not slot.sample:  # materialize zeroed this sample's loss mask
            loss_mask = loss_mask or list(packed.micro_batch.loss_mask)
            loss_mask[slot.start : slot.start + slot.length] = sample.loss_mask
    return packed if loss_mask is None else replace_loss_mask(packed, loss_mask)
