"""Run a Hugging Face Qwen-VL model on a packed micro-batch; per-token logprobs (docs/PACKING.md).

One packed micro-batch is one row: ``input_ids [1, L]``, ``position_ids [4, 1, L]`` (row 0
restarts at 0 per sample, rows 1-3 from transformers' ``get_rope_index``; see
:mod:`trainer_lib.positions`), ``pixel_values`` / ``image_grid_thw`` of every image in pack
order, ``attention_mask=None``. Attention must stay inside each sample. Backends:

- ``"sdpa"`` / ``"eager"`` (CPU): transformers builds the block-diagonal causal mask from row 0
  (``masking_utils.find_packed_sequence_indices``) — **only** with ``attention_mask=None`` and
  ``use_cache=False``: with a cache object present it silently builds a plain causal mask across
  the whole pack (NOTES-vllm-cpu.md: error ~0.5).
- ``"mmref_varlen"`` (CUDA): PyTorch's ``torch.nn.attention.varlen.varlen_attn``
  (FlashAttention varlen, fp16/bf16), registered with ``transformers.AttentionInterface`` and
  ``transformers.masking_utils.AttentionMaskInterface`` (``flash_attention_mask``: no dense mask).
  ``cu_seqlens`` is computed once per micro-batch and passed down as a kwarg (no per-layer sync).
  The vision tower calls it once per image chunk, non-causal, which goes to transformers' sdpa
  (a single image, nothing packed).
- ``"flash_attention_2"`` (CUDA, when the ``flash_attn`` package is installed): transformers'
  own varlen path, which derives ``cu_seqlens`` from the text position ids.

sdpa is refused for packed CUDA batches (dense masks: out of memory at RL lengths, and slower
than varlen; NOTES "GPU facts"). Models whose packed boundaries cannot be respected here
(linear-attention layers, e.g. Qwen3.5 / Qwen3-Next, which need flash-linear-attention's
varlen kernels) raise :class:`PackingUnsupported` instead of leaking state across samples.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from protocol.adapters import ImageAdapter
from trainer_lib.materialize import MaterializeStats, MissingPolicy, materialize
from trainer_lib.packing import PackedMicroBatch, check_placeholder_alignment, replace_loss_mask
from trainer_lib.positions import MROPE_MODEL_TYPES, build_position_ids, cu_seqlens

__all__ = [
    "VARLEN_ATTENTION",
    "ForwardResult",
    "MaterializedMicroBatch",
    "PackedInputs",
    "PackingUnsupported",
    "check_packable",
    "materialize_micro_batch",
    "packed_inputs",
    "packed_logprobs",
    "prepare_model_for_packing",
    "register_varlen_attention",
    "select_backend",
]

VARLEN_ATTENTION = "mmref_varlen"
"""Name under which :func:`register_varlen_attention` registers PyTorch's varlen attention."""
_CPU_BACKENDS = ("sdpa", "eager")
_CUDA_BACKENDS = (VARLEN_ATTENTION, "flash_attention_2", "flash_attention_3")


class PackingUnsupported(ValueError):
    """The model (or backend, or device) cannot run a packed micro-batch without leaking across samples."""


# --- backends -----------------------------------------------------------------------------


