"""One answer of ``POST /inference/v1/generate``, parsed: :class:`Rollout`.

The route answers vLLM's ``GenerateResponse`` (``output_mode="tokens"``)::

    {"request_id": str,
     "choices": [{"index": 0,
                  "token_ids": [int, ...],                  # the completion, L tokens
                  "logprobs": {"content": [{"token_id": int, "logprob": float, "rank": int,
                                            "top_logprobs": [...]}, ...]},   # L entries
                  "finish_reason": "stop" | "length" | "abort",
                  "stop_reason": int | str | null,          # the stop token or string; null on EOS
                  "weight_versions": [{"version": str, "start": int, "end": int}]}],
     "usage": {...}}

with the header ``x-mmref-weight-version`` (the weights the request was bound to).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.structs import RawMMRef, TrainingSample

if TYPE_CHECKING:
    from rollout_client.conversation import PreparedPrompt

__all__ = ["WEIGHT_VERSION_HEADER", "Rollout", "parse_choices"]

WEIGHT_VERSION_HEADER = "x-mmref-weight-version"
"""The response header naming the served weight version (``vllm_plugin.weights``)."""


@dataclass(frozen=True)
class Rollout:
    """One sampled completion of one prompt.

    Attributes:
        prompt_ids: the prompt as sent, ``P`` tokens, each image's placeholders expanded.
        completion_ids: the sampled tokens, ``C`` of them (the end-of-sequence token included when
            the model stopped on it).
        logprobs: ``C`` floats, the server's logprob of each sampled token (after temperature on a
            server run with ``--logprobs-mode processed_logprobs``, over the vocabulary left once
            the suppressed tokens are removed).
        finish_reason: ``"stop"`` (EOS or a stop token/string), ``"length"`` (``max_tokens``),
            ``"abort"``.
        stop_reason: the stop token id or string that ended it; None on EOS, length and abort.
        weight_version: the served weights it was bound to (header ``x-mmref-weight-version``).
        images: the prompt's image refs, prompt order.
        temperature: the sampling temperature it was drawn at (the trainer must use the same one).
        request_id: vLLM's request id.
        session_id: the ``X-Session-ID`` it was sent with (one per group or conversation), or None.
        attempts: HTTP attempts it took (1 without retries).
        weight_versions: vLLM's spans ``(version, start, end)`` over the completion's tokens.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    stop_reason: int | str | None
    weight_version: str | None
    images: tuple[RawMMRef, ...] = ()
    temperature: float = 1.0
    request_id: str = ""
    session_id: str | None = None
    attempts: int = 1
    weight_versions: tuple[tuple[str, int, int], ...] = field(default=())

    def to_training_sample(self) -> TrainingSample:
        """The trainer's sample: ``P + C`` tokens, loss and the server's logprobs on the completion
        (:meth:`protocol.structs.TrainingSample.from_rollout`), ``sampling_temperature`` the
        rollout's; advantages 0.0 for the RL algorithm.

        Raises:
            TypeError: an image was sent as a bare ref string (``generate_tokens`` accepts them),
                which lacks the grid and placeholder count the trainer needs: send ``RawMMRef``.
        """
        if any(not isinstance(ref, RawMMRef) for ref in self.images):
            raise TypeError(
                "a rollout sent with bare ref strings has no grids for the trainer: send RawMMRef"
            )
        return TrainingSample.from_rollout(
            self.prompt_ids,
            self.completion_ids,
            self.logprobs,
            list(self.images),
            sampling_temperature=self.temperature,
        )


def parse_choices(
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    prompt: PreparedPrompt,
    *,
    temperature: float,
    session_id: str | None,
    attempts: int,
) -> list[Rollout]:
    """Every choice of a 200 answer to ``prompt`` (its ids and image refs) as a :class:`Rollout`.

    Raises:
        ValueError: the body is not a tokens-mode generate answer with logprobs (e.g. a server
            without the plugin's route, or a request without ``logprobs``).
    """
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ValueError(f"not a generate answer (no choices): {str(body)[:300]}")
    out = []
    for choice in choices:
        tokens = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if tokens is None or content is None or len(content) != len(tokens):
            raise ValueError(f"a choice without token ids and one logprob per token: {str(choice)[:300]}")
        spans = tuple((s["version"], s["start"], s["end"]) for s in choice.get("weight_versions") or ())
        out.append(
            Rollout(
                prompt_ids=list(prompt.prompt_ids),
                completion_ids=list(tokens),
                logprobs=[float(c["logprob"]) for c in content],
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
                weight_version=headers.get(WEIGHT_VERSION_HEADER),
                images=tuple(prompt.images),
                temperature=temperature,
                request_id=str(body.get("request_id", "")),
                session_id=session_id,
                attempts=attempts,
                weight_versions=spans,
            )
        )
    return out
