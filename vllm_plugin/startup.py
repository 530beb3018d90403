"""Start-up of the plugin: settings, refusals, and the serving object built from the running engine."""

from __future__ import annotations

import math
from argparse import Namespace
from typing import Any

from protocol.errors import UnsupportedFamily
from upstream import (
    invalidation_drain,
    load,
    mm_fields_config,
    mm_worker,
    served_image_processor,
    served_video_processor,
)
from vllm_plugin.config import PluginConfig
from vllm_plugin.engine_items import EngineItems
from vllm_plugin.feature_positions import PositionChecks
from vllm_plugin.items import ItemLayout
from vllm_plugin.preflight import refuse_insecure_serialization
from vllm_plugin.resolution import FeatureForm
from vllm_plugin.resolver import MMRefResolver
from vllm_plugin.seeds import SplitRule
from vllm_plugin.serving import MMRefServing
from vllm_plugin.serving_tokens import build_serving_tokens
from vllm_plugin.weights import VersionReader

__all__ = [
    "build_resolver",
    "build_serving",
    "default_body_limit",
    "engine_items",
    "refuse_unsafe_settings",
]

_PER_ITEM_OVERHEAD = 1024
"""JSON bytes one item adds beside its tensors (hash, range, msgpack framing, ``mm_metadata``)."""


def build_serving(engine_client: Any, state: Any, args: Namespace) -> MMRefServing:
    """The :class:`MMRefServing` for the served model.

    Raises:
        SettingError, UnsupportedFamily, RuntimeError: see ``plugin.init_state``.
    """
    config = PluginConfig()
    vllm_config = engine_client.vllm_config
    model_config = vllm_config.model_config
    refuse_unsafe_settings(model_config)
    model_type = model_config.hf_config.model_type
    if config.allowed_families is not None and model_type not in config.allowed_families:
        raise UnsupportedFamily(
            f"served model type {model_type!r} is not in MMREF_ALLOWED_FAMILIES {config.allowed_families}"
        )
    renderer = engine_client.renderer
    resolver = build_resolver(renderer.get_mm_processor(), model_config, config, renderer=renderer)
    items = engine_items(renderer, engine_client)
    body_limit = config.max_body_bytes or default_body_limit(
        max_model_len=model_config.max_model_len,
        bytes_per_placeholder=resolver.layout.float32_bytes_per_placeholder,
        max_image_bytes=config.max_image_bytes,
    )
    positions = PositionChecks(
        resolver,
        items,
        placeholder_token_id=resolver.adapter.placeholder_token_id(model_config.hf_config),
        ec_transfer=vllm_config.ec_transfer_config is not None,
    )
    form = FeatureForm(positions, video_token_id=getattr(model_config.hf_config, "video_token_id", None))
    return MMRefServing(
        form,
        serving_tokens=build_serving_tokens(engine_client, items, state, args),
        allowed_local_media_path=model_config.allowed_local_media_path or None,
        max_body_bytes=body_limit,
        weight_version=VersionReader(engine_client.get_weight_version),
        split_rule=SplitRule.for_engine(
            vllm_config,
            is_cpu=load("current_platform").is_cpu(),
            api_servers=int(getattr(args, "api_server_count", None) or 1),
        ),
    )


