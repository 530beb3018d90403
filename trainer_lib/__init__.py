"""Trainer-side library: rematerialize features from refs, pack micro-batches, run the packed forward.

- :func:`materialize` — features from refs (:mod:`trainer_lib.materialize`).
- :func:`pack_samples`, :func:`check_placeholder_alignment`, :func:`rebuild_micro_batch` — micro-batches
  (:mod:`trainer_lib.packing`).
- :func:`plan_step`, :func:`pad_samples`, :func:`balance_micro_batches` — padding and dp balance
  (:mod:`trainer_lib.padding`).
- :func:`build_position_ids`, :func:`cu_seqlens` — MRoPE / 1D positions (:mod:`trainer_lib.positions`).
- :func:`packed_logprobs` and friends — the packed forward (:mod:`trainer_lib.forward`).
- :func:`fail_fast`, :func:`check_all_ranks` — rank-wide errors (:mod:`trainer_lib.distributed`).
- :func:`recompute_logprobs`, :func:`logprob_mismatch` — trainer vs inference (:mod:`trainer_lib.mismatch`).
- :class:`MaterializeConfig` — ``MMREF_*`` settings (:mod:`trainer_lib.config`).
"""

from protocol.placeholders import locate_image_runs
from trainer_lib.config import MaterializeConfig
from trainer_lib.distributed import RankFailed, check_all_ranks, fail_fast
from trainer_lib.forward import (
    VARLEN_ATTENTION,
    ForwardResult,
    MaterializedMicroBatch,
    PackedInputs,
    PackingUnsupported,
    check_packable,
    materialize_micro_batch,
    packed_inputs,
    packed_logprobs,
    prepare_model_for_packing,
    register_varlen_attention,
    select_backend,
)
from trainer_lib.materialize import MaterializedBatch, MaterializeStats, materialize
from trainer_lib.mismatch import MismatchStats, logprob_mismatch, recompute_logprobs
from trainer_lib.packing import (
    ImageSpan,
    PackedMicroBatch,
    PackedStep,
    PackEntry,
    SampleSlot,
    check_placeholder_alignment,
    pack_samples,
    rebuild_micro_batch,
)
from trainer_lib.padding import (
    StepPlan,
    balance_micro_batches,
    make_pad_sample,
    pad_samples,
    padded_sample_count,
    plan_step,
    split_micro_batches,
)
from trainer_lib.positions import build_position_ids, cu_seqlens, mrope_position_ids, text_position_ids

__all__ = [
    "VARLEN_ATTENTION",
    "ForwardResult",
    "ImageSpan",
    "MaterializeConfig",
    "MaterializeStats",
    "MaterializedBatch",
    "MaterializedMicroBatch",
    "MismatchStats",
    "PackEntry",
    "PackedInputs",
    "PackedMicroBatch",
    "PackedStep",
    "PackingUnsupported",
    "RankFailed",
    "SampleSlot",
    "StepPlan",
    "balance_micro_batches",
    "build_position_ids",
    "check_all_ranks",
    "check_packable",
    "check_placeholder_alignment",
    "cu_seqlens",
    "fail_fast",
    "locate_image_runs",
    "logprob_mismatch",
    "make_pad_sample",
    "materialize",
    "materialize_micro_batch",
    "mrope_position_ids",
    "pack_samples",
    "packed_inputs",
    "packed_logprobs",
    "pad_samples",
    "padded_sample_count",
    "plan_step",
    "prepare_model_for_packing",
    "rebuild_micro_batch",
    "recompute_logprobs",
    "register_varlen_attention",
    "select_backend",
    "split_micro_batches",
    "text_position_ids",
]
