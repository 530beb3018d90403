"""verl on an mmref server: agent-loop rollouts by ref, the actor's log-probs from the refs, the
weights pushed after each update (docs/INTEGRATIONS.md, "verl").

Three hooks, cited against verl 0.9.1 (the only range this module imports under, :data:`SUPPORTED`);
importing this module registers all three (``actor_rollout_ref.model.external_lib=integrations.verl``
imports it in every worker process: ``HFModelConfig.__post_init__``, verl/workers/config/model.py:149):

- :class:`MMRefAgentLoop`, agent name ``"mmref"`` (``@register``, verl/experimental/agent_loop/
  agent_loop.py:496; called per row by ``AgentLoopWorker._run_agent_loop``, line 689). Each row's
  prompt is built once per group (verl's ``uid``: the chat template, each image offloaded once by
  content) and sampled from the mmref server under ``X-Session-ID`` = the ``uid``; no request
  carries pixels. The output has no ``multi_modal_data``, so ``_compute_multi_modal_inputs``
  (line 862) never runs the processor over the images again; the row's
  :class:`~protocol.structs.TrainingSample` (msgpack bytes) rides in ``extra_fields["mmref_sample"]``,
  which ``_postprocess`` (line 1136) turns into a ``non_tensor_batch`` column. A row whose image
  cannot be read is a zero-loss stand-in (``response_mask`` 0).
- :class:`MMRefFSDPEngine`: verl's FSDP actor engine (``FSDPEngineWithLMHead``,
  verl/workers/engine/fsdp/transformer_impl.py:1144) whose ``forward_step`` (line 1549) computes
  ``model_output["log_probs"/"entropy"]`` with :func:`mmref_model_output` (materialize with dedup,
  the packed forward, temperature, the suppressed placeholder) instead of from
  ``multi_modal_inputs``; verl's loss function then runs unchanged. Registered for vendor
  ``"mmref"``: selected by ``VERL_ENGINE_VENDOR=mmref`` (``EngineRegistry.get_engine_cls``,
  verl/workers/engine/base.py:399), actor and reference model alike.
- :class:`MMRefCheckpointEngine`, backend ``"mmref"`` (``CheckpointEngineRegistry``,
  verl/checkpoint_engine/base.py:61): ``send_weights`` (called by
  ``ActorRolloutRefWorker.update_weights``, verl/workers/engine_workers.py:778) writes the actor's
  gathered weights as safetensors and pushes them through the plugin's update route, version
  ``<version_prefix><global_steps>``. :class:`MMRefCheckpointManager` (``rollout.
  checkpoint_manager_class``, read by verl/trainer/ppo/ray_trainer.py:969) calls only that, not
  verl's own replicas' sync.

Refused (ValueError naming the setting): ``top_p`` < 1, ``top_k`` > 0 (the server's logprobs would
not be the distribution the trainer computes), a prompt over ``rollout.prompt_length``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import torch
import verl

from integrations.common import (
    IMAGE_READ_ERRORS,
    MMRefSettings,
    WeightPusher,
    require_version,
    stand_in_sample,
    text_only,
)

SUPPORTED = ">=0.9.1,<0.10"
"""The verl releases this module is tested with (``pyproject.toml``'s ``verl`` extra)."""
require_version("verl", verl.__version__, SUPPORTED)

from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopBase,
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
    register,
)
from verl.utils.device import get_device_id, get_device_name  # noqa: E402
from verl.utils.ray_utils import auto_await  # noqa: E402
from verl.utils.tokenizer import get_processor_token_id  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.rollout.utils import ensure_async_iterator  # noqa: E402

from protocol.adapters import load_adapter  # noqa: E402
from protocol.structs import TrainingSample, decode_sample, encode  # noqa: E402
from rollout_client import AsyncRolloutClient, PreparedPrompt, Sampling  # noqa: E402
from trainer_lib import MaterializeConfig, PackingSpec, SampleForward, prepare_model_for_packing  # noqa: E402
from trainer_lib import sample_logprobs as packed_rows  # noqa: E402

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
]

_log = logging.getLogger("integrations.verl")

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


# --- the actor's log-probs --------------------------------------------------------------------------