def build_resolver(
    mm_processor: Any, model_config: Any, config: PluginConfig, *, renderer: Any = None
) -> MMRefResolver:
    """The resolver for the served model: the adapter around the image processor vLLM serves with
    (:func:`~upstream.served_image_processor`), the item layout from vLLM's field config
    (:func:`~upstream.mm_fields_config`), the pixel mode of ``model_config``. A processor that must
    run on one thread (Kimi K2.5's numba kernel) runs on ``renderer``'s single multimodal worker
    (:func:`~upstream.mm_worker`), as vLLM's processing of chat images does; without a renderer
    (the benches: vLLM's engine-free processor) it runs in the resolver's own pool.

    Args:
        mm_processor: vLLM's multimodal processor (``renderer.get_mm_processor()`` or
            ``MULTIMODAL_REGISTRY.create_processor(model_config)``).
        model_config: vLLM's ``ModelConfig``.
        config: the plugin's settings.
        renderer: the engine's renderer, or None.

    Raises:
        UnsupportedFamily: the served model type has no adapter.
    """
    from protocol.adapters import VIDEO_FAMILIES, adapter_class

    model_type = model_config.hf_config.model_type
    adapter = adapter_class(model_type)(served_image_processor(mm_processor), family=model_type)
    video_processor = served_video_processor(mm_processor) if model_type in VIDEO_FAMILIES else None
    if video_processor is not None:  # vLLM's loader defaults (protocol.videos.VideoSampling)
        adapter.attach_video(video_processor)
    return MMRefResolver(
        adapter,
        config,
        layout=ItemLayout(adapter, mm_fields_config(mm_processor)),
        raw_pixels=bool(model_config.multimodal_config.mm_device_do_normalize),
        pool=mm_worker(renderer) if renderer is not None and adapter.serial_processing else None,
    )


def default_body_limit(*, max_model_len: int, bytes_per_placeholder: float, max_image_bytes: int) -> int:
    """The request body limit when ``MMREF_MAX_BODY_BYTES`` is unset: the largest body stock vLLM
    serves, so the plugin admits what stock admits.

    A ``features`` request carries at most ``max_model_len`` placeholder tokens (longer prompts are
    refused by the engine), each worth ``bytes_per_placeholder`` of float32 item tensors (what
    vLLM's processor and the renderers client emit at most), base64-encoded (x4/3), plus per-item
    framing, the token ids and 1 MiB of other fields. A ``content_parts`` request carries data
    URLs: at least one image of ``MMREF_MAX_IMAGE_BYTES`` must fit.

    Returns:
        bytes.
    """
    features = (
        math.ceil(4 / 3 * max_model_len * (bytes_per_placeholder + _PER_ITEM_OVERHEAD))
        + 12 * max_model_len
        + (1 << 20)
    )
    data_url = math.ceil(4 / 3 * max_image_bytes) + (1 << 20)
    return max(features, data_url)


def engine_items(renderer: Any, engine_client: Any) -> EngineItems:
    """The route's view of the engine's items, over vLLM's sender cache and its multimodal worker.

    vLLM runs every sender-cache operation on the renderer's single multimodal worker thread
    (the door's :func:`~upstream.mm_worker`); the hand-off parks that thread
    (``engine_items.py``) and there applies the cache-miss invalidations vLLM >= 0.33 defers
    (:func:`~upstream.invalidation_drain`). A renderer without such a worker gets
    no hand-off through the sender cache: items then always travel with their data.
    """
    return EngineItems(
        renderer.mm_processor_cache,
        executor=mm_worker(renderer),
        is_paused=engine_client.is_paused,
        on_stats=renderer.update_mm_cache_stats,
        drain=invalidation_drain(renderer),
    )


def refuse_unsafe_settings(model_config: Any) -> None:
    """Stop start-up where serving refs would be unsafe or silently wrong.

    - ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``
      (:func:`~vllm_plugin.preflight.refuse_insecure_serialization`, also run before the engine starts).
    - ``--mm-processor-kwargs`` other than ``device``: vLLM passes them per call
      (``vllm/transformers_utils/processor.py``), the plugin calls the processor without them and
      the fingerprint cannot see them, so refs would be processed unlike vLLM's own path. Put such
      settings in the model's ``preprocessor_config.json``, which both sides read.

    Raises:
        RuntimeError: naming the setting.
    """
    refuse_insecure_serialization()
    kwargs = dict(getattr(model_config.multimodal_config, "mm_processor_kwargs", None) or {})
    kwargs.pop("device", None)
    if kwargs:
        raise RuntimeError(
            f"mmref does not apply --mm-processor-kwargs {sorted(kwargs)}: refs would be processed "
            "unlike vLLM's own path; set them in the model's preprocessor_config.json instead"
        )
