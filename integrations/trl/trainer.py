""":class:`MMRefGRPOTrainer`: ``trl.GRPOTrainer`` with five hooks, cited against TRL 1.16.0's
``trl/trainer/grpo_trainer.py`` (the package checked the installed version first:
:data:`integrations.trl.SUPPORTED`); the rows' types and layouts are :mod:`integrations.trl.rows`.

- ``rollout_func`` (public, ``GRPOTrainer.__init__``; called by ``_generate``, line 2210): each
  group of ``num_generations`` identical prompts is prepared once (chat template, each image
  offloaded once by content) and sampled with :meth:`rollout_client.RolloutClient.sample_group`
  (one ``X-Session-ID``, every sample under the version just pushed); no request carries pixels.
  Before the first generation of each optimizer step the trainer's weights are written and pushed
  (:class:`~integrations.common.WeightPusher`), where TRL would call its own ``sync_weights``
  (line 2203). A row whose image cannot be read becomes a zero-loss stand-in
  (:func:`~integrations.common.stand_in_sample`; its ``env_mask`` 0, TRL's ``tool_mask``).
- ``_generate_and_score_completions`` (line 2324): the dataset's ``image``/``images`` columns are
  moved into the prompt messages first, so TRL's processor never runs over the images again (its
  ``processing_class(images=..., text=...)`` at line 2536 needs them in the row); the output gets
  the rows' :class:`~protocol.structs.TrainingSample` (``mmref_rows``, shuffled and split with the
  rest) and, where TRL computed no ``old_per_token_logps``, the server's logprobs as the behaviour
  policy of the importance ratio.
- ``_get_per_token_logps_and_entropies`` (line 1419): the packed forward over the rows
  (:func:`trainer_lib.sample_logprobs`: images materialized from the refs, each distinct image once
  per generation), cut back to TRL's ``[B, C]`` completion layout.
- ``_compute_loss`` (line 3020): runs that forward with gradients first, zeroes the loss of rows
  whose image went missing since the rollout (``placeholder_zero_loss``), logs the server-vs-trainer
  mismatch while the trainer still holds the served weights, then TRL's own loss.
- ``_calculate_rewards`` (line 1579): a stand-in row's rewards are NaN, so TRL leaves it out of its
  group's baseline and gives it advantage 0 (line 2770).

Not supported (refused at construction, each with its reason): ``use_vllm`` (mmref is the rollout
engine), sampling that changes the distribution the logprobs come from (``top_p`` < 1, ``top_k``,
``min_p``, ``repetition_penalty``), tools and environments (their follow-up turns would be generated
by TRL's own backend), PEFT (the push writes full weights), MoE router aux loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch
from accelerate.utils import gather_object
from trl import GRPOConfig, GRPOTrainer

from integrations.common import (
    IMAGE_READ_ERRORS,
    MMRefSettings,
    PushRecord,
    WeightPusher,
    completion_rows,
    stand_in_sample,
    text_only,
)
from integrations.trl.rows import (
    GenerationReport,
    Row,
    check_rows,
    group_runs,
    images_into_prompt,
    trl_outputs,
    zero_rows,
)
from protocol.adapters import load_adapter
from rollout_client import PreparedPrompt, RolloutClient, Sampling
from trainer_lib import LogprobOptions, PackingSpec, logprob_mismatch, prepare_model_for_packing
from trainer_lib import sample_logprobs as packed_rows

__all__ = ["MMRefGRPOTrainer"]


class MMRefGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose rollouts, training batch and weight sync go through mmref.

    Args:
        model, reward_funcs, args, train_dataset: as ``GRPOTrainer``; ``args.use_vllm`` must be False.
        mmref: the server and stores (:class:`~integrations.common.MMRefSettings`).
        rollout_client: a client to use (default: one on ``mmref.server_url``).
        **kwargs: the rest of ``GRPOTrainer``'s arguments (``processing_class``, ``callbacks``...).

    Raises:
        ValueError: a setting this integration refuses (see the module docstring).
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        *,
        mmref: MMRefSettings,
        rollout_client: RolloutClient | None = None,
        **kwargs: Any,
    ) -> None:
        _refuse(args, kwargs)
        super().__init__(model, reward_funcs, args, train_dataset, rollout_func=self._mmref_rollout, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError(
                "mmref's packed forward returns no MoE router aux loss: set output_router_logits=False"
            )
        self.mmref = mmref
        self.mmref_client = rollout_client or RolloutClient(
            mmref.server_url, mmref.model_dir, mmref.rollout_asset_root(), **dict(mmref.client_kwargs)
        )
        policy = self.accelerator.unwrap_model(self.model)
        self.mmref_backend = prepare_model_for_packing(policy)
        if self.ref_model is not None:
            prepare_model_for_packing(self.ref_model)
        pad_id = self.mmref_client.template.tokenizer.pad_token_id
        self.mmref_spec = PackingSpec.from_adapter(load_adapter(mmref.model_dir), policy, pad_token_id=pad_id)
        self.mmref_pusher = WeightPusher(
            httpx.Client(base_url=mmref.server_url),
            mmref.checkpoints(),
            timeout_s=mmref.push_timeout_s,
            keep=mmref.keep_checkpoints,
        )
        self.mmref_reports: list[GenerationReport] = []
        self._mmref_rows: list[Row] = []
        self._mmref_pending: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._mmref_resolved: dict = {}
        self._mmref_version: str | None = None
        self._mmref_pushed_step = -1

    # --- rollouts ---------------------------------------------------------------------------------

    def _mmref_rollout(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's ``rollout_func``: the rows of ``prompts`` (each repeated ``num_generations`` times,
        consecutively) sampled by ref. Returns TRL's keys plus ``env_mask`` and two extra fields the
        reward functions see (``mmref_unreadable_image``, ``mmref_weight_version``)."""
        push = self._mmref_sync_weights()
        version = self._mmref_version
        sampling = Sampling(temperature=self.temperature, max_tokens=self.max_completion_length)
        prepared = [self._mmref_prepare(p) for p in prompts]
        runs = group_runs(prepared)
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(runs)))) as pool:
            futures = {
                start: pool.submit(
                    self.mmref_client.sample_group,
                    prepared[start],
                    end - start,
                    sampling,
                    expected_weight_version=version,
                )
                for start, end in runs
                if isinstance(prepared[start], PreparedPrompt)
            }
            rows, served = [], set()
            for start, end in runs:
                if start in futures:
                    for rollout in futures[start].result():
                        rows.append(Row(rollout.to_training_sample(), len(rollout.prompt_ids)))
                        served.add(rollout.weight_version)
                else:
                    rows.extend(
                        self._mmref_stand_in(prompts[start], prepared[start]) for _ in range(start, end)
                    )
        self._mmref_rows, self._mmref_resolved = rows, {}
        report = GenerationReport(self.state.global_step, str(version), push, rows, served_versions=served)
        report.unreadable_rows = sum(r.unreadable for r in rows)
        self.mmref_reports.append(report)
        return trl_outputs(rows, version)

    def _mmref_prepare(self, messages: Any) -> PreparedPrompt | BaseException:
        """The prompt's tokens and refs (images offloaded once by content), or the read error of a
        row whose image cannot be read."""
        try:
            return self.mmref_client.prepare(messages)
        except IMAGE_READ_ERRORS as e:
            return e

    def _mmref_stand_in(self, messages: Any, error: BaseException) -> Row:
        prompt = self.mmref_client.prepare(text_only(messages))
        eos = self.mmref_client.template.tokenizer.eos_token_id
        sample = stand_in_sample(prompt.prompt_ids, eos, self.temperature, error, "trl")
        return Row(sample, len(prompt.prompt_ids), unreadable=True)

    def _mmref_sync_weights(self) -> PushRecord | None:
        """Push the trainer's weights when an optimizer step ran since the last push (and before the
        first generation): the main process writes and pushes, every process waits for it."""
        step = self.state.global_step
        if step == self._mmref_pushed_step:
            return None
        version = f"{self.mmref.version_prefix}{step}"
        self.accelerator.wait_for_everyone()
        state = self.accelerator.get_state_dict(self.model) if self.accelerator.num_processes > 1 else None
        record = None
        if self.accelerator.is_main_process:
            record = self.mmref_pusher.push(self.accelerator.unwrap_model(self.model), version, state)
        self.accelerator.wait_for_everyone()
        self._mmref_pushed_step, self._mmref_version = step, version
        return record

    # --- the training batch -----------------------------------------------------------------------

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions([images_into_prompt(x) for x in inputs])
        output["mmref_rows"] = list(self._mmref_rows)
        server = output.get("sampling_per_token_logps")
        if output.get("old_per_token_logps") is None and server is not None and not server.isnan().any():
            output["old_per_token_logps"] = server  # the behaviour policy: the server's logprobs
        return output

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        """``[B, logits_to_keep]`` logprobs (and entropies) of the rows' completions from the packed
        forward; the multimodal keywords TRL passes are empty here (the images are refs)."""
        if self._mmref_pending is not None:  # the loss forward, run by _compute_loss
            logps, entropies = self._mmref_pending
            return logps, (entropies if compute_entropy else None), None
        logps, entropies, _ = self._mmref_forward(
            model, self._mmref_rows, input_ids, logits_to_keep, compute_entropy
        )
        return logps, entropies, None

    def _mmref_forward(
        self, model: Any, rows: Sequence[Row], input_ids: torch.Tensor, width: int, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """The rows through :func:`trainer_lib.sample_logprobs`; ``[B, width]`` logprobs, entropies
        (or None) and the :class:`trainer_lib.SampleForward` (rows zeroed by a missing image,
        pixel bytes).

        Raises:
            RuntimeError: TRL's rows are not the rollouts' (count or completion tokens differ).
        """
        check_rows(rows, input_ids, width)
        forward = packed_rows(
            [r.sample for r in rows],
            self.accelerator.unwrap_model(model),
            self.mmref_spec,
            self.mmref.materialize_config(),
            LogprobOptions(
                seq_len=self.mmref.seq_len,
                temperature=self.temperature,
                suppressed_token_ids=self.mmref_client.suppressed_token_ids(),
                compute_entropy=entropy,
            ),
            resolved=self._mmref_resolved,
        )
        p = [r.prompt_length for r in rows]
        c = [len(r.sample.input_ids) - r.prompt_length for r in rows]
        logps = completion_rows([s.logprobs for s in forward.samples], p, c, width)
        ent = completion_rows([s.entropy for s in forward.samples], p, c, width) if entropy else None
        return logps, ent, forward

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        rows = inputs["mmref_rows"]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        logps, entropies, forward = self._mmref_forward(
            model, rows, input_ids, inputs["completion_ids"].size(1), True
        )
        report = self.mmref_reports[-1]
        report.trainer_pixel_bytes += forward.pixel_bytes
        if forward.zeroed:
            inputs = {**inputs, "tool_mask": zero_rows(inputs["tool_mask"], forward.zeroed)}
            report.zeroed_rows += len(forward.zeroed)
        self._mmref_note_mismatch(logps.detach(), inputs)
        self._mmref_pending = (logps, entropies)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._mmref_pending = None

    def _mmref_note_mismatch(self, logps: torch.Tensor, inputs: dict[str, Any]) -> None:
        """Server vs trainer on the loss tokens, while no optimizer step has run since the rollouts."""
        report = self.mmref_reports[-1] if self.mmref_reports else None
        server = inputs.get("sampling_per_token_logps")
        if (
            report is None
            or server is None
            or not self.model.training
            or self.state.global_step != report.step
        ):
            return
        mask = (inputs["completion_mask"] * inputs["tool_mask"]).bool() & server.isfinite()
        if not mask.any():
            return
        report._compared.append((logps[mask].cpu(), server[mask].cpu()))
        trainer, served = (torch.cat(t) for t in zip(*report._compared, strict=True))
        report.mismatch = logprob_mismatch(trainer, served, torch.ones_like(trainer, dtype=torch.bool))
        self._metrics["train"]["mmref/mismatch_mean_abs"].append(report.mismatch.mean_abs)

    def _calculate_rewards(
        self, inputs: list[dict], prompts: list, completions: list, completion_ids_list: list
    ) -> torch.Tensor:
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        unreadable = gather_object([bool(x.get("mmref_unreadable_image")) for x in inputs])
        rewards[torch.tensor(unreadable, dtype=torch.bool, device=rewards.device)] = math.nan
        return rewards


def _refuse(args: GRPOConfig | None, kwargs: dict[str, Any]) -> None:
    """Raise ValueError for the settings this integration does not support (module docstring)."""
    if args is None:
        raise ValueError("pass a GRPOConfig: mmref needs use_vllm=False and the sampling settings")
    problems = []
    if args.use_vllm:
        problems.append("use_vllm=True (the mmref server is the rollout engine: set use_vllm=False)")
    if (
        args.top_p != 1.0
        or (args.top_k or 0) > 0
        or (args.min_p or 0.0) > 0
        or args.repetition_penalty != 1.0
    ):
        problems.append(
            "top_p < 1, top_k, min_p or repetition_penalty (the server's logprobs would not be the "
            "distribution the trainer computes: the importance ratio and the mismatch check need it whole)"
        )
    for key in ("rollout_func", "tools", "environment_factory", "peft_config"):
        if kwargs.get(key) is not None:
            problems.append(f"{key} (not supported with mmref's rollouts; see integrations.trl)")
    if problems:
        raise ValueError("MMRefGRPOTrainer: " + "; ".join(problems))
