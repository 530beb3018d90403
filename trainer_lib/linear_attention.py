"""Packed forward for hybrid linear-attention models (Qwen3.5 / Qwen3.5-MoE): sample boundaries kept.

Qwen3.5's text model mixes full-attention layers with Gated DeltaNet layers
(``*GatedDeltaNet``: a width-``linear_conv_kernel_dim`` causal conv over q/k/v, then the gated
delta-rule recurrence). transformers 5.19's forward of those layers sees one packed row as one
sequence: the conv carries ``kernel - 1`` tokens and the recurrent state carries everything into
the next sample (measured on the tiny models: packed vs one-sample-at-a-time logprobs off by
4e-2, docs/PACKING.md §9). :func:`prepare_linear_attention` replaces the forward of every such
layer instance with one that honours the micro-batch's ``cu_seqlens``, passed to the model call as
the keyword :data:`~trainer_lib.packed_call.CU_SEQLENS_KWARG` (transformers forwards unknown keywords
down to every layer; the vision tower ignores this name, unlike ``cu_seqlens`` / ``position_ids``,
which it takes). The full-attention layers keep the attention backend rules of
:mod:`trainer_lib.prepare` (``mmref_varlen`` reads the same keyword).
:func:`trainer_lib.prepare_model_for_packing` calls :func:`prepare_linear_attention` and
:func:`trainer_lib.packed_logprobs` passes the keyword; this module is the layer-level part.

Paths (:func:`linear_attention_path` reports the installed one, like the attention backend):

- ``"per_segment_torch"`` (CPU; selectable on CUDA, slow): each segment's conv and recurrence
  run alone through transformers' own torch functions of the layer's modeling module
  (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``, unwrapped from transformers' kernel
  dispatch), with zero conv and recurrent state at every boundary. Autograd and gradient
  checkpointing go through it unchanged (the replaced forward stays installed, so recomputation
  in backward takes the same path).
- ``"fla_varlen"`` (CUDA): flash-linear-attention's varlen kernels,
  ``fla.modules.convolution.causal_conv1d(..., cu_seqlens=)`` and
  ``fla.ops.gated_delta_rule.chunk_gated_delta_rule(..., cu_seqlens=)`` (PyPI ``fla-core``,
  also pulled in by ``flash-linear-attention``; Triton; written against 0.6.0, where
  ``fla.modules.convolution`` is the alias of ``fla.modules.causal_conv1d``). Not run on this
  project's CPU machines; verified on a lent H100 (2026-11-26, docs/PACKING.md §9 and "GPU
  measurements"): bf16, packed vs each sample alone bit-identical for the tiny Qwen3.5 and
  Qwen3.5-MoE. fla-core 0.6.0 refuses the backward on Hopper with Triton < 3.7.1 (the forward runs).

Both paths compute the layer as ``Qwen3_5GatedDeltaNet.forward`` does without a cache
(transformers ``models/qwen3_5/modeling_qwen3_5.py``, mirrored by :func:`_gated_delta_net`; the
MoE variant's layer is the same code). A packed row whose model call lacks the keyword is
refused (:class:`~trainer_lib.packed_call.PackingUnsupported`), found from text position ids that
restart inside the row; so are layer kinds and models this module cannot pack safely.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from trainer_lib.hf_surface import gated_delta_rule_kernels
from trainer_lib.packed_call import CU_SEQLENS_KWARG, PackingUnsupported

__all__ = [
    "FLA_VARLEN",
    "PER_SEGMENT_TORCH",
    "linear_attention_layers",
    "linear_attention_path",
    "prepare_linear_attention",
    "remove_linear_attention",
    "select_linear_attention_path",
]

PER_SEGMENT_TORCH = "per_segment_torch"
FLA_VARLEN = "fla_varlen"
_FLA_PACKAGE = "flash-linear-attention"
"""The PyPI distribution that ships the ``fla`` package (also ``fla-core``)."""

_KNOWN_LAYER_TYPES = frozenset({"full_attention", "linear_attention"})
_GDN_PARTS = (  # what _gated_delta_net reads: Qwen3.5's layer (Qwen3-Next's fuses qkvz / ba instead)
    *("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm", "out_proj"),
    *("key_dim", "value_dim", "head_k_dim", "head_v_dim", "num_k_heads", "num_v_heads", "activation"),
)
_INSTALLED = "_mmref_linear_attention"
_HOOK = "_mmref_linear_attention_hook"


class _Kernels(NamedTuple):
    """A path's two boundary-aware pieces.

    ``conv(x [1, L, C], weight [C, W], bias [C] | None, activation, cu)`` -> ``[1, L, C]``;
    ``rule(q, k, v [1, L, H, D], g, beta [1, L, H], cu)`` -> ``[1, L, H, Dv]``.
    """

    conv: Callable[..., torch.Tensor]
    rule: Callable[..., torch.Tensor]


# --- which layers, which path --------------------------------------------------------------


def linear_attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet layer instances, in module order (``[]`` for other models).

    Raises:
        PackingUnsupported: layer kinds other than full/linear attention in the text config, a
            Gated DeltaNet class other than Qwen3.5's (e.g. Qwen3-Next's fused projections), or
            fewer such layers than the config's ``linear_attention`` entries.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = list(getattr(config, "layer_types", None) or [])
    unknown = sorted(set(layer_types) - _KNOWN_LAYER_TYPES)
    if unknown:
        raise PackingUnsupported(f"{config.model_type}: layer kinds {unknown} may carry state across samples")
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    for layer in layers:
        missing = [p for p in _GDN_PARTS if not hasattr(layer, p)]
        if missing:
            raise PackingUnsupported(
                f"{type(layer).__name__} lacks {missing} of Qwen3.5's Gated DeltaNet: no packed path for it"
            )
    if len(layers) != layer_types.count("linear_attention"):
        raise PackingUnsupported(
            f"{config.model_type}: {layer_types.count('linear_attention')} linear-attention layers in the "
            f"config but {len(layers)} Gated DeltaNet modules found"
        )
    return layers


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type


def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _choose(device_type: str, fla_available: bool, requested: str | None) -> str:
    """The path for a device, given whether ``fla`` imports and what the caller asked for."""
    if requested not in (None, PER_SEGMENT_TORCH, FLA_VARLEN):
        raise ValueError(
            f"linear-attention path must be {PER_SEGMENT_TORCH!r} or {FLA_VARLEN!r}, not {requested!r}"
        )
    if requested == PER_SEGMENT_TORCH or (requested is None and device_type != "cuda"):
        return PER_SEGMENT_TORCH
    if device_type != "cuda":
        raise PackingUnsupported(
            f"{FLA_VARLEN} runs {_FLA_PACKAGE}'s Triton kernels on CUDA, not on {device_type}"
        )
    if not fla_available:
        raise PackingUnsupported(
            f"packing linear-attention layers on CUDA needs {_FLA_PACKAGE}'s varlen kernels: "
            f"`pip install {_FLA_PACKAGE}` (import name `fla`), or ask for {PER_SEGMENT_TORCH!r} (slow)"
        )
    return FLA_VARLEN


def select_linear_attention_path(model: torch.nn.Module, path: str | None = None) -> str | None:
    """The linear-attention path for ``model`` (None: it has no linear-attention layers).

    Args:
        path: None picks ``"per_segment_torch"`` off CUDA and ``"fla_varlen"`` on CUDA.

    Raises:
        PackingUnsupported: see :func:`linear_attention_layers`; ``"fla_varlen"`` off CUDA; CUDA
            without ``fla`` installed (the message names the package).
        ValueError: an unknown ``path``.
    """
    if not linear_attention_layers(model):
        return None
    return _choose(_device_type(model), _fla_available(), path)


def linear_attention_path(model: torch.nn.Module) -> str | None:
    """The installed path (``"per_segment_torch"`` / ``"fla_varlen"``), None when not installed."""
    paths = {getattr(layer, _INSTALLED, None) for layer in linear_attention_layers(model)}
    return paths.pop() if len(paths) == 1 else None


# --- the layer ------------------------------------------------------------------------------


def _bounds(cu: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the non-empty segments of ``cu_seqlens``."""
    edges = [int(x) for x in cu.tolist()]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def _torch_kernels(layer_cls: type) -> _Kernels:
    """transformers' own torch conv and chunked delta rule of the layer's modeling module, run per
    segment with zero initial state (``inspect.unwrap`` skips the kernel dispatch, which would pick
    ``fla`` or ``causal_conv1d`` wherever they import, whether or not they can run here)."""
    conv_fn, rule_fn = gated_delta_rule_kernels(layer_cls)

    def conv(
        x: torch.Tensor, weight: torch.Tensor, bias: Any, activation: str, cu: torch.Tensor
    ) -> torch.Tensor:
        pieces = [conv_fn(x[:, lo:hi].transpose(1, 2), weight, bias, activation) for lo, hi in _bounds(cu)]
        return torch.cat(pieces, dim=2).transpose(1, 2)

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor) -> Tensor:
        pieces = [
            rule_fn(
                q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
                initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
            )[0]
            for lo, hi in _bounds(cu)
        ]  # fmt: skip
        return torch.cat(pieces, dim=1)

    return _Kernels(conv, rule)


