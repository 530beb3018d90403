"""Attention backends for packed micro-batches: which ones keep samples apart, and the varlen kernel.

One packed micro-batch is one row: ``input_ids [1, L]``, ``position_ids [4, 1, L]`` (row 0
restarts at 0 per sample, rows 1-3 from transformers' ``get_rope_index``; see
:mod:`trainer_lib.positions`), ``pixel_values`` / ``image_grid_thw`` of every image in pack
order, ``attention_mask=None``. Attention must stay inside each sample. Backends:

- ``"sdpa"`` / ``"eager"`` (CPU): transformers builds the block-diagonal causal mask from row 0
  (``masking_utils.find_packed_sequence_indices``) — **only** with ``attention_mask=None`` and
  ``use_cache=False``: with a cache object present it silently builds a plain causal mask across
  the whole pack (logprob error ~0.24 on the tiny Qwen2-VL; docs/PACKING.md §7).
- ``"mmref_varlen"`` (CUDA): PyTorch's ``torch.nn.attention.varlen.varlen_attn``
  (FlashAttention varlen, fp16/bf16), registered with ``transformers.AttentionInterface`` and
  ``transformers.masking_utils.AttentionMaskInterface`` (``flash_attention_mask``: no dense mask).
  ``cu_seqlens`` is computed once per micro-batch and passed down as a kwarg (no per-layer sync).
  The vision tower calls it once per image chunk, non-causal, which goes to transformers' sdpa
  (a single image, nothing packed).
- ``"flash_attention_2"`` (CUDA, when the ``flash_attn`` package is installed): transformers'
  own varlen path, which derives ``cu_seqlens`` from the text position ids.

sdpa is refused for packed CUDA batches (dense masks: out of memory at RL lengths, and slower
than varlen, as measured on a lent H100: docs/PACKING.md §6).

Hybrid models (Qwen3.5 / Qwen3.5-MoE: Gated DeltaNet layers beside full attention) also need a
linear-attention path that resets the conv and recurrent state at every sample boundary
(:mod:`trainer_lib.linear_attention`): ``"per_segment_torch"`` on CPU, ``"fla_varlen"``
(flash-linear-attention) on CUDA. :func:`prepare_model_for_packing` installs it beside the
attention backend; the boundaries reach those layers as the model-call keyword
:data:`CU_SEQLENS_KWARG`. A combination that cannot pack safely (CUDA without
flash-linear-attention, an unknown layer kind, a hybrid model not prepared) raises
:class:`PackingUnsupported` instead of leaking state across samples.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from trainer_lib.positions import mrope_model_types

__all__ = [
    "CU_SEQLENS_KWARG",
    "MAX_SEQLEN_KWARG",
    "VARLEN_ATTENTION",
    "PackingUnsupported",
    "check_packable",
    "prepare_model_for_packing",
    "register_varlen_attention",
    "select_backend",
]

VARLEN_ATTENTION = "mmref_varlen"
"""Name under which :func:`register_varlen_attention` registers PyTorch's varlen attention."""
CU_SEQLENS_KWARG = "mmref_cu_seqlens"
"""Model-call keyword carrying a packed row's int ``[num_samples + 1]`` sample boundaries, read by
:data:`VARLEN_ATTENTION` and by the linear-attention layers (:mod:`trainer_lib.linear_attention`).
transformers forwards unknown keywords to every decoder layer; the vision tower takes
``cu_seqlens`` / ``position_ids`` itself, so those names are not used."""
MAX_SEQLEN_KWARG = "mmref_max_seqlen"
"""Model-call keyword with the longest sample's token count (:data:`VARLEN_ATTENTION` only)."""
_CPU_BACKENDS = ("sdpa", "eager")
_log = logging.getLogger(__name__)
_CUDA_BACKENDS = (VARLEN_ATTENTION, "flash_attention_2", "flash_attention_3")


