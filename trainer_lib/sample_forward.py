"""Per-sample logprobs of a list of samples through the packed forward: what a framework's loss
needs when its batch is rows, not packs (TRL's ``[B, C]`` completion logprobs, verl's ``[B, R]``).

:func:`sample_logprobs` packs the samples (:func:`~trainer_lib.pack_samples`), materializes each
micro-batch's images from their refs (each distinct image decoded once for the call), runs
:func:`~trainer_lib.packed_logprobs` on each and cuts the result back into one slice per sample, in
input order. Gradients flow when enabled (the slices are views of each micro-batch's result);
:func:`~trainer_lib.recompute_logprobs` is this under ``torch.no_grad`` for the mismatch check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.structs import TrainingSample
from trainer_lib.config import MaterializeConfig
from trainer_lib.forward import check_temperature, packed_logprobs
from trainer_lib.materialize import MaterializeStats, Resolved, materialize_micro_batch
from trainer_lib.model_inputs import packed_inputs
from trainer_lib.planning.packing import pack_samples
from trainer_lib.spec import PackingSpec

__all__ = ["LogprobOptions", "SampleForward", "SampleLogprobs", "sample_logprobs"]


@dataclass(frozen=True, kw_only=True)
class LogprobOptions:
    """How :func:`sample_logprobs` (and :func:`~trainer_lib.recompute_logprobs`, verl's and TRL's
    integrations) run the packed forward: the packing cap and the logprob head's options.

    Example: the rows of a ``processed_logprobs`` server sampled at 0.7, with entropies::

        LogprobOptions(seq_len=4096, temperature=0.7, compute_entropy=True)

    Raises:
        ValueError: ``temperature`` not finite and > 0
            (:func:`~trainer_lib.forward.check_temperature`; for greedy samples, 0.0, pass 1.0),
            at construction: before any work.
    """

    seq_len: int
    """The packing cap's sequence length (:func:`~trainer_lib.pack_samples`)."""
    micro_batch_max_tokens: int | None = None
    """Tokens per micro-batch, at most ``seq_len``; None: ``seq_len``."""
    temperature: float = 1.0
    """The sampling temperature against a ``processed_logprobs`` server; 1.0 for vLLM's default
    ``raw_logprobs`` (:func:`~trainer_lib.packed_logprobs`)."""
    suppressed_token_ids: Sequence[int] = ()
    """The ids the sampler never drew (``client.suppressed_token_ids()``), out of the softmax as
    on the server."""
    compute_entropy: bool = False
    """Also return each position's entropy (:class:`SampleLogprobs`; the head computes it either
    way, an unused one costs no backward work). :func:`~trainer_lib.recompute_logprobs` returns
    none."""

    def __post_init__(self) -> None:
        check_temperature(self.temperature)


@dataclass(frozen=True)
class SampleLogprobs:
    """One sample's slice of its micro-batch's :class:`~trainer_lib.ForwardResult` (``n`` tokens,
    on the model's device)."""

    logprobs: torch.Tensor
    """float32 ``[n]``: ``logprobs[t]`` = the trainer's logprob of ``input_ids[t]`` given the
    sample's earlier tokens (temperature-scaled, suppressed ids out of the softmax); 0 at ``t = 0``.
    Aligned with ``TrainingSample.inference_logprobs``. Carries gradients when they are enabled."""
    loss_mask: torch.Tensor
    """bool ``[n]``: the sample's loss mask, all False where one of its images was replaced by
    zero features (``placeholder_zero_loss``); never True at ``t = 0``."""
    entropy: torch.Tensor | None = None
    """float32 ``[n]`` with ``compute_entropy``: the entropy of each position's distribution
    (:attr:`~trainer_lib.ForwardResult.entropy`); None otherwise."""


@dataclass(frozen=True)
class SampleForward:
    """What :func:`sample_logprobs` returns."""

    samples: list[SampleLogprobs]
    """One per input sample, input order."""
    stats: MaterializeStats
    """Summed over the micro-batches (``placeholders``, ``zeroed_samples``, ``failed_by_code``...)."""
    zeroed: list[int]
    """Indices of the samples whose loss was zeroed here (an image missing or unreadable)."""
    micro_batches: int
    pixel_bytes: int = 0
    """Bytes of the image features the forward was given (``pixel_values``, each distinct image
    of a micro-batch once), summed over the micro-batches."""


def sample_logprobs(
    samples: Sequence[TrainingSample],
    model: torch.nn.Module,
    spec: PackingSpec,
    config: MaterializeConfig,
    options: LogprobOptions,
    *,
    resolved: Resolved | None = None,
) -> SampleForward:
    """Pack, materialize, run the packed forward; one :class:`SampleLogprobs` per sample.

    Args:
        samples: the rows, any order (samples sharing an image are packed together where the cap
            allows: one vision-tower run per distinct image per micro-batch).
        model: prepared (:func:`~trainer_lib.prepare_model_for_packing`).
        spec: the family's facts (``PackingSpec.from_adapter``); no pad is made here.
        config: the materialize settings (asset roots, ``missing_policy``, workers, limits).
        options: the packing cap and the head's options (:class:`LogprobOptions`: temperature,
            suppressed ids, entropy), as :func:`~trainer_lib.packed_logprobs` takes them.
        resolved: one dict shared by the calls of one step (:data:`~trainer_lib.materialize.Resolved`):
            each distinct image decoded once per step; default one for this call.

    Raises:
        MMRefError subclasses, PlaceholderMismatch, PackingUnsupported: see the stages.
    """
    cap = {"seq_len": options.seq_len, "micro_batch_max_tokens": options.micro_batch_max_tokens}
    step = pack_samples(samples, spec, **cap)
    out: list[SampleLogprobs | None] = [None] * len(samples)
    stats, pixel_bytes = MaterializeStats(), 0
    resolved = {} if resolved is None else resolved
    for packed in step.micro_batches:
        m = materialize_micro_batch(packed, spec, config, resolved=resolved)
        _add_stats(stats, m.stats)
        pixels = m.features.get("pixel_values")
        pixel_bytes += 0 if pixels is None else pixels.numel() * pixels.element_size()
        inputs = packed_inputs(
            m.packed, m.features, model, spec, image_index=m.image_index, video_index=m.video_index
        )
        head = {"temperature": options.temperature, "suppressed_token_ids": options.suppressed_token_ids}
        result = packed_logprobs(model, inputs, **head)
        for slot in m.packed.slots:
            if slot.sample_index is None or slot.is_padding:
                continue
            span = slice(slot.start, slot.start + slot.length)
            entropy = result.entropy[span] if options.compute_entropy else None
            out[slot.sample_index] = SampleLogprobs(result.logprobs[span], result.loss_mask[span], entropy)
    missing = [i for i, o in enumerate(out) if o is None]
    if missing:
        raise RuntimeError(f"samples {missing} were not in any micro-batch")
    rows = [o for o in out if o is not None]
    zeroed = [
        i
        for i, (s, r) in enumerate(zip(samples, rows, strict=True))
        if any(s.loss_mask) and not r.loss_mask.any()
    ]
    return SampleForward(rows, stats, zeroed, len(step.micro_batches), pixel_bytes)


def _add_stats(total: MaterializeStats, part: MaterializeStats) -> None:
    """Add ``part``'s counts into ``total`` (``failed_by_code`` merged by code)."""
    for f in dataclasses.fields(MaterializeStats):
        if f.name == "failed_by_code":
            for code, n in part.failed_by_code.items():
                total.failed_by_code[code] = total.failed_by_code.get(code, 0) + n
        else:
            setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
