"""Tokens the sampler must never emit (the image placeholder), on both sides of the importance ratio.

A completion that samples the family's image placeholder (Qwen ``<|image_pad|>``) cannot be
trained: its prompt+completion has more placeholder tokens than its images take
(``PlaceholderMismatch``). The client removes those ids from the sampling distribution with vLLM's
own ``logit_bias`` sampling parameter, ``-100`` each (vLLM clamps biases to ``[-100, 100]``; after
the bias a token's probability is at most ``e^-100`` times what it was: never drawn). Measured on
vLLM 0.32 (docs/CLIENT.md): ``logit_bias``, ``bad_words`` and ``allowed_token_ids`` are all
honoured on ``/inference/v1/generate``; ``logit_bias`` needs no tokenizer on the server and costs
~20 request bytes.

The server's processed logprobs are then those of the distribution without these tokens
(renormalized over the rest: each token's logprob rises by ``-log(1 - p_suppressed)``). A trainer
comparing its logprobs with the server's must remove the same tokens from its softmax:
``trainer_lib.packed_logprobs(..., suppressed_token_ids=client.suppressed_token_ids())`` (and
``recompute_logprobs``) does it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SUPPRESS_BIAS", "logit_bias"]

SUPPRESS_BIAS = -100.0
"""The bias given to a suppressed token (vLLM's lower clamp of ``logit_bias``)."""


def logit_bias(token_ids: Iterable[int]) -> dict[str, float]:
    """The ``sampling_params.logit_bias`` entry that suppresses ``token_ids`` (JSON keys are strings)."""
    return {str(int(t)): SUPPRESS_BIAS for t in sorted(set(token_ids))}
