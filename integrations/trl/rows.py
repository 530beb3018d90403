"""One generation's rows and their layouts on TRL's side (:mod:`integrations.trl.trainer` uses them).

- :class:`Row` (a rollout's :class:`~protocol.structs.TrainingSample` and where its completion
  starts) and :class:`GenerationReport` (what one generation did: its version, push, rows,
  mismatch);
- :func:`group_runs`: the groups of a generation batch (``num_generations`` equal prompts in a row);
- :func:`trl_outputs`: the rows as ``rollout_func``'s keys;
- :func:`check_rows`: TRL's ``[B, P + C]`` batch holds the rows' completion tokens;
- :func:`zero_rows`: a mask with some rows zeroed (rows whose image went missing);
- :func:`images_into_prompt`: a dataset row's ``image``/``images`` column moved into its prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.data_utils import is_conversational, prepare_multimodal_messages

from integrations.common import PushRecord
from protocol.structs import TrainingSample
from rollout_client import PreparedPrompt
from trainer_lib import MismatchStats

__all__ = [
    "GenerationReport",
    "Row",
    "check_rows",
    "group_runs",
    "images_into_prompt",
    "trl_outputs",
    "zero_rows",
]


@dataclass(frozen=True)
class Row:
    """One row of a generation batch: its sample and where its completion starts."""

    sample: TrainingSample
    prompt_length: int
    unreadable: bool = False
    """A stand-in for a dataset row whose image could not be read (zero loss)."""


@dataclass
class GenerationReport:
    """What one generation did (:attr:`MMRefGRPOTrainer.mmref_reports`, one per generation)."""

    step: int
    """``trainer.state.global_step`` when it ran."""
    version: str
    """The weights every rollout was served under (``x-mmref-weight-version``)."""
    push: PushRecord | None
    rows: list[Row]
    unreadable_rows: int = 0
    zeroed_rows: int = 0
    """Rows whose image went missing after the rollout (zeroed by ``placeholder_zero_loss``)."""
    served_versions: set[str] = field(default_factory=set)
    """The versions the server's answers named (one, ``version``, unless something went wrong)."""
    trainer_pixel_bytes: int = 0
    """Bytes of image features the loss forwards were given (each distinct image once per
    micro-batch: the trainer's image input, beside TRL's ``pixel_values`` of every row)."""
    mismatch: MismatchStats | None = None
    """Server vs trainer logprobs on this generation's completions, measured on the first loss
    forward (the trainer then holds the weights the server sampled with)."""
    _compared: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list, repr=False)


def group_runs(prepared: Sequence[Any]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of consecutive equal prompts (one group each); an item that is
    not a :class:`~rollout_client.PreparedPrompt` (a read error) is a run of its own."""
    runs: list[tuple[int, int]] = []
    for i, p in enumerate(prepared):
        if runs and isinstance(p, PreparedPrompt) and prepared[runs[-1][0]] == p:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def trl_outputs(rows: Sequence[Row], version: str | None) -> dict[str, list]:
    """TRL's ``rollout_func`` keys of the rows (``prompt_ids``, ``completion_ids``, ``logprobs``,
    ``env_mask``: 0 on a stand-in's completion), plus ``mmref_unreadable_image`` and
    ``mmref_weight_version``, which the reward functions see."""
    return {
        "prompt_ids": [r.sample.input_ids[: r.prompt_length] for r in rows],
        "completion_ids": [r.sample.input_ids[r.prompt_length :] for r in rows],
        "logprobs": [r.sample.inference_logprobs[r.prompt_length :] for r in rows],
        "env_mask": [[0 if r.unreadable else 1] * (len(r.sample.input_ids) - r.prompt_length) for r in rows],
        "mmref_unreadable_image": [r.unreadable for r in rows],
        "mmref_weight_version": [version] * len(rows),
    }


def check_rows(rows: Sequence[Row], input_ids: torch.Tensor, width: int) -> None:
    """TRL's ``[B, P + C]`` ids must be the rows' (same count, same completion tokens in the last
    ``width`` columns).

    Raises:
        RuntimeError: naming the count, or the first row whose completion tokens differ.
    """
    if len(rows) != input_ids.shape[0]:
        raise RuntimeError(f"{input_ids.shape[0]} rows in TRL's batch, {len(rows)} mmref rows")
    start = input_ids.shape[1] - width
    for b, r in enumerate(rows):
        completion = r.sample.input_ids[r.prompt_length :]
        if input_ids[b, start : start + len(completion)].tolist() != completion:
            raise RuntimeError(f"row {b}: TRL's completion tokens are not the rollout's")


def zero_rows(mask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """A copy of the ``[B, C]`` ``mask`` with the given rows set to 0."""
    out = mask.clone()
    out[list(rows)] = 0
    return out


def images_into_prompt(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its ``image``/``images`` column moved into its prompt messages (TRL's
    ``prepare_multimodal_messages``) and the column removed.

    Raises:
        ValueError: a row with images whose prompt is not a list of chat messages.
    """
    if "images" not in row and "image" not in row:
        return row
    row = dict(row)
    images = row.pop("images", None) or []
    if "image" in row:
        image = row.pop("image")
        images = [image] if image is not None else []
    if not is_conversational(row):
        raise ValueError("multimodal rows need conversational prompts (a list of chat messages)")
    row["prompt"] = prepare_multimodal_messages(row["prompt"], images=images)
    return row