class PackingUnsupported(ValueError):
    """The model (or backend, or device) cannot run a packed micro-batch without leaking across samples."""


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

    Causal (text) calls run ``varlen_attn`` over ``kwargs[CU_SEQLENS_KWARG]`` (else derived
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
    cu, max_len = _boundaries(kwargs)
    kernel = _varlen_kernel()
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [L, H, D]
    kw = _kernel_kwargs(kernel, scaling, head_dim=q.shape[-1], gqa=q.shape[1] != k.shape[1])
    if q.shape[1] != k.shape[1] and "enable_gqa" not in kw:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = kernel(q, k, v, cu, cu, int(max_len), int(max_len), **kw)
    return out.unsqueeze(0), None


def _boundaries(kwargs: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)``: passed down by :func:`~trainer_lib.packed_logprobs`, else
    derived from the zeros of the text position ids."""
    cu = kwargs.get(CU_SEQLENS_KWARG)
    if cu is not None:
        return cu, int(kwargs[MAX_SEQLEN_KWARG])
    pos = kwargs.get("position_ids")
    if pos is None:
        raise PackingUnsupported(f"{VARLEN_ATTENTION} needs {CU_SEQLENS_KWARG} or text position ids")
    starts = torch.nonzero(pos.reshape(-1) == 0).flatten()
    cu = torch.cat([starts, torch.tensor([pos.shape[-1]], device=starts.device)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def _kernel_kwargs(
    kernel: Callable[..., Any], scaling: float | None, *, head_dim: int, gqa: bool
) -> dict[str, Any]:
    """The keywords ``kernel``'s signature takes for a causal call (see :func:`_varlen_attention_forward`)."""
    params = _kernel_params(kernel)
    kw: dict[str, Any] = {}
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and not math.isclose(scaling, head_dim**-0.5, rel_tol=1e-6):
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
    if gqa and "enable_gqa" in params:
        kw["enable_gqa"] = True
    return kw


def register_varlen_attention() -> str:
    """Register :data:`VARLEN_ATTENTION` with transformers (idempotent); returns the name.

    ``AttentionInterface.register(name, fn)`` plus ``AttentionMaskInterface.register(name,
    flash_attention_mask)`` (no dense mask is built). Safe to call on CPU.
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
    from trainer_lib import linear_attention as la  # it imports this module's PackingUnsupported

    config = model.config
    if config.model_type not in mrope_model_types():
        raise PackingUnsupported(
            f"packed forward supports {list(mrope_model_types())}, not {config.model_type!r}"
        )
    text = config.get_text_config()
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
    return la.select_linear_attention_path(model, linear_attention or la.linear_attention_path(model))


def prepare_model_for_packing(
    model: torch.nn.Module, backend: str | None = None, *, linear_attention: str | None = None
) -> str:
    """Check the model and switch it to the packing backend; returns the backend name.

    Hybrid models also get their linear-attention path installed
    (:func:`~trainer_lib.linear_attention.prepare_linear_attention`); it is logged beside the
    backend, reported by :func:`~trainer_lib.linear_attention.linear_attention_path` and by every
    :class:`~trainer_lib.ForwardResult` (e.g. ``sdpa`` + ``per_segment_torch`` on CPU).

    Args:
        backend: default :func:`select_backend`. :data:`VARLEN_ATTENTION` is registered first.
        linear_attention: default ``"per_segment_torch"`` off CUDA, ``"fla_varlen"`` on CUDA.

    Raises:
        PackingUnsupported, ValueError: see :func:`check_packable`.
        ImportError: ``"fla_varlen"`` with an ``fla`` that lacks the varlen entry points.
    """
    from trainer_lib import linear_attention as la  # it imports this module's PackingUnsupported

    backend = backend or select_backend(model)
    path = check_packable(model, backend, linear_attention)
    if backend == VARLEN_ATTENTION:
        register_varlen_attention()
    if model.config.get_text_config()._attn_implementation != backend:
        model.set_attn_implementation(backend)
    if path is not None:
        la.prepare_linear_attention(model, path)
    _log.info("packed %s: attention %s, linear attention %s", model.config.model_type, backend, path)
    return backend
