"""Run a Hugging Face Qwen-VL model on a packed micro-batch; per-token logprobs (docs/PACKING.md).

One packed micro-batch is one row (:class:`~trainer_lib.model_inputs.PackedInputs`); attention
stays inside each sample through the backend :mod:`trainer_lib.prepare` set up, and the
linear-attention layers of hybrid models (Qwen3.5) through the path
:mod:`trainer_lib.linear_attention` installed. The LM head is :mod:`trainer_lib.logprob_head`
(chunked, float32, recomputed in the backward: no ``[L, vocab]`` tensor kept); activation
checkpointing is transformers' own, switched on by :func:`~trainer_lib.prepare_model_for_packing`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer_lib.attention import VARLEN_ATTENTION
from trainer_lib.hf_surface import attn_implementation, image_features, takes_encoder_outputs, video_features
from trainer_lib.linear_attention import linear_attention_path
from trainer_lib.logprob_head import DEFAULT_CHUNK_SIZE, SUPPRESSED_LOGIT, token_logprobs
from trainer_lib.model_inputs import PackedInputs
from trainer_lib.packed_call import (
    CU_SEQLENS_KWARG,
    FSDP_FORWARD_METHOD,
    MAX_SEQLEN_KWARG,
    PackingUnsupported,
)
from trainer_lib.prepare import check_packable

__all__ = [
    "SUPPRESSED_LOGIT",
    "ForwardResult",
    "check_temperature",
    "packed_forward_tensors",
    "packed_logprobs",
]


@dataclass(frozen=True)
class ForwardResult:
    """What :func:`packed_logprobs` returns for one packed micro-batch of ``L`` tokens, on the
    model's device."""

    logprobs: torch.Tensor
    """float32 ``[L]``: ``logprobs[t] = log p(input_ids[t] | input_ids[start:t])`` within the
    token's own sample (temperature-scaled); 0 at each sample's first token. Same alignment as
    ``TrainingSample.inference_logprobs`` (vLLM's logprob of the sampled token ``t``)."""
    loss_mask: torch.Tensor
    """bool ``[L]``: :attr:`PackedInputs.loss_mask`."""
    entropy: torch.Tensor
    """float32 ``[L]``: the entropy (nats) of the distribution ``logprobs[t]`` was drawn from
    (temperature-scaled, suppressed ids out), differentiable like ``logprobs``; 0 at each
    sample's first token."""
    backend: str
    """The attention implementation that ran."""
    linear_attention: str | None
    """The linear-attention path that ran (``"per_segment_torch"`` / ``"fla_varlen"``), None for
    a model without linear-attention layers."""
    activation_checkpointing: bool
    """Whether the language layers and the vision tower ran under activation checkpointing
    (transformers' own: gradients enabled, the model in training mode and its gradient
    checkpointing on, as :func:`~trainer_lib.prepare_model_for_packing` leaves it by default)."""


def _repeated_features(enc: Any, index: torch.Tensor) -> Any:
    """A vision tower's output for the distinct images (or videos), re-indexed per slot.

    ``enc`` is transformers' own ``get_image_features`` / ``get_video_features`` output, fed to
    the model's own ``mm_encoder_outputs`` forward argument, whose embedding merge
    (``masked_scatter`` into the placeholder positions) is the model's (5.19: Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE): ``pooler_output`` is a tuple of per-item
    embeddings ``[tokens_i, hidden]``, and Qwen3-VL's ``deepstack_features`` a list (per layer) of
    such tuples; both are re-indexed by ``index`` (a tuple of views, no copy). Gradients of
    repeated items accumulate into the one vision forward (tested equal to the per-slot path in
    fp32: ``tests/test_dedup.py``).
    """
    rows = index.tolist()
    enc.pooler_output = tuple(enc.pooler_output[i] for i in rows)
    if getattr(enc, "deepstack_features", None) is not None:
        enc.deepstack_features = [tuple(layer[i] for i in rows) for layer in enc.deepstack_features]
    return enc


