"""verl's agent loop on an mmref server (verl/experimental/agent_loop/agent_loop.py, 0.9.1).

:class:`MMRefAgentLoop` (agent ``"mmref"``, called per row by ``AgentLoopWorker._run_agent_loop``,
line 661) builds each group's prompt once (verl's ``uid``: the chat template, each image offloaded
once by content) and samples the row from the mmref server under ``X-Session-ID: verl-<uid>``; no
request carries pixels. Its output has no ``multi_modal_data``: ``_compute_multi_modal_inputs``
(line 868) would run the processor over the images again. The row's
:class:`~protocol.structs.TrainingSample` (msgpack) rides in ``extra_fields["mmref_sample"]``, a
``non_tensor_batch`` column after ``_postprocess`` (line 1133). A row whose image cannot be read is
a zero-loss stand-in (``response_mask`` 0, logged and counted).

:class:`MMRefAgentLoopWorker` gives verl's ``_compute_position_ids`` (line 920) the refs' grids
(without them Qwen2-VL's ``get_rope_index`` fails on the placeholders); :class:`MMRefAgentLoopManager`
runs it (``rollout.agent.agent_loop_manager_class``, read by verl/trainer/ppo/ray_trainer.py:940).
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
    register,
)
from verl.utils.tokenizer import get_processor_token_id

from integrations.common import IMAGE_READ_ERRORS, MMRefSettings, stand_in_sample, text_only
from protocol.structs import TrainingSample, decode_sample, encode
from rollout_client import AsyncRolloutClient, PreparedPrompt, Sampling

__all__ = [
    "SAMPLE_FIELD",
    "MMRefAgentLoop",
    "MMRefAgentLoopManager",
    "MMRefAgentLoopWorker",
    "settings_from_config",
]

SAMPLE_FIELD = "mmref_sample"
"""The ``extra_fields`` / ``non_tensor_batch`` column holding each row's msgpack ``TrainingSample``."""


def settings_from_config(config: Any) -> MMRefSettings:
    """:class:`MMRefSettings` from verl's trainer config: ``actor_rollout_ref.rollout.custom.mmref``
    (``server_url`` required; ``output_root`` default ``$MMREF_ASSET_ROOT``; ``model_dir`` default
    ``actor_rollout_ref.model.path``; the other fields as :class:`MMRefSettings` names them).

    Raises:
        ValueError: no ``custom.mmref.server_url``, or no output root.
    """
    custom = dict((config.actor_rollout_ref.rollout.get("custom") or {}).get("mmref") or {})
    if not custom.get("server_url"):
        raise ValueError("set actor_rollout_ref.rollout.custom.mmref.server_url (the mmref server)")
    root = custom.pop("output_root", None) or os.environ.get("MMREF_ASSET_ROOT")
    if not root:
        raise ValueError("set actor_rollout_ref.rollout.custom.mmref.output_root or MMREF_ASSET_ROOT")
    model_dir = custom.pop("model_dir", None) or config.actor_rollout_ref.model.path
    paths = {k: Path(custom.pop(k)) for k in ("weights_dir",) if custom.get(k)}
    return MMRefSettings(model_dir=Path(model_dir), output_root=Path(root), **paths, **custom)


# --- rollouts ---------------------------------------------------------------------------------------

_clients: dict[tuple, AsyncRolloutClient] = {}
_groups: collections.OrderedDict[tuple, asyncio.Future] = collections.OrderedDict()
_GROUPS_KEPT = 4096


