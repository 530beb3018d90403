"""Run a Hugging Face Qwen-VL model on a packed micro-batch; per-token logprobs (docs/PACKING.md).

One packed micro-batch is one row (:class:`~trainer_lib.model_inputs.PackedInputs`); attention
stays inside each sample through the backend :mod:`trainer_lib.prepare` set up, and the
linear-attention layers of hybrid models (Qwen3.5) through the path
:mod:`trainer_lib.linear_attention` installed. The LM head runs in chunks (float32 log-softmax;
no ``[L, vocab]`` tensor at once).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from trainer_lib.attention import VARLEN_ATTENTION
from trainer_lib.hf_surface import attn_implementation, image_features, takes_encoder_outputs
from trainer_lib.linear_attention import linear_attention_path
from trainer_lib.model_inputs import PackedInputs
from trainer_lib.packed_call import CU_SEQLENS_KWARG, MAX_SEQLEN_KWARG, PackingUnsupported
from trainer_lib.prepare import check_packable

__all__ = ["SUPPRESSED_LOGIT", "ForwardResult", "check_temperature", "packed_logprobs"]

SUPPRESSED_LOGIT = -1.0e4
"""The logit a suppressed token gets (after the temperature division): ``exp`` of it relative to
any real logit is 0 in float32, like the server's ``logit_bias`` of -100 (``e^-100``), and unlike
``-inf`` it keeps the logprob of a prompt position whose token is suppressed (the image
placeholder) finite: no NaN where a loss mask multiplies it by 0."""


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
    backend: str
    """The attention implementation that ran."""
    linear_attention: str | None
    """The linear-attention path that ran (``"per_segment_torch"`` / ``"fla_varlen"``), None for
    a model without linear-attention layers."""
    entropy: torch.Tensor | None = None
    """float32 ``[L]`` with ``compute_entropy``: ``entropy[t]`` = the entropy (nats) of the
    distribution ``logprobs[t]`` was drawn from (temperature-scaled, suppressed ids out); 0 at each
    sample's first token. None without ``compute_entropy``."""


