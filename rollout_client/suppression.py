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
:func:`mask_in_trainer` does it for a Hugging Face model until ``trainer_lib`` takes the ids itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["MASKED_LOGIT", "SUPPRESS_BIAS", "logit_bias", "mask_in_trainer"]

SUPPRESS_BIAS = -100.0
"""The bias given to a suppressed token (vLLM's lower clamp of ``logit_bias``)."""

MASKED_LOGIT = -1.0e4
"""The logit :func:`mask_in_trainer` gives a suppressed token: ``exp`` of it relative to any real
logit is 0 in float32 and bfloat16, like the server's ``e^-100``, and unlike ``-inf`` it keeps the
logprob of a prompt's placeholder position finite (no NaN where a mask multiplies it by 0)."""


def logit_bias(token_ids: Iterable[int]) -> dict[str, float]:
    """The ``sampling_params.logit_bias`` entry that suppresses ``token_ids`` (JSON keys are strings)."""
    return {str(int(t)): SUPPRESS_BIAS for t in sorted(set(token_ids))}


def mask_in_trainer(model: Any, token_ids: Iterable[int]) -> Any:
    """Remove ``token_ids`` from ``model``'s softmax: a forward hook on its output embedding (the
    LM head, ``model.get_output_embeddings()``) sets their logits to :data:`MASKED_LOGIT`, so the trainer's
    logprobs are those of the distribution the server sampled from. Gradients flow through the
    other logits unchanged.

    Returns:
        The hook's handle (``handle.remove()`` undoes it).
    """
    import torch

    ids = sorted({int(t) for t in token_ids})
    head = model.get_output_embeddings()

    def hook(_module: Any, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        index = torch.tensor(ids, device=output.device)
        return output.index_fill(-1, index, MASKED_LOGIT)

    return head.register_forward_hook(hook)
