"""The varlen attention kernel for packed micro-batches on CUDA (``"mmref_varlen"``).

One packed micro-batch is one row: ``query [1, H, L, D]`` with ``attention_mask=None``. The
backend :data:`VARLEN_ATTENTION` runs PyTorch's ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention varlen, fp16/bf16) over the row's sample boundaries, registered with
``transformers.AttentionInterface`` and ``transformers.masking_utils.AttentionMaskInterface``
(``flash_attention_mask``: no dense mask). ``cu_seqlens`` is computed once per micro-batch and
passed down as the model-call keyword :data:`~trainer_lib.packed_call.CU_SEQLENS_KWARG` (no
per-layer sync). The vision tower calls it once per image chunk, non-causal, which goes to
transformers' sdpa (a single image, nothing packed). Which backends keep samples apart, and when
this one is chosen: :mod:`trainer_lib.prepare`.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from trainer_lib.hf_surface import register_attention, sdpa_attention_forward
from trainer_lib.packed_call import CU_SEQLENS_KWARG, MAX_SEQLEN_KWARG, PackingUnsupported

__all__ = ["VARLEN_ATTENTION", "register_varlen_attention"]

VARLEN_ATTENTION = "mmref_varlen"
"""Name under which :func:`register_varlen_attention` registers PyTorch's varlen attention."""


def _varlen_kernel() -> Callable[..., torch.Tensor]:
    """``torch.nn.attention.varlen.varlen_attn`` (imported lazily; CUDA only at run time)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.lru_cache(maxsize=8)
def _kernel_params(kernel: Callable[..., Any]) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


# over 6 parameters by design: transformers' attention interface (ALL_ATTENTION_FUNCTIONS) fixes it
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
    register_attention(VARLEN_ATTENTION, _varlen_attention_forward)
    return VARLEN_ATTENTION
