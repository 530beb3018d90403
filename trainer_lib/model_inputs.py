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
        )


def packed_inputs(
    packed: PackedMicroBatch,
    features: Mapping[str, torch.Tensor],
    model_or_config: Any,
    spec: PackingSpec,
    image_index: torch.Tensor | None = None,
) -> PackedInputs:
    """Build the model inputs and run the placeholder tripwire.

    Args:
        packed: the micro-batch (``MaterializedMicroBatch.packed`` if it has images: the loss mask
            with replaced images zeroed).
        features: its features in pack order, as :func:`~trainer_lib.materialize_micro_batch`
            returns them (Qwen-VL: ``pixel_values`` float32 ``[sum(t*h*w), C*T*P*P]``,
            ``image_grid_thw`` int64 ``[N, 3]``); ``{}`` without images.
        model_or_config: the HF model or its config (for ``get_rope_index``).
        spec: the family's facts: the placeholder id, and the adapter's placeholder count per
            grid (the feature rows the model scatters).
        image_index: int64 ``[num images]`` with deduplicated features (``dedup=True``): the row of
            ``image_grid_thw`` each image of the micro-batch shows.

    Returns:
        :class:`PackedInputs` on CPU.

    Raises:
        ValueError: placeholder tokens != feature rows (:func:`check_placeholders_match_features`),
            features whose grids differ from the micro-batch's images, images without features,
            or images and a spec without an adapter.
    """
    ids = torch.as_tensor(packed.micro_batch.input_ids, dtype=torch.long).unsqueeze(0)
    pixel_values = grid = None
    if packed.images or features:
        _check_features(packed, features, ids, spec, image_index)
        pixel_values, grid = features["pixel_values"], features["image_grid_thw"]
    starts = torch.zeros(packed.num_tokens, dtype=torch.bool)
    starts[[s.start for s in packed.slots]] = True
    return PackedInputs(
        input_ids=ids,
        position_ids=build_position_ids(packed, model_or_config),
        cu_seqlens=cu_seqlens(packed.seq_lens),
        max_seqlen=max(packed.seq_lens),
        loss_mask=torch.as_tensor(packed.micro_batch.loss_mask, dtype=torch.bool) & ~starts,
        pixel_values=pixel_values,
        image_grid_thw=grid,
        image_index=image_index if pixel_values is not None else None,
    )


def _check_features(
    packed: PackedMicroBatch,
    features: Mapping[str, torch.Tensor],
    ids: torch.Tensor,
    spec: PackingSpec,
    image_index: torch.Tensor | None,
) -> None:
    """The features are the micro-batch's images (same grids, in pack order) and their rows match
    the placeholder tokens (:func:`check_placeholders_match_features`); errors: see :func:`packed_inputs`."""
    if not features:
        raise ValueError(f"{len(packed.images)} images in the micro-batch but no features")
    grid = features["image_grid_thw"]
    per_image = grid if image_index is None else grid[image_index]
    if per_image.tolist() != [list(g) for g in packed.image_grids]:
        hint = " (deduplicated features: pass image_index=m.image_index)" if image_index is None else ""
        raise ValueError(
            f"feature grids {per_image.tolist()} differ from the micro-batch's images "
            f"{packed.image_grids}{hint}"
        )
    if spec.num_placeholders is None:
        raise ValueError("counting an image's feature rows needs the spec's adapter")
    check_placeholders_match_features(
        ids,
        spec.placeholder_token_id,
        {"image_grid_thw": per_image},
        mm_token_type_ids=torch.as_tensor(packed.mm_token_type_ids).unsqueeze(0),
        num_placeholders=spec.num_placeholders,
    )


def check_placeholders_match_features(
    input_ids: Any,
    placeholder_token_id: int,
    features: Any,
    *,
    mm_token_type_ids: Any = None,
    num_placeholders: Callable[[Sequence[int]], int] | None = None,
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
        mm_token_type_ids: optional ``[L]``/``[1, L]``; when given, its image positions must be
            exactly the placeholder-token positions.
        num_placeholders: ``adapter.num_placeholders`` (placeholder tokens of one image of a
            grid), required with a grid mapping.

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