def _client(settings: MMRefSettings) -> AsyncRolloutClient:
    """One client per process, settings and event loop (its connections belong to the loop)."""
    key = (settings.server_url, str(settings.model_dir), str(settings.rollout_asset_root()), id(_loop()))
    if key not in _clients:
        _clients[key] = AsyncRolloutClient(
            settings.server_url, settings.model_dir, settings.rollout_asset_root(), **settings.client_kwargs
        )
    return _clients[key]


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _image_items(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """verl's raw_prompt (``RLHFDataset._build_messages``: ``{"type": "image", "image": PIL | path}``
    or the dataset's dict with ``bytes``) as the client's image items, the stored bytes preferred."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list | tuple):
            content = [
                {"type": "image", "image": p.get("bytes") or p.get("image")}
                if isinstance(p, Mapping) and p.get("type") == "image"
                else dict(p)
                if isinstance(p, Mapping)
                else p
                for p in content
            ]
        out.append({**m, "content": content})
    return out


@register("mmref")
class MMRefAgentLoop(AgentLoopBase):
    """verl's agent loop sampling one row from an mmref server (module docstring). Its settings:
    :func:`settings_from_config`; verl's own LLM server manager is not used."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        settings = settings_from_config(self.config)
        client = _client(settings)
        sampling = _sampling(sampling_params, self.rollout_config.response_length)
        messages = _image_items(list(kwargs["raw_prompt"]))
        uid = str(kwargs.get("uid") or kwargs.get("index") or id(kwargs))
        t0 = time.monotonic()
        prepared = await self._group_prompt(client, uid, messages)
        if isinstance(prepared, BaseException):
            return await self._stand_in(client, messages, prepared, sampling)
        if len(prepared.prompt_ids) > self.rollout_config.prompt_length:
            raise ValueError(
                f"a prompt of {len(prepared.prompt_ids)} tokens is over rollout.prompt_length="
                f"{self.rollout_config.prompt_length} (image placeholders cannot be cut)"
            )
        rollout = await client.generate(prepared, sampling, session_id=f"verl-{uid}")
        sample = rollout.to_training_sample()
        metrics = AgentLoopMetrics(generate_sequences=time.monotonic() - t0)
        return _output(sample, len(prepared.prompt_ids), metrics, rollout.weight_version, unreadable=False)

    async def _group_prompt(
        self, client: AsyncRolloutClient, uid: str, messages: list
    ) -> PreparedPrompt | BaseException:
        """The group's prompt, prepared once (its first row's task builds it, the others await it);
        the read error of an unreadable image instead."""
        key = (id(_loop()), uid)
        future = _groups.get(key)
        if future is None:
            future = _groups[key] = asyncio.ensure_future(asyncio.to_thread(_prepare, client, messages))
            while len(_groups) > _GROUPS_KEPT:
                _groups.popitem(last=False)
        return await asyncio.shield(future)

    async def _stand_in(
        self, client: AsyncRolloutClient, messages: list, error: BaseException, sampling: Sampling
    ) -> AgentLoopOutput:
        prompt = await asyncio.to_thread(client.prepare, text_only(messages))
        eos = client.template.tokenizer.eos_token_id
        sample = stand_in_sample(prompt.prompt_ids, eos, sampling.temperature, error, "verl")
        return _output(sample, len(prompt.prompt_ids), AgentLoopMetrics(), None, unreadable=True)


def _prepare(client: AsyncRolloutClient, messages: list) -> PreparedPrompt | BaseException:
    try:
        client.suppressed_token_ids()  # loads the adapter off the event loop
        return client.prepare(messages)
    except IMAGE_READ_ERRORS as e:
        return e


def _sampling(params: Mapping[str, Any], max_tokens: int) -> Sampling:
    """verl's sampling params (``AgentLoopWorker.generate_sequences``) as the client's.

    Raises:
        ValueError: ``top_p`` < 1 or ``top_k`` > 0 (module docstring).
    """
    top_p, top_k = float(params.get("top_p", 1.0)), int(params.get("top_k", -1))
    if top_p < 1.0 or top_k > 0 or float(params.get("repetition_penalty", 1.0)) != 1.0:
        raise ValueError(
            f"top_p={top_p}, top_k={top_k}: mmref's rollouts need the whole distribution (top_p=1, "
            "top_k=-1, no repetition penalty) for the importance ratio and the mismatch check"
        )
    return Sampling(temperature=float(params.get("temperature", 1.0)), max_tokens=max_tokens)


def _output(
    sample: TrainingSample,
    prompt_length: int,
    metrics: AgentLoopMetrics,
    version: str | None,
    *,
    unreadable: bool,
) -> AgentLoopOutput:
    """verl's row of a sample: its prompt, its completion (``response_mask`` 0 for a stand-in), the
    server's logprobs, the encoded sample and the weights it was served under."""
    completion = sample.input_ids[prompt_length:]
    return AgentLoopOutput(
        prompt_ids=sample.input_ids[:prompt_length],
        response_ids=completion,
        response_mask=[0 if unreadable else 1] * len(completion),
        response_logprobs=sample.inference_logprobs[prompt_length:],
        num_turns=2,
        metrics=metrics,
        extra_fields={
            SAMPLE_FIELD: encode(sample),
            "mmref_weight_version": version,
            "mmref_unreadable_image": unreadable,
            "turn_scores": [],
            "tool_rewards": [],
        },
    )


class MMRefAgentLoopWorker(AgentLoopWorker):
    """verl's ``AgentLoopWorker`` whose ``_compute_multi_modal_inputs`` (agent_loop.py:862) gives,
    for an mmref row, what the processor would without its pixels: the refs' ``image_grid_thw``,
    ``images_seqlens`` and the placeholder's ``mm_token_type_ids``. verl's ``_compute_position_ids``
    (line 930) then builds the row's MRoPE positions with the model's own ``get_rope_index``; with
    no grids it fails on the placeholders (Qwen2-VL: ``next(grid_iters[1])`` of None)."""

    def _compute_multi_modal_inputs(self, output: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        encoded = output.extra_fields.get(SAMPLE_FIELD)
        if encoded is None:
            return super()._compute_multi_modal_inputs(output, input_ids)
        sample = decode_sample(encoded)
        ids = input_ids.reshape(1, -1)
        out = {"mm_token_type_ids": torch.zeros_like(ids)}
        if sample.mm_refs and sample.mm_refs.items:
            placeholder = get_processor_token_id(self.processor, "image")
            out["mm_token_type_ids"] = (ids == placeholder).to(ids.dtype)
            grid = torch.tensor([ref.grid for ref in sample.mm_refs.items])
            out["image_grid_thw"] = grid
            out["images_seqlens"] = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        return out


class MMRefAgentLoopManager(AgentLoopManager):
    """``rollout.agent.agent_loop_manager_class``: verl's manager running :class:`MMRefAgentLoopWorker`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import ray

        self.agent_loop_workers_class = ray.remote(MMRefAgentLoopWorker)
        super().__init__(*args, **kwargs)