def rows_of(batch: Any) -> list[TrainingSample]:
    """The rows' samples of a verl batch: ``batch[SAMPLE_FIELD]`` (the v0 trainer's column, a
    ``NonTensorStack`` once ``DataProto.to_tensordict`` ran, or a numpy object array) or each row's
    ``extra_fields`` dict (the v1 trainer's TransferQueue field).

    Raises:
        KeyError: the batch has no mmref samples (its rows were not sampled by :class:`MMRefAgentLoop`).
    """
    keys = batch.keys()
    if SAMPLE_FIELD in keys:
        column = batch[SAMPLE_FIELD]
    elif "extra_fields" in keys:
        column = [extra[SAMPLE_FIELD] for extra in _items(batch["extra_fields"])]
    else:
        raise KeyError(f"no {SAMPLE_FIELD!r} column: were the rows sampled by the 'mmref' agent loop?")
    return [decode_sample(bytes(b)) for b in _items(column)]


def _items(column: Any) -> list:
    tolist = getattr(column, "tolist", None)
    return list(tolist() if tolist is not None else column)


class MMRefActorForward:
    """What :class:`MMRefFSDPEngine` runs instead of the model's own forward (one per engine).

    Args:
        model_dir: the model's folder (its adapter and placeholder id).
        seq_len: the packed forward's token cap (default: verl's ``max_token_len_per_gpu``; a
            longer row gets its own micro-batch).
        config: materialize settings (default ``MaterializeConfig()``: the ``MMREF_*`` variables).
    """

    def __init__(
        self, model_dir: str | Path, *, seq_len: int = 8192, config: MaterializeConfig | None = None
    ):
        from transformers import AutoConfig

        self.adapter = load_adapter(model_dir)
        self.placeholder = self.adapter.placeholder_token_id(AutoConfig.from_pretrained(model_dir))
        self.seq_len = seq_len
        self.config = config or MaterializeConfig()
        self._specs: dict[int, PackingSpec] = {}

    def __call__(
        self, model: torch.nn.Module, micro_batch: Any, *, entropy: bool = False
    ) -> tuple[dict[str, torch.Tensor], SampleForward]:
        """verl's ``model_output`` of a micro-batch and the forward's report (see
        :func:`mmref_model_output`)."""
        inner = getattr(model, "_fsdp_wrapped_module", model)
        if id(inner) not in self._specs:
            prepare_model_for_packing(inner)
            self._specs[id(inner)] = PackingSpec.from_adapter(self.adapter, inner, pad_token_id=0)
        return mmref_model_output(
            rows_of(micro_batch),
            micro_batch["input_ids"],
            model,
            self._specs[id(inner)],
            self.config,
            seq_len=self.seq_len,
            temperature=_one_temperature(micro_batch["temperature"]),
            suppressed_token_ids=(self.placeholder,),
            entropy=entropy,
        )

    def step(
        self, model: torch.nn.Module, micro_batch: Any, loss_function: Any, dp_group: Any = None
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """What verl's ``forward_step`` returns (transformer_impl.py:1549) for one micro-batch: the
        loss of ``loss_function`` (verl's ``ppo_loss``...) over :func:`mmref_model_output`, rows
        whose image went missing since the rollout with ``response_mask``/``loss_mask`` zeroed
        (``placeholder_zero_loss``: their loss only), and ``{"model_output", "loss", "metrics"}``.

        Raises:
            ValueError: top-K distillation asked for.
        """
        from verl.utils import tensordict_utils as tu
        from verl.workers.engine.utils import detach_tree

        if tu.get_non_tensor_data(micro_batch, "distillation_use_topk", False):
            raise ValueError("mmref's forward does not support top-K distillation")
        entropy = bool(tu.get_non_tensor_data(micro_batch, "calculate_entropy", False))
        model_output, forward = self(model, micro_batch, entropy=entropy)
        for key in ("response_mask", "loss_mask"):
            if forward.zeroed and key in micro_batch.keys():
                micro_batch[key] = zero_rows(micro_batch[key], forward.zeroed)
        if loss_function is not None:
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=dp_group)
        else:
            loss, metrics = torch.tensor(1.0), {}
        metrics = {
            **metrics,
            "mmref/zeroed_rows": len(forward.zeroed),
            "mmref/pixel_bytes": forward.pixel_bytes,
        }
        output = {"model_output": detach_tree(model_output), "loss": float(loss.detach()), "metrics": metrics}
        return loss, output