def _vision_kwargs(model: torch.nn.Module, inputs: PackedInputs) -> dict[str, Any]:
    """The vision arguments of ``model.model(...)``: ``pixel_values``/``image_grid_thw`` and
    ``pixel_values_videos``/``video_grid_thw`` (the model's own video path), or, with
    deduplicated features, ``mm_encoder_outputs`` holding each modality's tower output once per
    distinct item, re-indexed per slot (:func:`_repeated_features`; a model forward without
    ``mm_encoder_outputs`` gets one pixel copy per slot instead, :func:`_per_slot_pixels`)."""
    dtype = next(model.parameters()).dtype
    kwargs: dict[str, Any] = {}
    encoded: dict[str, Any] = {}
    dedup = inputs.image_index is not None or inputs.video_index is not None
    for name, pixels, grid, index, encode in (
        ("image", inputs.pixel_values, inputs.image_grid_thw, inputs.image_index, image_features),
        ("video", inputs.pixel_values_videos, inputs.video_grid_thw, inputs.video_index, video_features),
    ):
        if pixels is None:
            continue
        pixels = pixels.to(dtype)
        if dedup and takes_encoder_outputs(model):  # the forward refuses pixels beside encoder outputs
            enc = encode(model, pixels, grid)
            encoded[name] = enc if index is None else _repeated_features(enc, index)
            pixels, grid = None, grid if index is None else grid[index]
        elif index is not None:
            pixels, grid = _per_slot_pixels(model, pixels, grid, index)
        prefix = "pixel_values" if name == "image" else "pixel_values_videos"
        kwargs[prefix] = pixels
        kwargs[f"{name}_grid_thw"] = grid
    if encoded:
        kwargs["mm_encoder_outputs"] = encoded
    return kwargs


