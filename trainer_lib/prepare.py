"""Make a model run packed micro-batches: which attention backends and linear-attention paths keep
samples apart, checked and installed before the first forward.

One packed micro-batch is one row: ``input_ids [1, L]``, ``position_ids [4, 1, L]`` (row 0
restarts at 0 per sample, rows 1-3 from transformers' ``get_rope_index``; see
:mod:`trainer_lib.positions`), ``pixel_values`` / ``image_grid_thw`` of every image in pack
order, ``attention_mask=None``. Attention must stay inside each sample. Backends:

- ``"sdpa"`` / ``"eager"`` (CPU): transformers builds the block-diagonal causal mask from row 0
  (``masking_utils.find_packed_sequence_indices``) — **only** with ``attention_mask=None`` and
  ``use_cache=False``: with a cache object present it silently builds a plain causal mask across
  the whole pack (logprob error ~0.24 on the tiny Qwen2-VL; docs/PACKING.md §7).
- ``"mmref_varlen"`` (CUDA): PyTorch's varlen attention over the row's ``cu_seqlens``
  (:mod:`trainer_lib.attention`).
- ``"flash_attention_2"`` (CUDA, when the ``flash_attn`` package is installed): transformers'
  own varlen path, which derives ``cu_seqlens`` from the text position ids.

sdpa is refused for packed CUDA batches (dense masks: out of memory at RL lengths, and slower
than varlen, as measured on a lent H100: docs/PACKING.md §6).

Hybrid models (Qwen3.5 / Qwen3.5-MoE: Gated DeltaNet layers beside full attention) also need a
linear-attention path that resets the conv and recurrent state at every sample boundary
(:mod:`trainer_lib.linear_attention`): ``"per_segment_torch"`` on CPU, ``"fla_varlen"``
(flash-linear-attention) on CUDA. :func:`prepare_model_for_packing` installs it beside the
attention backend; the boundaries reach those layers as the model-call keyword
:data:`~trainer_lib.packed_call.CU_SEQLENS_KWARG`. A combination that cannot pack safely (CUDA
without flash-linear-attention, an unknown layer kind, a hybrid model not prepared) raises
:class:`~trainer_lib.packed_call.PackingUnsupported` instead of leaking state across samples.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from trainer_lib.attention import VARLEN_ATTENTION, register_varlen_attention
from trainer_lib.hf_surface import attn_implementation, set_attn_implementation
from trainer_lib.linear_attention import (
    linear_attention_path,
    prepare_linear_attention,
    select_linear_attention_path,
)
from trainer_lib.packed_call import PackingUnsupported
from trainer_lib.positions import mrope_model_types

__all__ = ["check_packable", "prepare_model_for_packing", "select_backend"]

_CPU_BACKENDS = ("sdpa", "eager")
_CUDA_BACKENDS = (VARLEN_ATTENTION, "flash_attention_2")
_log = logging.getLogger(__name__)


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def select_backend(model: torch.nn.Module) -> str:
    """``"sdpa"`` on CPU; on CUDA ``"flash_attention_2"`` when ``flash_attn`` is installed, else
    :data:`VARLEN_ATTENTION`."""
    if _device(model).type != "cuda":
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else VARLEN_ATTENTION


def check_packable(
    model: torch.nn.Module, backend: str | None = None, linear_attention: str | None = None
) -> str | None:
    """Raise :class:`PackingUnsupported` where a packed forward would mix samples.

    Args:
        backend: the attention backend to check; default the model's current one.
        linear_attention: the linear-attention path to check (``"per_segment_torch"`` /
            ``"fla_varlen"``); default the installed one, else the one
            :func:`~trainer_lib.linear_attention.select_linear_attention_path` picks for the device.

    Returns:
        The linear-attention path a packed forward of this model needs, None for a model without
        linear-attention layers.

    Raises:
        PackingUnsupported: model types that are not MRoPE
            (:func:`trainer_lib.positions.mrope_model_types`: Kimi); sdpa/eager on CUDA; float32
            on CUDA (the varlen kernels take float16/bfloat16 only); linear-attention layers that
            cannot be packed with that path (CUDA without flash-linear-attention, ``"fla_varlen"``
            off CUDA, unknown layer kinds or Gated DeltaNet classes).
        ValueError: an unknown ``linear_attention`` path.
    """
    config = model.config
    if config.model_type not in mrope_model_types():
        raise PackingUnsupported(
            f"packed forward supports {list(mrope_model_types())}, not {config.model_type!r}"
        )
    backend = backend or attn_implementation(config)
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
    return select_linear_attention_path(model, linear_attention or linear_attention_path(model))


def prepare_model_for_packing(
    model: torch.nn.Module,
    backend: str | None = None,
    *,
    linear_attention: str | None = None,
    activation_checkpointing: bool = True,
) -> str:
    """Check the model and switch it to the packing backend; returns the backend name.

    Hybrid models also get their linear-attention path installed
    (:func:`~trainer_lib.linear_attention.prepare_linear_attention`); it is logged beside the
    backend, reported by :func:`~trainer_lib.linear_attention.linear_attention_path` and by every
    :class:`~trainer_lib.ForwardResult` (e.g. ``sdpa`` + ``per_segment_torch`` on CPU).

    Args:
        backend: default :func:`select_backend`. :data:`VARLEN_ATTENTION` is registered first.
        linear_attention: default ``"per_segment_torch"`` off CUDA, ``"fla_varlen"`` on CUDA.
        activation_checkpointing: True (default) turns on transformers' own gradient
            checkpointing (``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=
            {"use_reentrant": False})``) where the model supports it
            (``model.supports_gradient_checkpointing``): every language decoder layer and vision
            block keeps only its input for the backward and runs again there (transformers
            checkpoints in training mode only, ``model.train()``); the linear-attention path stays
            installed, so the recomputation keeps the sample boundaries. False turns it off.
            Gradients are the same either way (``tests/test_checkpointing.py``).

    Raises:
        PackingUnsupported, ValueError: see :func:`check_packable`.
        ImportError: ``"fla_varlen"`` with an ``fla`` that lacks the varlen entry points.
    """
    backend = backend or select_backend(model)
    path = check_packable(model, backend, linear_attention)
    if backend == VARLEN_ATTENTION:
        register_varlen_attention()
    if attn_implementation(model.config) != backend:
        set_attn_implementation(model, backend)
    if path is not None:
        prepare_linear_attention(model, path)
    checkpointed = _set_activation_checkpointing(model, activation_checkpointing)
    _log.info(
        "packed %s: attention %s, linear attention %s, activation checkpointing %s",
        model.config.model_type, backend, path, checkpointed,
    )  # fmt: skip
    return backend


def _set_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> bool:
    """transformers' gradient checkpointing on (non-reentrant) where supported, or off; returns
    whether it is on."""
    if enabled and getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return True
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    return False
