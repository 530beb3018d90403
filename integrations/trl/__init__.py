"""TRL's ``GRPOTrainer`` on an mmref server: rollouts by ref, the training batch from
:mod:`trainer_lib`, the weights pushed before each generation (docs/INTEGRATIONS.md).

Cited against TRL 1.16.0 (the only range this package imports under, :data:`SUPPORTED`); the
version is checked here, before any TRL class is imported, so every module below runs on it:

- :mod:`integrations.trl.trainer` — :class:`MMRefGRPOTrainer`, ``trl.GRPOTrainer`` with five hooks
  (rollouts by ref, the batch and its packed forward, the loss, the rewards of stand-in rows) and
  the settings it refuses at construction;
- :mod:`integrations.trl.rows` — what one generation produced (:class:`Row`,
  :class:`GenerationReport`) and its layouts on TRL's side: the groups of a generation batch,
  ``rollout_func``'s keys, the check that TRL's batch holds the rollouts' tokens, a dataset row's
  image columns moved into its prompt.

Raises:
    FrameworkVersionError: TRL outside :data:`SUPPORTED` (on import).
"""

from __future__ import annotations

import trl

from integrations.common import require_version

SUPPORTED = ">=1.16,<1.17"
"""The TRL releases this package is tested with (``pyproject.toml``'s ``trl`` extra)."""
require_version("trl", trl.__version__, SUPPORTED)

from integrations.trl.rows import GenerationReport, Row  # noqa: E402
from integrations.trl.trainer import MMRefGRPOTrainer  # noqa: E402

__all__ = ["SUPPORTED", "GenerationReport", "MMRefGRPOTrainer", "Row"]