def _repeated_image_features(model: torch.nn.Module, pixels: torch.Tensor, inputs: PackedInputs) -> Any:
    """Vision tower once per distinct image, embeddings indexed per image of the micro-batch.

    Uses transformers' own ``get_image_features`` and the model's own ``mm_encoder_outputs``
    forward argument, whose embedding merge (``masked_scatter`` into the placeholder positions) is
    the model's (5.19: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE):
    ``pooler_output`` is a tuple of per-image embeddings ``[tokens_i, hidden]``, and Qwen3-VL's
    ``deepstack_features`` a list (per layer) of such tuples; both are re-indexed by
    ``inputs.image_index`` (a tuple of views, no copy). Gradients of repeated images accumulate
    into the one vision forward (tested equal to the per-slot path in fp32: ``tests/test_dedup.py``).
    """
    enc = image_features(model, pixels, inputs.image_grid_thw)
    index = inputs.image_index.tolist()
    enc.pooler_output = tuple(enc.pooler_output[i] for i in index)
    if getattr(enc, "deepstack_features", None) is not None:
        enc.deepstack_features = [tuple(layer[i] for i in index) for layer in enc.deepstack_features]
    return enc


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
    chunk_size: int = 4096,
    checkpoint_lm_head: bool | None = None,
    compute_entropy: bool = False,
) -> ForwardResult:
    """Forward one packed micro-batch; per-token logprobs of the packed tokens.

    Runs ``model.model(input_ids, position_ids [4,1,L], pixel_values, image_grid_thw,
    attention_mask=None, use_cache=False)`` then the LM head in ``chunk_size``-token chunks
    (float32 log-softmax; no ``[L, vocab]`` tensor at once). Gradients flow when enabled. The
    sample boundaries (``cu_seqlens``) go down as :data:`~trainer_lib.packed_call.CU_SEQLENS_KWARG`
    only where a layer reads them: the ``mmref_varlen`` backend and linear-attention layers.

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
        checkpoint_lm_head: recompute each chunk's logits in the backward instead of keeping them
            (``torch.utils.checkpoint``): autograd otherwise keeps every chunk's float32 logits,
            ``4 * vocab`` bytes per token (10 GB for a 16k micro-batch at Qwen's 151,936-token
            vocabulary), for one more LM-head matmul per chunk in the backward. Default: on where
            the model has gradient checkpointing on (``model.is_gradient_checkpointing``) and
            gradients are enabled. Logprobs and gradients are the same either way.
        compute_entropy: also return each position's entropy (:attr:`ForwardResult.entropy`),
            from the same chunk's logits (what RL frameworks log and use for entropy bonuses).

    Raises:
        ValueError: ``temperature`` not finite and > 0 (:func:`check_temperature`: a greedy
            sample's caller passes 1.0); a suppressed id outside the vocabulary.
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
    kwargs: dict[str, Any] = {}
    if backend == VARLEN_ATTENTION or linear is not None:
        kwargs[CU_SEQLENS_KWARG] = inputs.cu_seqlens
    if backend == VARLEN_ATTENTION:
        kwargs[MAX_SEQLEN_KWARG] = inputs.max_seqlen
    suppressed = _suppressed_index(model, suppressed_token_ids, inputs.input_ids.device)
    dtype = next(model.parameters()).dtype
    pixels = None if inputs.pixel_values is None else inputs.pixel_values.to(dtype)
    grid = inputs.image_grid_thw
    if pixels is not None and inputs.image_index is not None:
        if takes_encoder_outputs(model):
            kwargs["mm_encoder_outputs"] = {"image": _repeated_image_features(model, pixels, inputs)}
            pixels, grid = None, grid[inputs.image_index]
        else:
            pixels, grid = _per_slot_pixels(model, pixels, grid, inputs.image_index)
    out = model.model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=None,
        use_cache=False,  # with a cache object transformers' sdpa/eager mask spans the whole pack
        pixel_values=pixels,
        image_grid_thw=grid,
        **kwargs,
    )
    hidden = out.last_hidden_state[0, :-1]  # position t predicts token t+1
    if checkpoint_lm_head is None:
        checkpoint_lm_head = bool(getattr(model, "is_gradient_checkpointing", False))
    recompute = checkpoint_lm_head and torch.is_grad_enabled()
    head = _Head(model.get_output_embeddings(), temperature, suppressed, compute_entropy)
    logprobs, entropy = _token_logprobs(head, hidden, inputs, chunk_size, recompute)
    return ForwardResult(
        logprobs=logprobs,
        loss_mask=inputs.loss_mask,
        backend=backend,
        linear_attention=linear,
        entropy=entropy,
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


@dataclass(frozen=True)
class _Head:
    """The LM head and what turns its logits into the sampling distribution."""

    module: torch.nn.Module
    temperature: float
    suppressed: torch.Tensor | None
    entropy: bool

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """float32 ``[n]``: ``log_softmax(head(hidden) / temperature)`` at ``targets``, the
        suppressed ids' logits at :data:`SUPPRESSED_LOGIT` after the temperature; with
        ``entropy``, also the distribution's entropy ``[n]``."""
        logits = self.module(hidden).float() / self.temperature
        if self.suppressed is not None:
            logits = logits.index_fill(-1, self.suppressed, SUPPRESSED_LOGIT)
        logz = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, targets[:, None]).squeeze(-1) - logz
        if not self.entropy:
            return (picked,)
        logp = logits - logz[:, None]
        return picked, -(logp.exp() * logp).sum(-1)


def _token_logprobs(
    head: _Head, hidden: torch.Tensor, inputs: PackedInputs, chunk_size: int, recompute: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 ``[L]`` logprobs (and entropies with ``head.entropy``) from ``hidden [L - 1, H]``
    (positions ``0..L-2``, predicting tokens ``1..L-1``): the LM head in ``chunk_size``-token
    chunks, no ``[L, vocab]`` tensor at once, each chunk's logits recomputed in the backward with
    ``recompute``; 0 at sample starts."""
    targets = inputs.input_ids[0, 1:]
    pieces = []
    for lo in range(0, hidden.shape[0], chunk_size):
        args = (hidden[lo : lo + chunk_size], targets[lo : lo + chunk_size])
        if recompute:
            pieces.append(torch.utils.checkpoint.checkpoint(head, *args, use_reentrant=False))
        else:
            pieces.append(head(*args))
    starts = inputs.cu_seqlens[:-1].long()
    zero = torch.zeros(1, device=hidden.device)
    columns = list(zip(*pieces, strict=True)) or [()] * (2 if head.entropy else 1)
    out = [torch.cat([zero, *parts]).index_fill(0, starts, 0.0) for parts in columns]
    return out[0], (out[1] if head.entropy else None)
