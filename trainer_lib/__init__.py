"""Trainer-side library: rematerialize features from refs, pack micro-batches, run the packed forward.

One module per stage, in data order (docs/ARCHITECTURE.md):

- :func:`materialize`, :func:`materialize_micro_batch` — features from refs (:mod:`trainer_lib.materialize`;
  the slots filled in :mod:`trainer_lib.assemble`), read as a :class:`MaterializeOptions` says.
- :class:`PackedMicroBatch`, :class:`PackedBatch` — the packed micro-batch (:mod:`trainer_lib.micro_batch`).
- :func:`pack_samples`, :func:`rebuild_micro_batch` — micro-batches (:mod:`trainer_lib.planning.packing`,
  bins in :mod:`trainer_lib.planning.bins`).
- :class:`PackingSpec` — the model family's packing facts, passed to every stage below
  (:mod:`trainer_lib.spec`).
- :func:`make_pad_sample`, :func:`padded_sample_count` — padding samples
  (:mod:`trainer_lib.planning.padding`).
- :func:`partition_mini_batch` — balanced data-parallel slots of a :class:`MiniBatchItems` (one
  mini-batch's samples and rules, :mod:`trainer_lib.planning.items`) (:mod:`trainer_lib.planning.partition`;
  the bound in :mod:`trainer_lib.planning.slot_bound`, tighter packings where first fit misses the bound in
  :mod:`trainer_lib.planning.repack`).
- :class:`CostModel` — FLOPs per sample, the predicted sync idle (:mod:`trainer_lib.planning.cost`).
- :class:`Refinement` — the opt-in search for a shorter predicted step, within ``plan_time_budget_s``
  seconds per mini-batch (:mod:`trainer_lib.planning.refine`).
- :func:`deal_mini_batch`, :class:`StepShape` — one mini-batch as every rank's micro-batches, the
  step's sizes (:mod:`trainer_lib.planning.ranks`).
- :func:`plan_step`, :class:`StepPlan`, :class:`RankLoad` — a whole step (:mod:`trainer_lib.planning.plan`).
- :func:`plan_ahead` — step ``t + 1`` planned on a background thread while step ``t`` runs
  (:mod:`trainer_lib.planning.ahead`).
- :func:`build_position_ids`, :func:`cu_seqlens` — MRoPE positions, sample boundaries
  (:mod:`trainer_lib.positions`).
- :func:`packed_inputs`, :func:`check_placeholders_match_features` — model inputs and the tripwire
  (:mod:`trainer_lib.model_inputs`).
- :func:`prepare_model_for_packing`, :func:`check_packable` — which attention backends and
  linear-attention paths keep samples apart (:mod:`trainer_lib.prepare`), installing the varlen
  kernel (:mod:`trainer_lib.attention`) and, for hybrid models, the Gated DeltaNet path
  (:mod:`trainer_lib.linear_attention`, :func:`linear_attention_path` reports it);
  :class:`PackingUnsupported` and the model-call keywords in :mod:`trainer_lib.packed_call`.
- :func:`packed_logprobs` — the packed forward, suppressed ids out of its softmax
  (:mod:`trainer_lib.forward`; its LM head, logprobs and entropy without ``[L, vocab]`` logits
  kept: :mod:`trainer_lib.logprob_head`).
- :func:`fail_fast`, :func:`check_all_ranks` — rank-wide errors (:mod:`trainer_lib.distributed`).
- :func:`sample_logprobs`, :class:`LogprobOptions` — per-sample logprobs of rows through the packed
  forward, with gradients; its cap and head options (:mod:`trainer_lib.sample_forward`: a
  framework's row batch).
- :func:`shard_model` — the packed forward under FSDP2 (:mod:`trainer_lib.sharding`).
- :func:`recompute_logprobs`, :func:`logprob_mismatch`, :func:`check_sampling_temperature` — trainer vs
  inference (:mod:`trainer_lib.mismatch`).
- :class:`MaterializeConfig` — ``MMREF_*`` settings, giving ``materialize``'s source and
  :class:`MaterializeOptions` (:mod:`trainer_lib.config`).
"""

