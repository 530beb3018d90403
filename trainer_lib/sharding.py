"""The packed forward under PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``; docs/PACKING.md §10).

:func:`shard_model` is ``fully_shard`` applied the way the packed forward needs it, three things a
bare ``fully_shard(model)`` does not give:

1. **Units**: each language decoder layer and each vision block is its own FSDP unit (gathered
   around its own forward, freed after it, and again in the backward: with activation
   checkpointing, once more for the recomputation); the root unit holds the rest (embeddings, the
   LM head, norms, the vision patch embedding and merger). Shared (tied) parameters stay in the
   root, as FSDP2 requires.
2. **The root's forward**: :func:`~trainer_lib.packed_logprobs` does not call ``model.forward``
   (that would build ``[L, vocab]`` logits); it calls ``model.model`` and the chunked LM head. The
   body runs as a method registered with ``register_fsdp_forward_method``, so the root's
   parameters (the LM head's weight) are gathered around it and its gradients reduce-scattered
   after the backward.
3. **Summed gradients**: FSDP2 averages gradients over ranks by default; the trainer's loss is
   already normalised by the mini-batch's loss tokens over *all* ranks
   (``StepPlan.num_loss_tokens_per_mini_batch``), so the ranks' gradients must be summed
   (``set_gradient_divide_factor(1.0)`` on every unit, with ``set_force_sum_reduction_for_comms``:
   a plain SUM, which gloo also has): the sharded step then equals one process running every
   rank's micro-batches (``tests/test_fsdp.py``).

Every rank runs the same micro-batch count and the vision tower in the same slots: that is what
``plan_step`` plans (docs/PACKING.md §3.1); a rank skipping a unit's forward would leave the
others waiting in its all-gather.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from trainer_lib.forward import packed_forward_tensors
from trainer_lib.packed_call import FSDP_FORWARD_METHOD

__all__ = ["shard_model", "sharded_units"]

_UNIT_SUFFIXES = ("DecoderLayer", "VisionBlock")
"""transformers' class names of the repeated blocks (``Qwen2VLDecoderLayer``,
``Qwen3VLTextDecoderLayer``, ``Qwen3_5DecoderLayer``, ``Qwen2VLVisionBlock``, ...): the modules
its gradient checkpointing wraps too."""


def sharded_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The language decoder layers and vision blocks of ``model``, in module order.

    Raises:
        ValueError: none found (not a transformers decoder this module knows).
    """
    units = [m for m in model.modules() if type(m).__name__.endswith(_UNIT_SUFFIXES)]
    if not units:
        raise ValueError(f"{type(model).__name__}: no decoder layers or vision blocks to shard")
    return units


def _packed_forward_method(self: torch.nn.Module, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The root's registered forward method: the body of :func:`~trainer_lib.packed_logprobs`."""
    return packed_forward_tensors(self, *args)


def shard_model(
    model: torch.nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 for the packed forward (see the module docstring); returns it.

    Call after :func:`~trainer_lib.prepare_model_for_packing` (the attention backend, the
    linear-attention path and activation checkpointing are set on the unsharded modules) and
    after ``torch.distributed.init_process_group``; build the optimizer over ``model.parameters()``
    afterwards (they are sharded ``DTensor`` s then). :func:`~trainer_lib.packed_logprobs` runs
    the model as before.

    Args:
        mesh: a 1-D ``DeviceMesh`` (default: FSDP2's, over the world on the current device
            type: ``init_device_mesh("cuda", (world,))``, or ``"cpu"`` with gloo).
        reshard_after_forward: passed to every unit's ``fully_shard`` (True: ZeRO-3, parameters
            gathered again for the backward).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy`` (default: parameters and reductions in the
            model's dtype).

    Raises:
        ValueError: no decoder layers or vision blocks found (:func:`sharded_units`).
        RuntimeError: from ``fully_shard``: no process group, or a model sharded already.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy if mp_policy is not None else MixedPrecisionPolicy(),
    }
    units = sharded_units(model)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    setattr(model, FSDP_FORWARD_METHOD, types.MethodType(_packed_forward_method, model))
    register_fsdp_forward_method(model, FSDP_FORWARD_METHOD)
    for unit in (*units, model):
        unit.set_gradient_divide_factor(1.0)  # the loss is normalised over all ranks: sum
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model
