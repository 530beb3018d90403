"""The ``vllm.endpoint_plugins`` entry point (``mmref = vllm_plugin.plugin:MMRefEndpointPlugin``).

Loaded by the stock vLLM API server when ``VLLM_PLUGINS`` names ``mmref``. vLLM logs and
swallows plugin load failures, so start-up problems here are raised loudly from
``init_state`` (the server then refuses to start) instead of leaving the route missing.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from fastapi import FastAPI

from vllm_plugin import api_router

__all__ = ["MMRefEndpointPlugin"]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger


class MMRefEndpointPlugin:
    """Adds ref resolution to ``POST /inference/v1/generate`` and ``POST /inference/v1/resolve``."""

    name = "mmref"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        api_router.attach_router(app)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Build the resolver from the served model: its adapter wraps vLLM's own image processor.

        Raises:
            pydantic.ValidationError: bad ``MMREF_*`` settings (e.g. no ``MMREF_ASSET_ROOT``).
            UnsupportedFamily: the served model has no adapter.
            RuntimeError: settings under which refs would be unsafe or silently processed
                differently from vLLM (see :func:`_refuse_unsafe_settings`).
        """
        if engine_client is None:  # vLLM's CPU-only render server: no engine, no route
            state.mmref_resolver = None
            return
        from protocol.adapters import adapter_class
        from protocol.errors import UnsupportedFamily
        from vllm_plugin.config import PluginConfig
        from vllm_plugin.serving import MMRefResolver

        config = PluginConfig()
        model_config = engine_client.vllm_config.model_config
        _refuse_unsafe_settings(model_config)
        hf_config = model_config.hf_config
        renderer = engine_client.renderer
        mm_processor = renderer.get_mm_processor()
        if config.allowed_families is not None and hf_config.model_type not in config.allowed_families:
            raise UnsupportedFamily(
                f"served model type {hf_config.model_type!r} is not in MMREF_ALLOWED_FAMILIES "
                f"{config.allowed_families}"
            )
        adapter_cls = adapter_class(hf_config.model_type)
        adapter = adapter_cls(adapter_cls.served_image_processor(mm_processor), family=hf_config.model_type)
        device_normalize = bool(model_config.multimodal_config.mm_device_do_normalize)
        state.mmref_resolver = MMRefResolver(
            adapter,
            config,
            fields_config=lambda hf_inputs: mm_processor._get_mm_fields_config(hf_inputs, {}),
            device_normalize=device_normalize,
            placeholder_token_id=adapter.placeholder_token_id(hf_config),
            processor_cache=renderer.mm_processor_cache,
        )
        logger.info(
            "mmref: serving refs for %s (fingerprint %s, %s pixels, backend %s) from %s",
            adapter.family,
            adapter.fingerprint,
            "raw" if device_normalize else "normalized",
            adapter.backend,
            config.asset_root,
        )


def _refuse_unsafe_settings(model_config: Any) -> None:
    """Stop start-up where serving refs would be unsafe or silently wrong.

    - ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: vLLM's msgpack decoder would unpickle objects,
      and ``mmfile`` payloads come from a shared store (code execution for anyone who can write it).
    - ``--mm-processor-kwargs`` other than ``device``: vLLM passes them per call
      (``vllm/transformers_utils/processor.py``), the plugin calls the processor without them and
      the fingerprint cannot see them, so refs would be processed unlike vLLM's own path. Put such
      settings in the model's ``preprocessor_config.json``, which both sides read.

    Raises:
        RuntimeError: naming the setting.
    """
    import vllm.envs as envs

    if envs.VLLM_ALLOW_INSECURE_SERIALIZATION:
        raise RuntimeError(
            "mmref refuses VLLM_ALLOW_INSECURE_SERIALIZATION=1: mmfile feature payloads from the "
            "shared store would be unpickled"
        )
    kwargs = dict(getattr(model_config.multimodal_config, "mm_processor_kwargs", None) or {})
    kwargs.pop("device", None)
    if kwargs:
        raise RuntimeError(
            f"mmref does not apply --mm-processor-kwargs {sorted(kwargs)}: refs would be processed "
            "unlike vLLM's own path; set them in the model's preprocessor_config.json instead"
        )
