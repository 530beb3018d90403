"""Model-ready tensors of one packed micro-batch, and the placeholder tripwire before ``masked_scatter``.

:func:`packed_inputs` turns a :class:`~trainer_lib.micro_batch.PackedMicroBatch` and its features
into :class:`PackedInputs` (``input_ids [1, L]``, ``position_ids [4, 1, L]``, ``cu_seqlens``, the
loss mask, pixels), after :func:`check_placeholders_match_features`: placeholder tokens must equal the
feature rows the model will scatter into them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer_lib.micro_batch import PackedMicroBatch
from trainer_lib.positions import build_position_ids, cu_seqlens
from trainer_lib.spec import PackingSpec

__all__ = ["PackedInputs", "check_placeholders_match_features", "packed_inputs"]


@dataclass(frozen=True)
class PackedInputs:
    """Model-ready tensors of one packed micro-batch of ``L`` tokens (one row, no padding).

    Built by :func:`packed_inputs` on CPU; :meth:`to` moves them. What
    :func:`~trainer_lib.packed_logprobs` passes to ``model.model(...)``.
    """

    input_ids: torch.Tensor
    """int64 ``[1, L]``: every sample's tokens, concatenated in pack order."""
    position_ids: torch.Tensor
    """int64 ``[4, 1, L]``: row 0 text positions restarting at 0 per sample (transformers finds the
    sample boundaries from it), rows 1-3 MRoPE (temporal, height, width) from ``get_rope_index``."""
    cu_seqlens: torch.Tensor
    """int32 ``[num_samples + 1]``: ``[0, l0, l0 + l1, ..., L]``, the varlen kernels' boundaries."""
    max_seqlen: int
    """Tokens of the longest sample (the varlen kernels' ``max_seqlen``)."""
    loss_mask: torch.Tensor
    """bool ``[L]``: the micro-batch's loss mask without each sample's first token (no prefix)."""
    pixel_values: torch.Tensor | None = None
    """float32 ``[sum(t*h*w), C * temporal_patch * patch**2]`` (Qwen-VL), every image in pack
    order (or each distinct image once, with :attr:`image_index`); None without images."""
    image_grid_thw: torch.Tensor | None = None
    """int64 ``[num images, 3]``: each image's ``[t, h, w]`` in patches (rows of the distinct
    images with :attr:`image_index`); None without images."""
    image_index: torch.Tensor | None = None
    """int64 ``[num images]`` when ``pixel_values``/``image_grid_thw`` hold distinct images only:
    the row of ``image_grid_thw`` each image of the micro-batch shows."""
    pixel_values_videos: torch.Tensor | None = None
    """float32 ``[sum(t*h*w), C * temporal_patch * patch**2]``: every video in pack order (or each
    distinct video once, with :attr:`video_index`); None without videos (issue 44)."""
    video_grid_thw: torch.Tensor | None = None
    """int64 ``[num videos, 3]`` (rows of the distinct videos with :attr:`video_index`)."""
    video_index: torch.Tensor | None = None
    """int64 ``[num videos]`` with deduplicated video features: the row each video shows."""

    def to(self, device: torch.device | str) -> PackedInputs:
        """The same inputs on ``device`` (``non_blocking`` copies)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return PackedInputs(
            input_ids=move(self.input_ids),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            loss_mask=move(self.loss_mask),
            pixel_values=move(self.pixel_values),
            image_grid_thw=move(self.image_grid_thw),
            image_index=move(self.image_index),
            pixel_values_videos=move(self.pixel_values_videos),
            video_grid_thw=move(self.video_grid_thw),
            video_index=move(self.video_index),
        )


def packed_inputs(
    packed: PackedMicroBatch,
    features: Mapping[str, torch.Tensor],
    model_or_config: Any,
    spec: PackingSpec,
    image_index: torch.Tensor | None = None,
    video_index: torch.Tensor | None = None,
) -> PackedInputs:
    """Build the model inputs and run the placeholder tripwire.

    Args:
        packed: the micro-batch (``MaterializedMicroBatch.packed`` if it has images: the loss mask
            with replaced images zeroed).
        features: its features in pack order, as :func:`~trainer_lib.materialize_micro_batch`
            returns them (Qwen-VL: ``pixel_values`` float32 ``[sum(t*h*w), C*T*P*P]``,
            ``image_grid_thw`` int64 ``[N, 3]``; videos: ``pixel_values_videos``,
            ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts`` float32 ``[N_videos]``);
            ``{}`` without images or videos.
        model_or_config: the HF model or its config (for ``get_rope_index``).
        spec: the family's facts: the placeholder ids, and the adapter's placeholder count per
            grid (the feature rows the model scatters).
        image_index: int64 ``[num images]`` with deduplicated features (``dedup=True``): the row of
            ``image_grid_thw`` each image of the micro-batch shows.
        video_index: the same for videos (``MaterializedMicroBatch.video_index``).

    Returns:
        :class:`PackedInputs` on CPU.

    Raises:
        ValueError: placeholder tokens != feature rows (:func:`check_placeholders_match_features`),
            features whose grids differ from the micro-batch's images or videos, images or videos
            without features, or a spec without an adapter.
    """
    ids = torch.as_tensor(packed.micro_batch.input_ids, dtype=torch.long).unsqueeze(0)
    types = torch.as_tensor(packed.mm_token_type_ids).unsqueeze(0)
    image = _checked_modality(packed, features, (ids, types), spec, image_index)
    video = _checked_modality(packed, features, (ids, types), spec, video_index, video=True)
    seconds = None
    if video is not None and "second_per_grid_ts" in features:
        seconds = (
            features["second_per_grid_ts"]
            if video_index is None
            else features["second_per_grid_ts"][video_index]
        )
    starts = torch.zeros(packed.num_tokens, dtype=torch.bool)
    starts[[s.start for s in packed.slots]] = True
    return PackedInputs(
        input_ids=ids,
        position_ids=build_position_ids(packed, model_or_config, second_per_grid_ts=seconds),
        cu_seqlens=cu_seqlens(packed.seq_lens),
        max_seqlen=max(packed.seq_lens),
        loss_mask=torch.as_tensor(packed.micro_batch.loss_mask, dtype=torch.bool) & ~starts,
        pixel_values=None if image is None else features["pixel_values"],
        image_grid_thw=image,
        image_index=image_index if image is not None else None,
        pixel_values_videos=None if video is None else features["pixel_values_videos"],
        video_grid_thw=video,
        video_index=video_index if video is not None else None,
    )


def _checked_modality(
    packed: PackedMicroBatch,
    features: Mapping[str, torch.Tensor],
    ids_and_types: tuple[torch.Tensor, torch.Tensor],
    spec: PackingSpec,
    index: torch.Tensor | None,
    video: bool = False,
) -> torch.Tensor | None:
    """The features' grid tensor of one modality (None: the micro-batch has none of it and the
    features hold none), after checking its grids are the micro-batch's (pack order) and its rows
    match the placeholder tokens (:func:`check_placeholders_match_features`); errors: see
    :func:`packed_inputs`."""
    name, key = ("videos", "video_grid_thw") if video else ("images", "image_grid_thw")
    want = packed.video_grids if video else packed.image_grids
    if not want and key not in features:
        return None
    if key not in features:
        raise ValueError(f"{len(want)} {name} in the micro-batch but no features")
    grid = features[key]
    per_item = grid if index is None else grid[index]
    if per_item.tolist() != [list(g) for g in want]:
        arg = "video_index=m.video_index" if video else "image_index=m.image_index"
        hint = f" (deduplicated features: pass {arg})" if index is None else ""
        raise ValueError(
            f"feature grids {per_item.tolist()} differ from the micro-batch's {name} {want}{hint}"
        )
    if spec.adapter is None or (video and spec.video_token_id is None):
        raise ValueError(
            f"counting the feature rows of {name} needs the spec's adapter (with a video processor)"
        )
    ids, types = ids_and_types
    check_placeholders_match_features(
        ids,
        spec.video_token_id if video else spec.placeholder_token_id,
        {"image_grid_thw": per_item},
        mm_token_type_ids=types,
        num_placeholders=spec.adapter.video_num_placeholders if video else spec.num_placeholders,  # type: ignore[attr-defined]
        kind=2 if video else 1,
    )
    return grid


def check_placeholders_match_features(
    input_ids: Any,
    placeholder_token_id: int,
    features: Any,
    *,
    mm_token_type_ids: Any = None,
    num_placeholders: Callable[[Sequence[int]], int] | None = None,
    kind: int = 1,
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
            ``image_grid_thw`` ``[num_images, 3]`` entry (``N = sum(num_placeholders(grid))``).
        mm_token_type_ids: optional ``[L]``/``[1, L]``; when given, its positions of ``kind``
            must be exactly the placeholder-token positions.
        num_placeholders: ``adapter.num_placeholders`` (placeholder tokens of one image of a
            grid), required with a grid mapping.
        kind: the modality checked, transformers' ``mm_token_type_ids`` value: 1 image (with
            ``<|image_pad|>``), 2 video (with ``<|video_pad|>``; the mapping's grids are then
            ``video_grid_thw`` rows under the ``image_grid_thw`` key and ``num_placeholders`` is
            ``adapter.video_num_placeholders``).

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
        if grid is None or num_placeholders is None:
            raise ValueError("a feature mapping needs an 'image_grid_thw' entry and num_placeholders")
        n_features = sum(num_placeholders([int(g) for g in row]) for row in grid.tolist())
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in features.items() if hasattr(v, "shape"))
    elif isinstance(features, int):
        n_features, shapes = features, f"{features} rows"
    else:
        n_features, shapes = int(features.shape[0]), f"features {tuple(features.shape)}"
    modality = "video" if kind == 2 else "image"
    if n_tokens != n_features:
        raise ValueError(
            f"{modality} placeholder token id {placeholder_token_id}: {n_tokens} tokens in input_ids "
            f"{tuple(ids.shape)} but {n_features} feature rows ({shapes})"
        )
    if mm_token_type_ids is not None:
        types = _as_array(mm_token_type_ids)
        typed = types == kind
        is_tok = ids == placeholder_token_id
        if typed.shape != is_tok.shape or bool((typed != is_tok).any()):
            raise ValueError(
                f"{modality} placeholder token id {placeholder_token_id}: {int(is_tok.sum())} tokens in "
                f"input_ids {tuple(ids.shape)} but {int(typed.sum())} {modality}-typed positions in "
                f"mm_token_type_ids {tuple(types.shape)} (not the same positions); features: {shapes}"
            )
    return n_tokens


def _as_array(x: Any) -> Any:
    """Tensors and arrays pass through (comparisons and sums work on both); lists become arrays."""
    return x if hasattr(x, "shape") else np.asarray(x)