def _per_slot_pixels(
    model: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor, image_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, image_grid_thw)`` with one copy per image slot, gathered from the distinct
    images' rows (``t*h*w`` rows each): the input of a forward without ``mm_encoder_outputs``
    (transformers 5.17's Qwen3.5), which then runs its vision tower once per slot. Warns (once per
    call site) that the deduplicated encode is lost there; the images were still decoded once."""
    warnings.warn(
        f"{model.config.model_type}: this transformers version's forward takes no precomputed image "
        "embeddings (mm_encoder_outputs); the vision tower runs once per image slot",
        RuntimeWarning,
        stacklevel=3,
    )
    chunks = torch.split(pixels, grid.prod(-1).tolist())
    index = image_index.tolist()
    return torch.cat([chunks[i] for i in index]), grid[image_index]


def check_temperature(temperature: float) -> None:
    """Refuse a temperature the logits cannot be divided by: 0 gives -inf/NaN logprobs (NaN
    gradients), a negative one inverts the distribution into plausible-looking numbers.

    A greedy sample records ``sampling_temperature=0.0``; vLLM's logprobs for it are the unscaled
    ones (``vllm/v1/sample/sampler.py`` divides greedy rows by 1.0), so its caller passes 1.0, as
    :func:`~trainer_lib.check_sampling_temperature` compares it.

    Raises:
        ValueError: ``temperature`` is not finite and > 0.
    """
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be finite and > 0, got {temperature!r} (logits are divided by it); "
            "for a greedy sample (sampling_temperature 0.0, whose vLLM logprobs are unscaled) pass "
            "temperature=1.0"
        )


def packed_logprobs(
    model: torch.nn.Module,
    inputs: PackedInputs,
    *,
    temperature: float = 1.0,
    suppressed_token_ids: Sequence[int] = (),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> ForwardResult:
    """Forward one packed micro-batch; per-token logprobs and entropy of the packed tokens.

    Runs ``model.model(input_ids, position_ids [4,1,L], pixel_values, image_grid_thw,
    pixel_values_videos, video_grid_thw, attention_mask=None, use_cache=False)`` (or the vision
    towers' outputs once per distinct image or video as ``mm_encoder_outputs``) then the LM head
    of :mod:`trainer_lib.logprob_head` in ``chunk_size``-token chunks (float32; each chunk's
    logits recomputed in the backward, never kept). Gradients flow when enabled. The sample
    boundaries (``cu_seqlens``) go down as
    :data:`~trainer_lib.packed_call.CU_SEQLENS_KWARG` only where a layer reads them: the
    ``mmref_varlen`` backend and linear-attention layers. A model sharded by
    :func:`~trainer_lib.shard_model` runs through its FSDP2 forward method (parameters gathered,
    gradients reduce-scattered).

    Args:
        temperature: logits are divided by it. To compare with a vLLM server's logprobs, match
            its ``--logprobs-mode``: ``processed_logprobs`` (the sampling distribution, what an
            importance ratio needs; valid with top_p=1 and top_k off) are after temperature, so
            pass the sampling temperature; vLLM's default ``raw_logprobs`` are before it
            (vllm/v1/sample/sampler.py), so pass 1.0.
        suppressed_token_ids: token ids the sampler never drew (``rollout_client`` biases the
            image placeholder by ``logit_bias`` -100, ``client.suppressed_token_ids()``): their
            logits are set to :data:`SUPPRESSED_LOGIT` after the temperature division, before the
            log-softmax, so the logprobs are the server's processed ones (without it each token's
            logprob is off by ``-log(1 - p_suppressed)``, ~2e-3 on the tiny model).
        chunk_size: tokens per LM-head chunk: the transient float32 logits are
            ``chunk_size * 4 * vocab`` bytes; the result does not depend on it.

    Raises:
        ValueError: ``temperature`` not finite and > 0 (:func:`check_temperature`: a greedy
            sample's caller passes 1.0); a suppressed id outside the vocabulary; ``chunk_size`` < 1.
        PackingUnsupported: see :func:`check_packable`; a hybrid model whose linear-attention
            path is not installed (:func:`~trainer_lib.prepare_model_for_packing` not called).
    """
    check_temperature(temperature)
    linear = check_packable(model)
    if linear is not None and linear_attention_path(model) != linear:
        raise PackingUnsupported(
            f"{model.config.model_type}: its linear-attention layers would carry state across packed "
            f"samples; call trainer_lib.prepare_model_for_packing(model) first"
        )
    backend = attn_implementation(model.config)
    inputs = inputs.to(next(model.parameters()).device)
    suppressed = _suppressed_index(model, suppressed_token_ids, inputs.input_ids.device)
    run = getattr(model, FSDP_FORWARD_METHOD, None)  # shard_model's FSDP2-hooked method
    if run is None:
        logprobs, entropy = packed_forward_tensors(model, inputs, temperature, suppressed, chunk_size)
    else:
        logprobs, entropy = run(inputs, temperature, suppressed, chunk_size)
    return ForwardResult(
        logprobs=logprobs,
        loss_mask=inputs.loss_mask,
        entropy=entropy,
        backend=backend,
        linear_attention=linear,
        activation_checkpointing=torch.is_grad_enabled()
        and model.training
        and bool(getattr(model, "is_gradient_checkpointing", False)),
    )


def packed_forward_tensors(
    model: torch.nn.Module,
    inputs: PackedInputs,
    temperature: float,
    suppressed: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The body of :func:`packed_logprobs` on inputs already on the model's device: float32
    ``[L]`` logprobs and entropy, 0 at sample starts. Tensors in, tensors out, so that FSDP2 can
    run it as a forward method of the root module (:func:`~trainer_lib.shard_model`)."""
    linear = linear_attention_path(model)
    kwargs: dict[str, Any] = {}
    backend = attn_implementation(model.config)
    if backend == VARLEN_ATTENTION or linear is not None:
        kwargs[CU_SEQLENS_KWARG] = inputs.cu_seqlens
    if backend == VARLEN_ATTENTION:
        kwargs[MAX_SEQLEN_KWARG] = inputs.max_seqlen
    kwargs.update(_vision_kwargs(model, inputs))
    out = model.model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=None,
        use_cache=False,  # with a cache object transformers' sdpa/eager mask spans the whole pack
        **kwargs,
    )
    hidden = out.last_hidden_state[0, :-1]  # position t predicts token t+1
    logprobs, entropy = token_logprobs(
        hidden,
        model.get_output_embeddings(),
        inputs.input_ids[0, 1:],
        temperature=temperature,
        suppressed=suppressed,
        chunk_size=chunk_size,
    )
    starts = inputs.cu_seqlens[:-1].long()
    zero = torch.zeros(1, device=hidden.device)
    return (
        torch.cat([zero, logprobs]).index_fill(0, starts, 0.0),
        torch.cat([zero, entropy]).index_fill(0, starts, 0.0),
    )


def _suppressed_index(
    model: torch.nn.Module, ids: Sequence[int], device: torch.device
) -> torch.Tensor | None:
    """int64 ``[k]`` of the distinct suppressed ids on ``device``; None when there are none.

    Raises:
        ValueError: an id outside ``[0, vocab)`` (``vocab``: the LM head's output rows)."""
    distinct = sorted({int(t) for t in ids})
    if not distinct:
        return None
    vocab = model.get_output_embeddings().weight.shape[0]
    if distinct[0] < 0 or distinct[-1] >= vocab:
        raise ValueError(f"suppressed_token_ids {distinct} must lie in [0, {vocab}) (the LM head's rows)")
    return torch.tensor(distinct, dtype=torch.long, device=device)
