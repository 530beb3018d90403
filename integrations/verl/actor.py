"""verl's actor log-probs from the rows' refs (verl/workers/engine/fsdp/transformer_impl.py, 0.9.1).

:class:`MMRefFSDPEngine` is verl's ``FSDPEngineWithLMHead`` (line 1144) whose ``forward_step``
(line 1549) computes ``model_output["log_probs"/"entropy"]`` with :func:`mmref_model_output`
(:func:`trainer_lib.sample_logprobs`: materialize with dedup, the packed forward, temperature, the
suppressed placeholder) instead of the model's forward over ``multi_modal_inputs``; verl's loss
then runs unchanged. It is registered for vendor ``"mmref"``: ``VERL_ENGINE_VENDOR=mmref`` selects
it (``EngineRegistry.get_engine_cls``, verl/workers/engine/base.py:399), for the actor and the
reference model alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from verl.utils.device import get_device_id, get_device_name
from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from integrations.verl.rollout import SAMPLE_FIELD
from protocol.adapters import load_adapter
from protocol.structs import TrainingSample, decode_sample
from trainer_lib import (
    LogprobOptions,
    MaterializeConfig,
    PackingSpec,
    SampleForward,
    prepare_model_for_packing,
)
from trainer_lib import sample_logprobs as packed_rows

__all__ = ["MMRefActorForward", "MMRefFSDPEngine", "mmref_model_output", "rows_of", "zero_rows"]


def rows_of(batch: Any) -> list[TrainingSample]:
    """The rows' samples of a verl batch: ``batch[SAMPLE_FIELD]`` (the v0 trainer's column, a
    ``NonTensorStack`` once ``DataProto.to_tensordict`` ran, or a numpy object array) or each row's
    ``extra_fields`` dict (the v1 trainer's TransferQueue field).

    Raises:
        KeyError: the batch has no mmref samples (its rows were not sampled by :class:`MMRefAgentLoop`).
    """
    keys = batch.keys()
    if SAMPLE_FIELD in keys:
        column = batch[SAMPLE_FIELD]
    elif "extra_fields" in keys:
        column = [extra[SAMPLE_FIELD] for extra in _items(batch["extra_fields"])]
    else:
        raise KeyError(f"no {SAMPLE_FIELD!r} column: were the rows sampled by the 'mmref' agent loop?")
    return [decode_sample(bytes(b)) for b in _items(column)]


def _items(column: Any) -> list:
    tolist = getattr(column, "tolist", None)
    return list(tolist() if tolist is not None else column)


class MMRefActorForward:
    """What :class:`MMRefFSDPEngine` runs instead of the model's own forward (one per engine).

    Args:
        model_dir: the model's folder (its adapter and placeholder id).
        seq_len: the packed forward's token cap (default: verl's ``max_token_len_per_gpu``; a
            longer row gets its own micro-batch).
        config: materialize settings (default ``MaterializeConfig()``: the ``MMREF_*`` variables).
    """

    def __init__(
        self, model_dir: str | Path, *, seq_len: int = 8192, config: MaterializeConfig | None = None
    ):
        from transformers import AutoConfig

        self.adapter = load_adapter(model_dir)
        self.placeholder = self.adapter.placeholder_token_id(AutoConfig.from_pretrained(model_dir))
        self.seq_len = seq_len
        self.config = config or MaterializeConfig()
        self._specs: dict[int, PackingSpec] = {}

    def __call__(
        self, model: torch.nn.Module, micro_batch: Any, *, entropy: bool = False
    ) -> tuple[dict[str, torch.Tensor], SampleForward]:
        """verl's ``model_output`` of a micro-batch and the forward's report (see
        :func:`mmref_model_output`)."""
        inner = getattr(model, "_fsdp_wrapped_module", model)
        if id(inner) not in self._specs:
            prepare_model_for_packing(inner)
            self._specs[id(inner)] = PackingSpec.from_adapter(self.adapter, inner, pad_token_id=0)
        return mmref_model_output(
            rows_of(micro_batch),
            micro_batch["input_ids"],
            model,
            self._specs[id(inner)],
            self.config,
            LogprobOptions(
                seq_len=self.seq_len,
                temperature=_one_temperature(micro_batch["temperature"]),
                suppressed_token_ids=(self.placeholder,),
                compute_entropy=entropy,
            ),
        )

    def step(
        self, model: torch.nn.Module, micro_batch: Any, loss_function: Any, dp_group: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """What verl's ``forward_step`` returns (transformer_impl.py:1549) for one micro-batch: the
        loss of ``loss_function`` (verl's ``ppo_loss``...) over :func:`mmref_model_output`, rows
        whose image went missing since the rollout with ``response_mask``/``loss_mask`` zeroed
        (``placeholder_zero_loss``: their loss only), and ``{"model_output", "loss", "metrics"}``.

        Raises:
            ValueError: top-K distillation asked for.
        """
        from verl.utils import tensordict_utils as tu
        from verl.workers.engine.utils import detach_tree

        if tu.get_non_tensor_data(micro_batch, "distillation_use_topk", False):
            raise ValueError("mmref's forward does not support top-K distillation")
        entropy = bool(tu.get_non_tensor_data(micro_batch, "calculate_entropy", False))
        model_output, forward = self(model, micro_batch, entropy=entropy)
        for key in ("response_mask", "loss_mask"):
            if forward.zeroed and key in micro_batch.keys():
                micro_batch[key] = zero_rows(micro_batch[key], forward.zeroed)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=dp_group)
        else:
            loss, metrics = torch.tensor(1.0), {}
        metrics = {
            **metrics,
            "mmref/zeroed_rows": len(forward.zeroed),
            "mmref/pixel_bytes": forward.pixel_bytes,
        }
        output = {"model_output": detach_tree(model_output), "loss": float(loss.detach()), "metrics": metrics}
        return loss, output


def mmref_model_output(
    rows: Sequence[TrainingSample],
    input_ids: torch.Tensor,
    model: torch.nn.Module,
    spec: PackingSpec,
    config: MaterializeConfig,
    options: LogprobOptions,
) -> tuple[dict[str, torch.Tensor], SampleForward]:
    """The rows through :func:`trainer_lib.sample_logprobs`, in the layout of verl's
    ``prepare_model_outputs`` (transformer_impl.py:1332, ``use_remove_padding``): ``log_probs`` (and
    ``entropy``) float32 jagged nested tensors ``[B, L_b]`` over each row's whole sequence, entry
    ``t`` the logprob of token ``t + 1`` (verl's rolled labels) and the entropy of the distribution
    it was drawn from; the last entry 0; gradients kept.
    verl's ``no_padding_2_padding`` cuts them to ``[B, response_length]``.

    Args:
        rows: the batch's samples (:func:`rows_of`), in its row order.
        input_ids: verl's jagged nested ``[B, L_b]`` ids; each row's must be its sample's.
        options: the packed forward's cap and head (:class:`trainer_lib.LogprobOptions`); the cap
            is raised to the longest row where that is longer (a row longer than verl's
            ``max_token_len_per_gpu`` gets its own micro-batch); ``compute_entropy``: ``entropy``
            too.

    Raises:
        RuntimeError: a row's ids are not its sample's (the batch was reordered without them).
    """
    ids = input_ids.unbind() if input_ids.is_nested else list(input_ids)
    if len(ids) != len(rows):
        raise RuntimeError(f"{len(ids)} rows in verl's batch, {len(rows)} mmref samples")
    for b, (row, seq) in enumerate(zip(rows, ids, strict=True)):
        if seq.tolist() != row.input_ids:
            raise RuntimeError(f"row {b}: verl's input_ids are not its mmref sample's")
    longest = max(len(r.input_ids) for r in rows)
    options = dataclasses.replace(options, seq_len=max(options.seq_len, longest))
    forward = packed_rows(rows, model, spec, config, options)
    offsets = torch.tensor([0, *torch.tensor([len(r.input_ids) for r in rows]).cumsum(0).tolist()])

    def jagged(values: list[torch.Tensor]) -> torch.Tensor:
        """Each row's ``[n]`` values (entry t about token t) left-shifted by one (about token t + 1)."""
        flat = torch.cat([torch.cat([v[1:], v.new_zeros(1)]) for v in values]).float()
        return torch.nested.nested_tensor_from_jagged(flat, offsets.to(flat.device))

    out = {"log_probs": jagged([s.logprobs for s in forward.samples])}
    if options.compute_entropy:
        out["entropy"] = jagged([s.entropy for s in forward.samples])
    return out, forward


def _one_temperature(value: Any) -> float:
    """verl's micro-batch temperature (a number, or one per row that must all agree)."""
    if isinstance(value, torch.Tensor):
        values = set(value.flatten().tolist())
        if len(values) != 1:
            raise ValueError(f"per-row temperatures {sorted(values)}: mmref's packed forward takes one")
        return float(values.pop())
    return float(value)


def zero_rows(mask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``mask`` (padded ``[B, R]`` or jagged nested) with rows ``rows`` set to 0."""
    if not rows:
        return mask
    if not mask.is_nested:
        out = mask.clone()
        out[list(rows)] = 0
        return out
    values, offsets = mask.values().clone(), mask.offsets()
    for r in rows:
        values[offsets[r] : offsets[r + 1]] = 0
    return torch.nested.nested_tensor_from_jagged(values, offsets)


_ENGINE_DEVICES = ("cuda", "npu", "cpu")


def _engine_slot(cls: type) -> type:
    """Register ``cls`` for vendor ``"mmref"`` (a reload of this module replaces the earlier class:
    verl's registry refuses a key twice)."""
    table = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        for device in _ENGINE_DEVICES:
            table.get(backend, {}).pop((device, "mmref"), None)
    register_engine = EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device=list(_ENGINE_DEVICES), vendor="mmref"
    )
    return register_engine(cls)


@_engine_slot
class MMRefFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP language-model engine with :meth:`forward_step` computing the log-probs from the
    rows' refs (module docstring). Not supported: Ulysses sequence parallelism, fused kernels and
    top-K distillation (refused at the first step)."""

    def forward_step(
        self, micro_batch: Any, loss_function: Any, forward_only: bool
    ) -> tuple[torch.Tensor, dict]:
        from verl.utils import tensordict_utils as tu

        if self.use_ulysses_sp or tu.get_non_tensor_data(micro_batch, "use_fused_kernels", False):
            raise ValueError(
                "mmref's forward supports neither Ulysses sequence parallelism nor fused kernels"
            )
        if not hasattr(self, "mmref_forward"):
            cap = self.engine_config.max_token_len_per_gpu or 8192
            self.mmref_forward = MMRefActorForward(self.model_config.local_path, seq_len=cap)
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        with torch.autocast(device_type=get_device_name(), dtype=dtype, enabled=dtype != torch.float32):
            return self.mmref_forward.step(
                self.module, micro_batch.to(get_device_id()), loss_function, self.get_data_parallel_group()
            )
