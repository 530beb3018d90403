"""verl on an mmref server: agent-loop rollouts by ref, the actor's log-probs from the refs, the
weights pushed after each update (docs/INTEGRATIONS.md, "verl").

Hooks cited against verl 0.9.1 (the only range this package imports under, :data:`SUPPORTED`);
importing it registers them (``actor_rollout_ref.model.external_lib=integrations.verl`` imports it
in every worker process: ``HFModelConfig.__post_init__``, verl/workers/config/model.py:149):

- :mod:`integrations.verl.rollout` — :class:`MMRefAgentLoop`, agent ``"mmref"`` (``register``,
  verl/experimental/agent_loop/agent_loop.py:470): rows sampled by ref, one ``X-Session-ID`` per
  group, the row's ``TrainingSample`` in ``extra_fields``, no ``multi_modal_data``;
  :class:`MMRefAgentLoopWorker` / :class:`MMRefAgentLoopManager`
  (``rollout.agent.agent_loop_manager_class``): verl's MRoPE positions from the refs' grids.
- :mod:`integrations.verl.actor` — :class:`MMRefFSDPEngine` (``VERL_ENGINE_VENDOR=mmref``): verl's
  FSDP engine whose ``forward_step`` takes the log-probs from :func:`mmref_model_output`.
- :mod:`integrations.verl.weights` — :class:`MMRefCheckpointEngine`, backend ``"mmref"``, and
  :class:`MMRefCheckpointManager` (``rollout.checkpoint_manager_class``): the actor's weights
  pushed through the plugin's update route after each update.

Refused (ValueError naming the setting): ``top_p`` < 1, ``top_k`` > 0, a repetition penalty (the
server's logprobs would not be the distribution the trainer computes), a prompt over
``rollout.prompt_length``, Ulysses sequence parallelism, fused kernels, top-K distillation.
"""

from __future__ import annotations

import verl

from integrations.common import require_version

SUPPORTED = ">=0.9.1,<0.10"
"""The verl releases this package is tested with (``scripts/install.sh verl`` pins it)."""
require_version("verl", verl.__version__, SUPPORTED)

from integrations.verl.actor import (  # noqa: E402
    MMRefActorForward,
    MMRefFSDPEngine,
    mmref_model_output,
    rows_of,
    zero_rows,
)
from integrations.verl.rollout import (  # noqa: E402
    SAMPLE_FIELD,
    MMRefAgentLoop,
    MMRefAgentLoopManager,
    MMRefAgentLoopWorker,
    settings_from_config,
)
from integrations.verl.weights import MMRefCheckpointEngine, MMRefCheckpointManager  # noqa: E402

__all__ = [
    "SAMPLE_FIELD",
    "SUPPORTED",
    "MMRefActorForward",
    "MMRefAgentLoop",
    "MMRefAgentLoopManager",
    "MMRefAgentLoopWorker",
    "MMRefCheckpointEngine",
    "MMRefCheckpointManager",
    "MMRefFSDPEngine",
    "mmref_model_output",
    "rows_of",
    "settings_from_config",
    "zero_rows",
]
