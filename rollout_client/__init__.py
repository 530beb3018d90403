"""A client for rollout code: chat messages with images in, :class:`Rollout` (tokens, logprobs,
finish reason, weight version) and :class:`~protocol.structs.TrainingSample` out, through the mmref
plugin's ``POST /inference/v1/generate`` (docs/CLIENT.md).

Imports no torch: transformers (the tokenizer and chat template) and :mod:`protocol.adapters` (the
image processor config, for grids) are loaded on first use.

- :class:`RolloutClient` / :class:`AsyncRolloutClient`: ``generate``, ``sample_group``, ``generate_tokens``.
- :class:`Conversation`: multi-turn prompts in tokens, images kept as refs.
- :func:`push_weights`: the trainer's weights to the server after an optimizer step
  (:mod:`rollout_client.weights`).
- :class:`Sampling`, :class:`RetryPolicy`; errors in :mod:`rollout_client.errors` and :mod:`protocol.errors`.
- :mod:`rollout_client.suppression`: the sampler's placeholder suppression (the trainer takes the
  same ids: ``trainer_lib.packed_logprobs(..., suppressed_token_ids=client.suppressed_token_ids())``;
  it also warns when samples' ``sampling_temperature`` differs from its own).
"""

from rollout_client.client import AsyncRolloutClient, RolloutClient
from rollout_client.conversation import Conversation, PreparedPrompt, PromptBuilder
from rollout_client.errors import (
    RetriesExhausted,
    RolloutError,
    RolloutTimeout,
    ServerRefusal,
    WeightVersionMismatch,
)
from rollout_client.images import Offloader
from rollout_client.result import Rollout
from rollout_client.retry import RetryPolicy
from rollout_client.sampling import Sampling
from rollout_client.template import ChatTemplate
from rollout_client.weights import push_weights

__all__ = [
    "AsyncRolloutClient",
    "ChatTemplate",
    "Conversation",
    "Offloader",
    "PreparedPrompt",
    "PromptBuilder",
    "RetriesExhausted",
    "RetryPolicy",
    "Rollout",
    "RolloutClient",
    "RolloutError",
    "RolloutTimeout",
    "Sampling",
    "ServerRefusal",
    "WeightVersionMismatch",
    "push_weights",
]
