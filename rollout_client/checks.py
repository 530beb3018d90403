"""Checks a trainer runs against the rollouts it trains on (no torch here)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from rollout_client.result import Rollout

__all__ = ["check_trainer_temperature"]

logger = logging.getLogger("rollout_client")


def check_trainer_temperature(
    rollouts: Iterable[Rollout], temperature: float, *, rel_tol: float = 1e-6
) -> bool:
    """Whether every rollout was sampled at the trainer's ``temperature``; logs a WARNING if not.

    A server run with ``--logprobs-mode processed_logprobs`` returns logprobs after temperature;
    the trainer's (``packed_logprobs(..., temperature=T)``) match them only at the same ``T``
    (measured on the tiny model: mean |d| ~2e-7 at the sampling temperature, ~5.7e-2 at 0.7
    against 1.0). Greedy rollouts (temperature 0) are compared at 1.0.
    """
    seen: dict[float, int] = {}
    for r in rollouts:
        t = r.temperature if r.temperature > 0 else 1.0
        seen[t] = seen.get(t, 0) + 1
    other = {t: n for t, n in seen.items() if not math.isclose(t, temperature, rel_tol=rel_tol)}
    if other:
        described = ", ".join(f"{n} at {t:g}" for t, n in sorted(other.items()))
        logger.warning(
            "rollout_client: the trainer computes logprobs at temperature %g but %s rollout(s) were "
            "sampled otherwise (%s): their logprobs will not match (pass the sampling temperature)",
            temperature,
            sum(other.values()),
            described,
        )
        return False
    return True