def mmref_model_output(
    rows: Sequence[TrainingSample],
    input_ids: torch.Tensor,
    model: torch.nn.Module,
    spec: PackingSpec,
    config: MaterializeConfig,
    *,
    seq_len: int,
    temperature: float,
    suppressed_token_ids: Sequence[int] = (),
    entropy: bool = False,
) -> tuple[dict[str, torch.Tensor], SampleForward]:
    """The rows through :func:`trainer_lib.sample_logprobs`, in the layout of verl's
    ``prepare_model_outputs`` (transformer_impl.py:1332, ``use_remove_padding``): ``log_probs`` (and
    ``entropy``) float32 jagged nested tensors ``[B, L_b]`` over each row's whole sequence, entry
    ``t`` the logprob of token ``t + 1`` (verl's rolled labels) and the entropy of the distribution
    it was drawn from; the last entry 0; gradients kept.
    verl's ``no_padding_2_padding`` cuts them to ``[B, response_length]``.

    Args:
        rows: the batch's samples (:func:`rows_of`), in its row order.
        input_ids: verl's jagged nested ``[B, L_b]`` ids; each row's must be its sample's.

    Raises:
        RuntimeError: a row's ids are not its sample's (the batch was reordered without them).
    """
    ids = input_ids.unbind() if input_ids.is_nested else list(input_ids)
    if len(ids) != len(rows):
        raise RuntimeError(f"{len(ids)} rows in verl's batch, {len(rows)} mmref samples")
    for b, (row, seq) in enumerate(zip(rows, ids, strict=True)):
        if seq.tolist() != row.input_ids:
            raise RuntimeError(f"row {b}: verl's input_ids are not its mmref sample's")
    longest = max(len(r.input_ids) for r in rows)
    forward = packed_rows(
        rows,
        model,
        spec,
        config,
        seq_len=max(seq_len, longest),
        temperature=temperature,
        suppressed_token_ids=suppressed_token_ids,
        compute_entropy=entropy,
    )
    offsets = torch.tensor([0, *torch.tensor([len(r.input_ids) for r in rows]).cumsum(0).tolist()])

    def jagged(values: list[torch.Tensor]) -> torch.Tensor:
        """Each row's ``[n]`` values (entry t about token t) left-shifted by one (about token t + 1)."""
        flat = torch.cat([torch.cat([v[1:], v.new_zeros(1)]) for v in values]).float()
        return torch.nested.nested_tensor_from_jagged(flat, offsets.to(flat.device))

    out = {"log_probs": jagged([s.logprobs for s in forward.samples])}
    if entropy:
        out["entropy"] = jagged([s.entropy for s in forward.samples])
    return out, forward


def _one_temperature(value: Any) -> float:
    """verl's micro-batch temperature (a number, or one per row that must all agree)."""
    if isinstance(value, torch.Tensor):
        values = set(value.flatten().tolist())
        if len(values) != 1:
            raise ValueError(f"per-row temperatures {sorted(values)}: mmref's packed forward takes one")
        return float(values.pop())
    return float(value)


