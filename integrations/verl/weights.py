"""The actor's weights to the mmref server after each update (verl/checkpoint_engine/base.py, 0.9.1).

:class:`MMRefCheckpointEngine` (backend ``"mmref"``, ``CheckpointEngineRegistry.register``, line 60):
``send_weights`` (called by ``ActorRolloutRefWorker.update_weights``,
verl/workers/engine_workers.py:765, with ``get_per_tensor_param``'s gathered tensors) writes them as
safetensors and pushes them through the plugin's update route as ``<version_prefix><global_steps>``.
:class:`MMRefCheckpointManager` (``rollout.checkpoint_manager_class``, read by the legacy trainer,
verl/trainer/ppo/ray_trainer.py:969) runs only that push, not verl's own replicas' sync. verl's v1
sync trainer forces the ``naive`` backend and the built-in manager
(verl/trainer/ppo/v1/trainer_base.py:382): with it the push does not run (docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.ray_utils import auto_await
from verl.workers.rollout.utils import ensure_async_iterator

from integrations.common import WeightPusher

__all__ = ["MMRefCheckpointEngine", "MMRefCheckpointManager"]


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
