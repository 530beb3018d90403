"""mmref inside RL frameworks: one package per framework, each an optional extra (docs/INTEGRATIONS.md).

- :mod:`integrations.trl` — TRL's ``GRPOTrainer`` with rollouts by ref on an mmref server, the
  training batch from :mod:`trainer_lib` and the weights pushed each step (extra ``trl``).
- :mod:`integrations.verl` — verl's agent-loop rollouts by ref, its actor's log-probs from
  :mod:`trainer_lib` and its weight sync through the plugin's update route (extra ``verl``,
  installed by ``bash scripts/install.sh verl``).
- :mod:`integrations.common` — what both share: the settings, the version check, the weight
  pushes, rows' completion logprobs from the packed forward, and the stand-in row of a dataset row
  whose image cannot be read.

Importing this package imports no framework: each framework package checks the installed
framework's version on import and stops with a message naming it when it is outside the range
tested here.
"""