def _fla_kernels() -> _Kernels:
    """flash-linear-attention's varlen conv and chunked delta rule (CUDA; verified on a lent H100,
    docs/PACKING.md "GPU measurements"; its backward needs Triton >= 3.7.1 on Hopper)."""
    from fla.modules.convolution import causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def conv(
        x: torch.Tensor, weight: torch.Tensor, bias: Any, activation: str, cu: torch.Tensor
    ) -> torch.Tensor:
        return causal_conv1d(x=x, weight=weight, bias=bias, activation=activation, cu_seqlens=cu.long())[0]

    def rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu: Tensor) -> Tensor:
        return chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long(),
        )[0]  # fmt: skip

    return _Kernels(conv, rule)


def _gated_delta_net(
    layer: Any, hidden_states: torch.Tensor, cu: torch.Tensor, kernels: _Kernels
) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` without cache or padding mask, conv and recurrence by
    ``kernels`` over the segments of ``cu`` (transformers 5.19 ``modeling_qwen3_5.py``)."""
    _, length, _ = hidden_states.shape
    conv = layer.conv1d
    mixed_qkv = kernels.conv(
        layer.in_proj_qkv(hidden_states), conv.weight.squeeze(1), conv.bias, layer.activation, cu
    )
    z = layer.in_proj_z(hidden_states).reshape(1, length, -1, layer.head_v_dim)
    query, key, value = torch.split(mixed_qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(1, length, -1, layer.head_k_dim)
    key = key.reshape(1, length, -1, layer.head_k_dim)
    value = value.reshape(1, length, -1, layer.head_v_dim)
    beta = layer.in_proj_b(hidden_states).sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(layer.in_proj_a(hidden_states).float() + layer.dt_bias)
    if layer.num_v_heads // layer.num_k_heads > 1:
        query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
        key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=2)
    core = kernels.rule(query, key, value, g, beta, cu)
    core = layer.norm(core.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(core.reshape(1, length, -1))


# --- installing it --------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _kernels(layer_cls: type, path: str) -> _Kernels:
    return _fla_kernels() if path == FLA_VARLEN else _torch_kernels(layer_cls)


def _packed_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The installed per-instance forward: :func:`_gated_delta_net` when the call carries
    :data:`CU_SEQLENS_KWARG` (checked against the row once per model call by
    :func:`_check_packed_call`), else transformers' forward (an unpacked call: one sample per row)."""
    cu = kwargs.get(CU_SEQLENS_KWARG)
    if cu is None:
        return type(self).forward(
            self, hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs
        )
    if cache_params is not None or attention_mask is not None or hidden_states.shape[0] != 1:
        raise PackingUnsupported(
            f"{type(self).__name__}: a packed forward is one row [1, L] with no cache and no padding mask "
            f"(got batch {hidden_states.shape[0]}, cache {cache_params is not None}, mask "
            f"{attention_mask is not None}); pass use_cache=False and attention_mask=None"
        )
    return _gated_delta_net(self, hidden_states, cu, _kernels(type(self), getattr(self, _INSTALLED)))


def _check_packed_call(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook of the text model (once per model call; on CUDA one host sync).

    A row whose text positions restart (row 0 of ``[4, 1, L]`` MRoPE positions, see
    :mod:`trainer_lib.positions`, or ``[1, L]``) must carry :data:`CU_SEQLENS_KWARG`, whose
    boundaries must be exactly where the positions restart, ending at ``L``; a packed row needs the
    text row (3-row positions make full attention span the pack).
    """
    position_ids, cu = kwargs.get("position_ids"), kwargs.get(CU_SEQLENS_KWARG)
    if position_ids is None:
        if cu is not None:
            raise PackingUnsupported(f"{CU_SEQLENS_KWARG} without position ids restarting per sample")
        return
    if position_ids.ndim == 3 and position_ids.shape[0] != 4:
        if cu is not None:
            raise PackingUnsupported(
                f"packed rows need [4, 1, L] position ids (row 0: text positions), "
                f"got {tuple(position_ids.shape)}"
            )
        return
    row = position_ids[0, 0] if position_ids.ndim == 3 else position_ids[0]
    starts = torch.nonzero(row == 0).flatten().tolist()
    if cu is None:
        if starts not in ([], [0]):
            raise PackingUnsupported(
                f"packed row (text positions restart at {starts[:8]}) without {CU_SEQLENS_KWARG}: its "
                f"linear-attention layers would carry state from one sample into the next"
            )
        return
    edges = [int(x) for x in cu.tolist()]
    if edges[:-1] != starts or edges[-1] != row.numel():
        raise PackingUnsupported(
            f"{CU_SEQLENS_KWARG} {edges[:8]} disagrees with the row: text positions restart at {starts[:8]}, "
            f"{row.numel()} tokens"
        )


def _text_model(model: torch.nn.Module, layers: list[torch.nn.Module]) -> torch.nn.Module:
    """The module whose ``layers`` hold the Gated DeltaNet layers (transformers' ``*TextModel``)."""
    wanted = {id(layer) for layer in layers}
    for module in model.modules():
        stack = getattr(module, "layers", None)
        if isinstance(stack, torch.nn.ModuleList) and any(id(m) in wanted for m in stack.modules()):
            return module
    raise PackingUnsupported(f"{type(model).__name__}: no decoder stack holds its linear-attention layers")


def prepare_linear_attention(model: torch.nn.Module, path: str | None = None) -> str | None:
    """Install the packed linear-attention forward on every Gated DeltaNet layer; returns the path.

    Idempotent. The model is unchanged otherwise: calls without :data:`CU_SEQLENS_KWARG` run
    transformers' own forward (one sample per row). A model call whose text position ids restart
    inside the row must pass it (``model.model(..., mmref_cu_seqlens=cu_seqlens)``, int
    ``[num_samples + 1]`` as :func:`trainer_lib.positions.cu_seqlens` builds it) and raises
    :class:`~trainer_lib.packed_call.PackingUnsupported` without it. Stays installed (through backward
    and gradient-checkpoint recomputation too) until :func:`remove_linear_attention`; bound
    methods, so ``copy.deepcopy`` of the model keeps it.

    Args:
        path: see :func:`select_linear_attention_path`.

    Returns:
        ``"per_segment_torch"`` / ``"fla_varlen"``, or None for a model without linear attention.

    Raises:
        PackingUnsupported, ValueError: see :func:`select_linear_attention_path`.
        ImportError: ``"fla_varlen"`` and ``fla`` lacks the varlen entry points used here.
    """
    chosen = select_linear_attention_path(model, path)
    if chosen is None:
        return None
    layers = linear_attention_layers(model)
    remove_linear_attention(model)
    for layer in layers:
        _kernels(type(layer), chosen)  # import errors surface here, not in the first forward
        setattr(layer, _INSTALLED, chosen)
        layer.forward = types.MethodType(_packed_forward, layer)
    text_model = _text_model(model, layers)
    setattr(text_model, _HOOK, text_model.register_forward_pre_hook(_check_packed_call, with_kwargs=True))
    return chosen


def remove_linear_attention(model: torch.nn.Module) -> None:
    """Undo :func:`prepare_linear_attention` (transformers' forward again; no-op if not installed)."""
    for module in model.modules():
        if hasattr(module, _INSTALLED):
            del module.forward
            delattr(module, _INSTALLED)
        hook = getattr(module, _HOOK, None)
        if hook is not None:
            hook.remove()
            delattr(module, _HOOK)