def _varlen_kernel() -> Callable[..., torch.Tensor]:
    """``torch.nn.attention.varlen.varlen_attn`` (imported lazily; CUDA only at run time)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.lru_cache(maxsize=8)
def _kernel_params(kernel: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def _varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, L, D]`` -> ``([1, L, H, D], None)``.

    Causal (text) calls run ``varlen_attn`` over ``kwargs["mmref_cu_seqlens"]`` (else derived
    from the zeros of ``kwargs["position_ids"]``); non-causal calls (one vision chunk each) go to
    transformers' ``sdpa_attention_forward``. The kernel's keywords are read from its signature,
    which changed across torch releases: ``is_causal`` (older) or ``window_size=(-1, 0)``; ``scale``
    and ``enable_gqa`` where present (else a non-default scale is refused and KV heads are
    repeated); ``num_splits=1`` where present (torch/nn/attention/varlen.py: disables split-KV, so
    a sample's logprobs are bit-identical packed or alone).
    """
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=False
        )
    if attention_mask is not None or query.shape[0] != 1:
        raise PackingUnsupported(
            f"{VARLEN_ATTENTION} runs one packed row with attention_mask=None, got batch "
            f"{query.shape[0]} and mask {None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    if sliding_window is not None or dropout:
        raise PackingUnsupported(f"{VARLEN_ATTENTION} supports neither sliding windows nor attention dropout")
    cu = kwargs.get("mmref_cu_seqlens")
    max_len = kwargs.get("mmref_max_seqlen")
    if cu is None:
        pos = kwargs.get("position_ids")
        if pos is None:
            raise PackingUnsupported(f"{VARLEN_ATTENTION} needs mmref_cu_seqlens or text position ids")
        starts = torch.nonzero(pos.reshape(-1) == 0).flatten()
        cu = torch.cat([starts, torch.tensor([pos.shape[-1]], device=starts.device)]).to(torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
    kernel = _varlen_kernel()
    params = _kernel_params(kernel)
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [L, H, D]
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, q.shape[-1] ** -0.5, rel_tol=1e-6):
        raise PackingUnsupported(
            f"varlen kernel {kernel} takes no scale and the model scales by {scaling}, not 1/sqrt(head_dim)"
        )
    if "num_splits" in params:
        kw["num_splits"] = 1  # no split-KV: a sample's output does not depend on what it is packed with
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal
    elif "is_causal" in params:
        kw["is_causal"] = True
    else:
        raise PackingUnsupported(f"varlen kernel {kernel} takes neither window_size nor is_causal")
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = kernel(q, k, v, cu, cu, int(max_len), int(max_len), **kw)
    return out.unsqueeze(0), None


def register_varlen_attention() -> str:
    """Register :data:`VARLEN_ATTENTION` with transformers (idempotent); returns the name.

    ``AttentionInterface.register(name, fn)`` plus ``AttentionMaskInterface.register(name,
    flash_attention_mask)`` (no dense mask is built; NOTES "GPU facts"). Safe to call on CPU.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, flash_attention_mask)
    return VARLEN_ATTENTION


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def select_backend(model: torch.nn.Module) -> str:
    """``"sdpa"`` on CPU; on CUDA ``"flash_attention_2"`` when ``flash_attn`` is installed, else
    :data:`VARLEN_ATTENTION`."""
    if _device(model).type != "cuda":
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else VARLEN_ATTENTION


def check_packable(model: torch.nn.Module, backend: str | None = None) -> None:
    """Raise :class:`PackingUnsupported` where a packed forward would mix samples.

    Refused: model types other than Qwen2/2.5/3-VL (:data:`trainer_lib.positions.MROPE_MODEL_TYPES`);
    linear-attention layers (recurrent state would flow across sample boundaries without
    flash-linear-attention's varlen kernels); sdpa/eager on CUDA; float32 on CUDA (the varlen
    kernels take float16/bfloat16 only).
    """
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = list(getattr(text, "layer_types", None) or [])
    if "linear_attention" in layer_types:
        raise PackingUnsupported(
            f"{config.model_type}: {layer_types.count('linear_attention')} linear-attention layers carry "
            f"recurrent state across packed samples; packing them needs flash-linear-attention's varlen "
            f"kernels (CUDA), not available on {_device(model).type}: run these samples unpacked"
        )
    if config.model_type not in MROPE_MODEL_TYPES:
        raise PackingUnsupported(f"packed forward supports {MROPE_MODEL_TYPES}, not {config.model_type!r}")
    backend = backend or text._attn_implementation
    device = _device(model).type
    allowed = _CUDA_BACKENDS if device == "cuda" else (*_CPU_BACKENDS, VARLEN_ATTENTION)
    if backend not in allowed:
        raise PackingUnsupported(
            f"attention backend {backend!r} cannot run packed batches on {device}; use one of {allowed}"
            + (" (never sdpa for packed CUDA batches)" if device == "cuda" else "")
        )
    dtype = next(model.parameters()).dtype
    if device == "cuda" and dtype not in (torch.float16, torch.bfloat16):
        raise PackingUnsupported(
            f"{backend} (FlashAttention varlen) takes float16/bfloat16 on CUDA, the model is {dtype}"
        )


def prepare_model_for_packing(model: torch.nn.Module, backend: str | None = None) -> str:
    """Check the model and switch it to the packing backend; returns the backend name.

    Args:
        backend: default :func:`select_backend`. :data:`VARLEN_ATTENTION` is registered first.

    Raises:
        PackingUnsupported: see :func:`check_packable`.
    """
    backend = backend or select_backend(model)
    check_packable(model, backend)
    if backend == VARLEN_ATTENTION:
        register_varlen_attention()
    if model.config.get_text_config()._attn_implementation != backend:
        model.set_attn_implementation(backend)
    return backend


# --- inputs -------------------------------------------------------------------------------


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
    """int64 ``[num images of the micro-batch]`` with ``dedup``: row of ``image_grid_thw`` per image."""


def materialize_micro_batch(
    packed: PackedMicroBatch,
    adapter: ImageAdapter,
    asset_root: str | os.PathLike[str],
    *,
    policy: MissingPolicy = "placeholder_zero_loss",
    max_workers: int = 2,
    dedup: bool = False,
) -> MaterializedMicroBatch:
    """Features for every image of the micro-batch, in pack order.

    Real images go through :func:`trainer_lib.materialize` (each distinct ref processed once);
    synthetic pad images (``ImageSpan.ref is None``) are ``adapter.synthesize_placeholder(grid)``.
    ``dedup=True``: each distinct image's features once plus ``image_index`` (see
    :func:`trainer_lib.materialize`); :func:`packed_logprobs` then runs the vision tower once per
    distinct image and repeats its embeddings.

    Raises:
        MMRefError subclasses: see :func:`trainer_lib.materialize`.
        ValueError: a synthetic image before a real one (pads must follow the real samples).
    """
    kinds = [im.ref is None for im in packed.images]
    if kinds != sorted(kinds):
        raise ValueError("synthetic pad images must follow every real image of the micro-batch")
    real_slots = [s for s in packed.slots if s.num_images and packed.images[s.first_image].ref is not None]
    batch = materialize(
        [s.sample for s in real_slots],
        adapter,
        asset_root,
        policy=policy,
        max_workers=max_workers,
        dedup=dedup,
    )
    parts: list[Mapping[str, torch.Tensor]] = [batch.features] if batch.features else []
    synthetic = [adapter.synthesize_placeholder(im.grid).tensors for im in packed.images if im.ref is None]
    parts += synthetic
    features = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
    image_index = None
    if dedup and features:
        real = batch.image_index if batch.image_index is not None else torch.empty(0, dtype=torch.int64)
        n_unique_real = len(batch.features.get(adapter.grid_field, ())) if batch.features else 0
        pads = torch.arange(n_unique_real, n_unique_real + len(synthetic), dtype=torch.int64)
        image_index = torch.cat([real, pads])
    loss_mask = None
    for slot, sample in zip(real_slots, batch.samples, strict=True):
        if sample is not slot.sample:  # materialize zeroed this sample's loss mask
            loss_mask = loss_mask or list(packed.micro_batch.loss_mask)
            loss_mask[slot.start : slot.start + slot.length] = sample.loss_mask
    if loss_mask is not None:
        packed = replace_loss_mask(packed, loss_mask)
    return MaterializedMicroBatch(
        packed=packed, features=features, stats=batch.stats, image_index=image_index
    )


@dataclass(frozen=True)
class PackedInputs:
    """Model-ready tensors of one packed micro-batch."""

    input_ids: torch.Tensor
    """int64 ``[1, L]``."""
    position_ids: torch.Tensor
    """int64 ``[4, 1, L]`` (MRoPE, row 0 = text positions restarting per sample)."""
    cu_seqlens: torch.Tensor
    """int32 ``[num_samples + 1]``."""
    max_seqlen: int
    loss_mask: torch.Tensor
    """bool ``[L]``: the micro-batch's loss mask without each sample's first token (no prefix)."""
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_index: torch.Tensor | None = None
    """int64 ``[num images]`` when ``pixel_values``/``image_grid_thw`` hold distinct images only."""

    def to(self, device: torch.device | str) -> PackedInputs:
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
    image_index: torch.Tensor | None = None,
) -> PackedInputs:
    """Build the model inputs and run the placeholder tripwire.

    Args:
        packed: the micro-batch (after :func:`materialize_micro_batch` if it has images).
        features: its features in pack order (``{}`` without images).
        model_or_config: the HF model or its config (for ``get_rope_index``, ``image_token_id``
            and ``vision_config.spatial_merge_size``).
        image_index: with deduplicated features (:func:`materialize_micro_batch` ``dedup=True``),
            the row of ``image_grid_thw`` each image of the micro-batch shows.

    Raises:
        ValueError: placeholder tokens != feature rows (:func:`check_placeholder_alignment`),
            features whose grids differ from the micro-batch's images, or images without features.
    """
    config = getattr(model_or_config, "config", model_or_config)
    ids = torch.as_tensor(packed.micro_batch.input_ids, dtype=torch.long).unsqueeze(0)
    pixel_values = grid = None
    if packed.images or features:
        if not features:
            raise ValueError(f"{len(packed.images)} images in the micro-batch but no features")
        grid = features["image_grid_thw"]
        per_image = grid if image_index is None else grid[image_index]
        if per_image.tolist() != [list(g) for g in packed.image_grids]:
            raise ValueError(
                f"feature grids {per_image.tolist()} differ from the micro-batch's images "
                f"{packed.image_grids}"
            )
        check_placeholder_alignment(
            ids,
            config.image_token_id,
            {"image_grid_thw": per_image},
            mm_token_type_ids=torch.as_tensor(packed.mm_token_type_ids).unsqueeze(0),
            merge_size=config.vision_config.spatial_merge_size,
        )
        pixel_values = features["pixel_values"]
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


# --- forward ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardResult:
    logprobs: torch.Tensor
    """float32 ``[L]``: ``logprobs[t] = log p(input_ids[t] | input_ids[start:t])`` within the
    token's own sample (temperature-scaled); 0 at each sample's first token. Same alignment as
    ``TrainingSample.inference_logprobs`` (vLLM's logprob of the sampled token ``t``)."""
    loss_mask: torch.Tensor
    """bool ``[L]``: :attr:`PackedInputs.loss_mask`."""
    backend: str
    """The attention implementation that ran."""


def _repeated_image_features(model: torch.nn.Module, pixels: torch.Tensor, inputs: PackedInputs) -> Any:
    """Vision tower once per distinct image, embeddings repeated per image of the micro-batch.

    Uses transformers' own ``get_image_features`` and its ``mm_encoder_outputs`` forward argument
    (Qwen2-VL/2.5-VL/3-VL in 5.19): ``pooler_output`` is a tuple of per-image embeddings, and
    Qwen3-VL's ``deepstack_features`` a list (per layer) of such tuples. Gradients of repeated
    images accumulate into the one vision forward.
    """
    enc = model.model.get_image_features(pixels, inputs.image_grid_thw, return_dict=True)
    index = inputs.image_index.tolist()
    enc.pooler_output = tuple(enc.pooler_output[i] for i in index)
    if getattr(enc, "deepstack_features", None) is not None:
        enc.deepstack_features = [tuple(layer[i] for i in index) for layer in enc.deepstack_features]
    return enc


def packed_logprobs(
    model: torch.nn.Module,
    inputs: PackedInputs,
    *,
    temperature: float = 1.0,
    chunk_size: int = 4096,
    use_cache: bool = False,
) -> ForwardResult:
    """Forward one packed micro-batch; per-token logprobs of the packed tokens.

    Runs ``model.model(input_ids, position_ids [4,1,L], pixel_values, image_grid_thw,
    attention_mask=None, use_cache=False)`` then the LM head in ``chunk_size``-token chunks
    (float32 log-softmax; no ``[L, vocab]`` tensor at once). Gradients flow when enabled.

    Args:
        temperature: logits are divided by it. To compare with a vLLM server's logprobs, match
            its ``--logprobs-mode``: ``processed_logprobs`` (the sampling distribution, what an
            importance ratio needs; valid with top_p=1 and top_k off) are after temperature, so
            pass the sampling temperature; vLLM's default ``raw_logprobs`` are before it
            (vllm/v1/sample/sampler.py), so pass 1.0.
        use_cache: must stay False; True exists only so tests can show the cross-sample leak.

    Raises:
        PackingUnsupported: see :func:`check_packable`.
    """
    check_packable(model)
    backend = model.config.get_text_config()._attn_implementation
    device = _device(model)
    inputs = inputs.to(device)
    kwargs: dict[str, Any] = {}
    if backend == VARLEN_ATTENTION:
        kwargs.update(mmref_cu_seqlens=inputs.cu_seqlens, mmref_max_seqlen=inputs.max_seqlen)
    dtype = next(model.parameters()).dtype
    pixels = None if inputs.pixel_values is None else inputs.pixel_values.to(dtype)
    grid = inputs.image_grid_thw
    if pixels is not None and inputs.image_index is not None:
        kwargs["mm_encoder_outputs"] = {"image": _repeated_image_features(model, pixels, inputs)}
        pixels, grid = None, grid[inputs.image_index]
    out = model.model(
        input_ids=inputs.input_ids,
        position_ids=inputs.position_ids,
        attention_mask=None,
        use_cache=use_cache,
        pixel_values=pixels,
        image_grid_thw=grid,
        **kwargs,
    )
    hidden = out.last_hidden_state[0, :-1]  # position t predicts token t+1
    targets = inputs.input_ids[0, 1:]
    head = model.get_output_embeddings()
    pieces = []
    for lo in range(0, hidden.shape[0], chunk_size):
        logits = head(hidden[lo : lo + chunk_size]).float() / temperature
        picked = logits.gather(-1, targets[lo : lo + chunk_size, None]).squeeze(-1)
        pieces.append(picked - torch.logsumexp(logits, dim=-1))
    logprobs = torch.cat([torch.zeros(1, device=device), *pieces])
    starts = inputs.cu_seqlens[:-1].long()
    logprobs = logprobs.index_fill(0, starts, 0.0)
    return ForwardResult(logprobs=logprobs, loss_mask=inputs.loss_mask, backend=backend)