def zero_rows(mask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """``mask`` (padded ``[B, R]`` or jagged nested) with rows ``rows`` set to 0."""
    if not rows:
        return mask
    if not mask.is_nested:
        out = mask.clone()
        out[list(rows)] = 0
        return out
    values, offsets = mask.values().clone(), mask.offsets()
    for r in rows:
        values[offsets[r] : offsets[r + 1]] = 0
    return torch.nested.nested_tensor_from_jagged(values, offsets)


_ENGINE_DEVICES = ("cuda", "npu", "cpu")


def _engine_slot(cls: type) -> type:
    """Register ``cls`` for vendor ``"mmref"`` (a reload of this module replaces the earlier class:
    verl's registry refuses a key twice)."""
    table = EngineRegistry._engines.get("language_model", {})
    for backend in ("fsdp", "fsdp2"):
        for device in _ENGINE_DEVICES:
            table.get(backend, {}).pop((device, "mmref"), None)
    register_engine = EngineRegistry.register(
        model_type="language_model", backend=["fsdp", "fsdp2"], device=list(_ENGINE_DEVICES), vendor="mmref"
    )
    return register_engine(cls)


@_engine_slot
class MMRefFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP language-model engine with :meth:`forward_step` computing the log-probs from the
    rows' refs (module docstring). Not supported: Ulysses sequence parallelism, fused kernels and
    top-K distillation (refused at the first step)."""

    def forward_step(
        self, micro_batch: Any, loss_function: Any, forward_only: bool
    ) -> tuple[torch.Tensor, dict]:
        from verl.utils import tensordict_utils as tu

        if self.use_ulysses_sp or tu.get_non_tensor_data(micro_batch, "use_fused_kernels", False):
            raise ValueError(
                "mmref's forward supports neither Ulysses sequence parallelism nor fused kernels"
            )
        if not hasattr(self, "mmref_forward"):
            cap = self.engine_config.max_token_len_per_gpu or 8192
            self.mmref_forward = MMRefActorForward(self.model_config.local_path, seq_len=cap)
        dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        with torch.autocast(device_type=get_device_name(), dtype=dtype, enabled=dtype != torch.float32):
            return self.mmref_forward.step(
                self.module, micro_batch.to(get_device_id()), loss_function, self.get_data_parallel_group()
            )


# --- weight sync ------------------------------------------------------------------------------------


@CheckpointEngineRegistry.register("mmref")
class MMRefCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine that pushes the actor's weights to an mmref server.

    Every actor rank drains the weights generator (under FSDP each ``full_tensor()`` is a
    collective); the master rank writes them (safetensors shards of ``bucket_size``... at least
    1 GiB) and pushes them. ``receive_weights`` yields nothing: the server reloads from the folder.

    Args:
        bucket_size, is_master: as verl passes them (``engine_workers.py:686``).
        server_url: the mmref server; weights_dir: checkpoints as the server sees them;
        push_timeout_s, keep_checkpoints, version_prefix: as :class:`MMRefSettings`
        (``rollout.checkpoint_engine.engine_kwargs.mmref``).
    """

    def __init__(
        self,
        bucket_size: int = 1 << 30,
        is_master: bool = False,
        *,
        server_url: str,
        weights_dir: str,
        push_timeout_s: float = 120.0,
        keep_checkpoints: int = 2,
        version_prefix: str = "step-",
        **unused: Any,
    ) -> None:
        self.is_master = is_master
        self.shard_bytes = max(int(bucket_size), 1 << 30)
        self.version_prefix = version_prefix
        self.pusher = WeightPusher(
            httpx.Client(base_url=server_url),
            Path(weights_dir),
            timeout_s=push_timeout_s,
            keep=keep_checkpoints,
        )
        self.records: list = []

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list
    ) -> tuple[dict, dict]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Write and push ``weights`` (``(name, tensor)`` pairs) as ``<version_prefix><global_steps>``."""
        tensors = []
        async for name, tensor in ensure_async_iterator(weights):
            if self.is_master:
                tensors.append((name, tensor.detach().to("cpu", copy=True)))
        if not self.is_master:
            return {}
        version = f"{self.version_prefix}{global_steps or 0}"
        record = await asyncio.to_thread(
            self.pusher.push_tensors, tensors, version, shard_bytes=self.shard_bytes
        )
        self.records.append(record)
        return {"mmref/save_seconds": record.save_seconds, "mmref/push_seconds": record.push_seconds}

    async def receive_weights(self, global_steps: int | None = None) -> Any:
        return
        yield


class MMRefCheckpointManager(CheckpointEngineManager):
    """``rollout.checkpoint_manager_class``: the weight sync is the actor workers' push
    (:class:`MMRefCheckpointEngine`) alone; verl's own rollout replicas, unused by
    :class:`MMRefAgentLoop`, are not synced."""

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict:
        import ray

        results = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend))
        return {k: v for r in results if isinstance(r, dict) for k, v in r.items()}
