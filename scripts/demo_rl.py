"""The RL step of the demo (scripts/demo.py): a GRPO-style update and its control (the rollouts
themselves come from ``rollout_client``: one group per prompt, the image placeholder
suppressed by the sampler, so no completion has to be redrawn).

- :func:`grpo_advantages`: group-normalized rewards, GRPO's outcome advantages (Shao et al. 2024,
  "DeepSeekMath", §4.1.2: ``(r - mean(group)) / std(group)``).
- :func:`train_step`: ``plan_step`` -> ``materialize_micro_batch`` -> ``packed_inputs`` ->
  ``packed_logprobs`` with gradients -> the clipped surrogate of PPO (Schulman et al. 2017, eq. 7)
  per token, the ratio taken against the server's logprobs (the behaviour policy), averaged over
  the step's loss tokens -> one optimizer step. Before the step it measures the server-vs-trainer
  mismatch on the same forward: the server held the weights the trainer holds, so it must be at
  the fresh-server level.
- :func:`previous_weights_mismatch`: the control of that measure: the same rollouts recomputed
  under the weights before the latest push (what a server that missed the push would serve). It
  must be far above the bound, or the measure could not tell the two weight sets apart.
"""

from __future__ import annotations

import base64
import copy
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import skimage.data
import torch
from PIL import Image

from protocol.refs import file_uri_to_path, parse_ref
from protocol.structs import RawMMRef, TrainingSample
from trainer_lib import (
    BF16_NOISE_FACTOR,
    LogprobOptions,
    MaterializeConfig,
    PackingSpec,
    StepShape,
    logprob_mismatch,
    materialize_micro_batch,
    packed_inputs,
    packed_logprobs,
    plan_step,
    recompute_logprobs,
)
from trainer_lib.mismatch import MismatchStats

__all__ = [
    "StepResult",
    "data_url",
    "grpo_advantages",
    "jpeg",
    "mismatch_bound",
    "previous_weights_mismatch",
    "train_step",
]

CLIP = 0.2
"""PPO's clip range."""


def grpo_advantages(samples: list[TrainingSample], rewards: list[float], group: int) -> list[TrainingSample]:
    """Each sample's reward, normalized within its group of ``group`` consecutive samples, on its
    completion tokens (0 on the prompt). A group whose rewards are all equal gets 0 (no signal)."""
    out = []
    for g in range(0, len(samples), group):
        r = torch.tensor(rewards[g : g + group], dtype=torch.float64)
        adv = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
        for s, a in zip(samples[g : g + group], adv, strict=True):
            out.append(msgspec.structs.replace(s, advantages=[a if m else 0.0 for m in s.loss_mask]))
    return out


@dataclass(frozen=True)
class StepResult:
    mismatch: MismatchStats
    """Server vs trainer on the step's rollouts, before the optimizer step."""
    loss: float
    micro_batches: int
    seconds: float


def train_step(
    model,
    optimizer,
    samples: list[TrainingSample],
    spec: PackingSpec,
    config: MaterializeConfig,
    suppressed: Sequence[int] = (),
) -> StepResult:
    """One optimizer step of the GRPO-style objective over ``samples`` (see the module doc);
    ``suppressed``: the token ids the sampler never drew, out of the trainer's softmax too."""
    t0 = time.monotonic()
    plan = plan_step(samples, spec, StepShape(dp_size=1, mini_batch_size=len(samples), seq_len=2048))
    (ranks,) = plan.mini_batches  # one mini-batch: one optimizer step
    resolved: dict = {}  # each distinct image decoded once per step, encoded once per micro-batch
    batches = [materialize_micro_batch(p, spec, config, resolved=resolved) for p in ranks[0].micro_batches]
    # the loss tokens left after materializing (a missing image zeroes its sample's loss under the
    # default policy); with several ranks, all-reduce this sum
    normalizer = max(1, sum(m.packed.num_loss_tokens for m in batches))
    optimizer.zero_grad()
    trainer, server, masks, loss = [], [], [], 0.0
    for m in batches:
        inputs = packed_inputs(
            m.packed, m.features, model, spec, image_index=m.image_index, video_index=m.video_index
        )
        out = packed_logprobs(model, inputs, suppressed_token_ids=suppressed)
        wire = m.packed.micro_batch
        old = torch.tensor(wire.inference_logprobs)
        adv = torch.tensor(wire.advantages)
        ratio = torch.exp(out.logprobs - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
        micro_loss = -surrogate[out.loss_mask].sum() / normalizer
        micro_loss.backward()
        loss += float(micro_loss.detach())
        trainer.append(out.logprobs.detach())
        server.append(old)
        masks.append(out.loss_mask)
    optimizer.step()
    stats = logprob_mismatch(torch.cat(trainer), torch.cat(server), torch.cat(masks))
    return StepResult(stats, loss, len(ranks[0].micro_batches), time.monotonic() - t0)


def data_url(ref: RawMMRef) -> str:
    """The ref's image as a data URL (the bytes the store holds)."""
    data = Path(file_uri_to_path(parse_ref(ref.ref).raw_image_uri)).read_bytes()
    return f"data:{ref.media_type};base64,{base64.b64encode(data).decode()}"


def previous_weights_mismatch(
    previous,
    samples: list[TrainingSample],
    spec: PackingSpec,
    config: MaterializeConfig,
    suppressed: Sequence[int] = (),
) -> float:
    """Mean |d| between the server's logprobs of ``samples`` and the trainer's recompute under
    ``previous`` (a model holding the weights before the latest push)."""
    options = LogprobOptions(seq_len=2048, suppressed_token_ids=suppressed)
    per_sample = recompute_logprobs(samples, previous, spec, config, options)
    trainer = torch.cat([lp for lp, _ in per_sample])
    mask = torch.cat([m for _, m in per_sample])
    server = torch.cat([torch.tensor(s.inference_logprobs) for s in samples])
    return logprob_mismatch(trainer, server, mask).mean_abs


def jpeg(name: str, size: tuple[int, int] | None = None) -> bytes:
    image = getattr(skimage.data, name)()
    if image.ndim == 2:
        image = np.stack([image] * 3, axis=-1)
    pil = Image.fromarray(image[..., :3])
    if size is not None:
        pil = pil.resize(size, Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    pil.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def mismatch_bound(model, samples, spec, config, serve_dtype: str, suppressed) -> tuple[float, object]:
    """1e-4 against a float32 server; against bfloat16, ``BF16_NOISE_FACTOR`` x the trainer's own
    bf16-vs-fp32 mean |d| on the same samples (docs/PACKING.md §9). Returns ``(bound, noise)``."""
    if serve_dtype == "float32":
        return 1e-4, None
    options = LogprobOptions(seq_len=2048, suppressed_token_ids=suppressed)
    fp32 = recompute_logprobs(samples, model, spec, config, options)
    bf16 = recompute_logprobs(samples, copy.deepcopy(model).to(torch.bfloat16), spec, config, options)
    noise = logprob_mismatch(
        torch.cat([lp for lp, _ in bf16]), torch.cat([lp for lp, _ in fp32]), torch.cat([m for _, m in fp32])
    )
    return BF16_NOISE_FACTOR * noise.mean_abs, noise