from protocol.placeholders import locate_image_runs, locate_video_runs
from trainer_lib.attention import VARLEN_ATTENTION, register_varlen_attention
from trainer_lib.config import MaterializeConfig, MaterializeOptions
from trainer_lib.distributed import RankFailed, check_all_ranks, fail_fast
from trainer_lib.forward import SUPPRESSED_LOGIT, ForwardResult, packed_logprobs
from trainer_lib.linear_attention import linear_attention_path
from trainer_lib.materialize import (
    MaterializedBatch,
    MaterializedMicroBatch,
    MaterializeStats,
    materialize,
    materialize_micro_batch,
)
from trainer_lib.micro_batch import ImageSpan, PackedBatch, PackedMicroBatch, SampleSlot
from trainer_lib.mismatch import (
    BF16_NOISE_FACTOR,
    MismatchStats,
    check_sampling_temperature,
    logprob_mismatch,
    recompute_logprobs,
)
from trainer_lib.model_inputs import PackedInputs, check_placeholders_match_features, packed_inputs
from trainer_lib.packed_call import CU_SEQLENS_KWARG, PackingUnsupported
from trainer_lib.planning.ahead import plan_ahead
from trainer_lib.planning.cost import CostModel
from trainer_lib.planning.items import MiniBatchItems
from trainer_lib.planning.packing import PackEntry, pack_samples, rebuild_micro_batch
from trainer_lib.planning.padding import make_pad_sample, padded_sample_count
from trainer_lib.planning.partition import partition_mini_batch
from trainer_lib.planning.plan import RankLoad, StepPlan, plan_step
from trainer_lib.planning.ranks import StepShape, deal_mini_batch
from trainer_lib.planning.refine import Refinement
from trainer_lib.positions import build_position_ids, cu_seqlens, mrope_position_ids
from trainer_lib.prepare import check_packable, prepare_model_for_packing, select_backend
from trainer_lib.sample_forward import LogprobOptions, SampleForward, SampleLogprobs, sample_logprobs
from trainer_lib.sharding import shard_model
from trainer_lib.spec import PackingSpec

__all__ = [
    "BF16_NOISE_FACTOR",
    "CU_SEQLENS_KWARG",
    "SUPPRESSED_LOGIT",
    "VARLEN_ATTENTION",
    "CostModel",
    "ForwardResult",
    "ImageSpan",
    "LogprobOptions",
    "MaterializeConfig",
    "MaterializeOptions",
    "MaterializeStats",
    "MaterializedBatch",
    "MaterializedMicroBatch",
    "MiniBatchItems",
    "MismatchStats",
    "PackEntry",
    "PackedBatch",
    "PackedInputs",
    "PackedMicroBatch",
    "PackingSpec",
    "PackingUnsupported",
    "RankFailed",
    "RankLoad",
    "Refinement",
    "SampleForward",
    "SampleLogprobs",
    "SampleSlot",
    "StepPlan",
    "StepShape",
    "build_position_ids",
    "check_all_ranks",
    "check_packable",
    "check_placeholders_match_features",
    "check_sampling_temperature",
    "cu_seqlens",
    "deal_mini_batch",
    "fail_fast",
    "linear_attention_path",
    "locate_image_runs",
    "locate_video_runs",
    "logprob_mismatch",
    "make_pad_sample",
    "materialize",
    "materialize_micro_batch",
    "mrope_position_ids",
    "pack_samples",
    "packed_inputs",
    "packed_logprobs",
    "padded_sample_count",
    "partition_mini_batch",
    "plan_ahead",
    "plan_step",
    "prepare_model_for_packing",
    "rebuild_micro_batch",
    "recompute_logprobs",
    "register_varlen_attention",
    "sample_logprobs",
    "select_backend",
    "shard_model",
]
