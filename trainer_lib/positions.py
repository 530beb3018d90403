"""Position ids and ``cu_seqlens`` for packed micro-batches (docs/PACKING.md §2).

**Qwen-VL (MRoPE)**: ``position_ids`` is ``[4, 1, L]`` int64. transformers 5.19 reads a 4-row
tensor as ``text_position_ids = position_ids[0]`` and MRoPE ``position_ids[1:]``
(``Qwen2VLTextModel.forward``, same in Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and Qwen3.5): row 0
only builds the attention mask — ``masking_utils.find_packed_sequence_indices`` starts a new
sequence wherever row 0 does not step by +1, so it must **restart at 0 per sample** — and rows
1-3 (temporal, height, width) rotate the queries and keys. Rows 1-3 of each sample come from
transformers' own ``get_rope_index`` (a method of ``Qwen2VLModel`` / ``Qwen2_5_VLModel`` /
``Qwen3VLModel`` / ``Qwen3VLMoeModel`` / ``Qwen3_5Model`` / ``Qwen3_5MoeModel``, i.e.
``model.model.get_rope_index``), called once per sample with that sample's
``mm_token_type_ids`` and image grids — never re-derived here. Each sample's positions start at
0, which is what vLLM's ``get_mrope_input_positions`` gives the same prompt at rollout.

``get_rope_index`` groups consecutive tokens of one type, so two images with no text between
them would merge into one group and consume one grid. For such runs the image types alternate
1/2 and the odd images' grids go in as ``video_grid_thw``: for ``t == 1`` (every still image)
the video path gives exactly the image positions (temporal index 0, spacing irrelevant), and
the result equals vLLM's, which starts the next image at ``max + 1`` of the previous one.

**Videos** (issue 44; docs/PACKING.md §11): their tokens are typed 2, their grids go in as
``video_grid_thw`` in prompt order (beside the adjacent images above) and, where
``get_rope_index`` takes it (Qwen2.5-VL), each video's ``second_per_grid_ts`` from its features:
the time axis steps by ``tokens_per_second * second_per_grid_ts`` per temporal patch. Qwen3-VL's
timestamps are prompt text between a video's per-patch runs (``ImageSpan.runs``), and its
``get_rope_index`` splits the video grid per frame itself.

Which families are MRoPE is the adapter registry's fact (``ImageAdapter.rope``); the 1D-RoPE
families (Kimi) are not packed (:func:`trainer_lib.check_packable`).

``cu_seqlens``: int32 ``[num_samples + 1]`` cumulative sample boundaries, the varlen-kernel
layout (``cu_seqlens[i]`` = offset of sample ``i``; last entry = ``L``).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from protocol.adapters import ADAPTERS
from trainer_lib.hf_surface import model_class
from trainer_lib.micro_batch import ImageSpan, PackedMicroBatch

__all__ = [
    "RopeIndexFn",
    "build_position_ids",
    "cu_seqlens",
    "mrope_model_types",
    "mrope_position_ids",
    "rope_index_fn",
]

RopeIndexFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def mrope_model_types() -> tuple[str, ...]:
    """HF model types whose adapter says ``rope == "mrope"`` (transformers' ``get_rope_index``).

    A family that does not say is not packed (and a test in ``tests/test_forward.py`` fails)."""
    return tuple(t for t, cls in ADAPTERS.items() if getattr(cls, "rope", None) == "mrope")


def cu_seqlens(seq_lens: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """int32 ``[len(seq_lens) + 1]``: ``[0, l0, l0+l1, ...]`` (FlashAttention's ``cu_seqlens``)."""
    out = torch.zeros(len(seq_lens) + 1, dtype=torch.int32, device=device)
    if seq_lens:
        out[1:] = torch.cumsum(torch.as_tensor(seq_lens, dtype=torch.int32, device=device), 0)
    return out


def rope_index_fn(model_or_config: Any) -> RopeIndexFn:
    """transformers' ``get_rope_index`` for a Qwen-VL model, bound and ready to call.

    Args:
        model_or_config: the HF model (``Qwen2VLForConditionalGeneration`` or its inner
            ``Qwen2VLModel``, same for 2.5-VL / 3-VL), or only its config: then the function of
            the model class transformers maps the config to is bound to that config (no weights
            are built). ``get_rope_index`` reads nothing but ``self.config`` and
            ``self.get_vision_position_ids``.

    Raises:
        ValueError: the model type is not an MRoPE type (:func:`mrope_model_types`).
    """
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in mrope_model_types():
        raise ValueError(
            f"no position convention for model_type {model_type!r} in a packed micro-batch (no MRoPE "
            f"get_rope_index); MRoPE types: {list(mrope_model_types())}"
        )
    for owner in (model_or_config, getattr(model_or_config, "model", None)):
        fn = getattr(owner, "get_rope_index", None)
        if fn is not None and hasattr(owner, "get_vision_position_ids"):
            return fn
    cls = model_class(config)
    shim = types.SimpleNamespace(config=config)
    shim.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, shim)
    return types.MethodType(cls.get_rope_index, shim)


def mrope_position_ids(
    packed: PackedMicroBatch,
    rope_index: RopeIndexFn,
    device: torch.device | str | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ``[4, 1, L]`` for one packed micro-batch (see the module docstring).

    Row 0: ``arange(len)`` per sample. Rows 1-3: ``rope_index(ids[1, n], mm_token_type_ids[1, n],
    image_grid_thw=..., video_grid_thw=..., second_per_grid_ts=...)`` per sample
    (``get_rope_index`` from :func:`rope_index_fn`; video tokens typed 2, transformers' convention).

    Args:
        second_per_grid_ts: float32 ``[num videos]``, one per video of the micro-batch in pack
            order (the features' ``second_per_grid_ts`` per video slot, Qwen2.5-VL): the seconds one
            temporal grid step spans, MRoPE's time axis. Required when the micro-batch has videos
            and ``rope_index`` takes it; ignored otherwise (Qwen3-VL: timestamps are prompt tokens).

    Raises:
        ValueError: two adjacent images with a temporal grid other than 1, two adjacent media that
            ``get_rope_index`` would merge into one group (two videos with no text between), or
            videos without ``second_per_grid_ts`` where ``rope_index`` takes it.
    """
    n_videos = sum(im.is_video for im in packed.images)
    takes_seconds = "second_per_grid_ts" in inspect.signature(rope_index).parameters
    if n_videos and takes_seconds and second_per_grid_ts is None:
        raise ValueError(
            f"{n_videos} video(s) in the micro-batch but no second_per_grid_ts: this get_rope_index "
            "spaces a video's time axis by it (pass the features' second_per_grid_ts per video slot)"
        )
    if takes_seconds and n_videos and second_per_grid_ts.numel() != n_videos:
        raise ValueError(f"{second_per_grid_ts.numel()} second_per_grid_ts for {n_videos} video(s)")
    seconds = iter(second_per_grid_ts.reshape(-1) if takes_seconds and n_videos else ())
    ids = torch.as_tensor(packed.micro_batch.input_ids, dtype=torch.long)
    type_ids = torch.as_tensor(packed.mm_token_type_ids, dtype=torch.int32)
    rows = []
    for slot in packed.slots:
        lo, hi = slot.start, slot.start + slot.length
        spans = packed.images[slot.first_image : slot.first_image + slot.num_images]
        seg_types, kwargs = _segment_inputs(type_ids[lo:hi], spans, lo, seconds)
        pos, _ = rope_index(ids[lo:hi].unsqueeze(0), seg_types.unsqueeze(0), **kwargs)
        rows.append(
            torch.cat([torch.arange(slot.length, dtype=torch.long).view(1, 1, -1), pos.long()], dim=0)
        )
    return torch.cat(rows, dim=2).to(device)


def _segment_inputs(
    types: torch.Tensor, spans: Sequence[ImageSpan], lo: int, seconds: Iterator[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One sample's ``mm_token_type_ids`` and grid arguments for ``get_rope_index``: videos typed
    2 (their ``second_per_grid_ts`` drawn from ``seconds``, passed only where it holds any), images
    1, an image right after an image 2 (its grid then goes in as a video's, ``t == 1``, spacing
    1.0); errors: see
    :func:`mrope_position_ids`."""
    seg_types = types.clone()
    grids: dict[int, list[tuple[int, ...]]] = {1: [], 2: []}
    video_seconds: list[torch.Tensor] = []
    prev_end, prev_kind, prev_grid, prev_video = None, 0, None, False
    for im in spans:
        adjacent = im.start - lo == prev_end
        kind = 2 if im.is_video or (adjacent and prev_kind == 1) else 1
        if adjacent and not (im.is_video or prev_video) and (im.grid[0] != 1 or prev_grid[0] != 1):
            raise ValueError(f"adjacent images need temporal grid 1, got {prev_grid} then {im.grid}")
        if adjacent and kind == prev_kind:
            raise ValueError(
                f"adjacent media {prev_grid} and {im.grid} with no text between would be one group "
                "for get_rope_index"
            )
        for start, length in im.token_runs:
            seg_types[start - lo : start - lo + length] = kind
        grids[kind].append(im.grid)
        if kind == 2:
            video_seconds.append(next(seconds, None) if im.is_video else None)
        end = sum(im.token_runs[-1]) - lo  # start + length of its last run, in the sample
        prev_end, prev_kind, prev_grid, prev_video = end, kind, im.grid, im.is_video
    kwargs: dict[str, torch.Tensor | None] = {
        "image_grid_thw": torch.tensor(grids[1], dtype=torch.long) if grids[1] else None,
        "video_grid_thw": torch.tensor(grids[2], dtype=torch.long) if grids[2] else None,
    }
    if any(s is not None for s in video_seconds):  # an image passed as a video: t == 1, any spacing
        kwargs["second_per_grid_ts"] = torch.stack(
            [torch.as_tensor(1.0 if s is None else s, dtype=torch.float32) for s in video_seconds]
        )
    return seg_types, kwargs


def build_position_ids(
    packed: PackedMicroBatch,
    model_or_config: Any,
    device: torch.device | str | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 ``[4, 1, L]``: the position ids a packed MRoPE model takes (:func:`mrope_position_ids`
    with :func:`rope_index_fn`; ``second_per_grid_ts``: its videos', pack order).

    Raises:
        ValueError: a model type that is not MRoPE (packing refuses the others).
    """
    return mrope_position_ids(packed, rope_index_fn(model_or_config), device, second_per_grid_ts)
