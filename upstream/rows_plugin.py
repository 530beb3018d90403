"""The plugin's rows: every vLLM name ``vllm_plugin/`` relies on (imported through the door, or
read as an attribute of an object vLLM hands it). Files only in ``used_in``: line numbers drift."""

from __future__ import annotations

from upstream.model import Touchpoint, Variant, row

__all__ = ["PLUGIN"]

_DOOR = "upstream/door.py"
_TIT = "vllm.entrypoints.scale_out.token_in_token_out"
_TIT_FILE = "vllm/entrypoints/scale_out/token_in_token_out"
_LLM, _LLM_FILE = "vllm.v1.engine.async_llm:AsyncLLM", "vllm/v1/engine/async_llm.py"
_CACHE = "vllm.multimodal.cache"
_INPUTS, _INPUTS_FILE = "vllm.multimodal.inputs", "vllm/multimodal/inputs.py"
_MEDIA, _MEDIA_FILE = "vllm.multimodal.media.connector", "vllm/multimodal/media/connector.py"
_SERVING_TOKENS_KEYWORDS = (
    "request_logger",
    "return_tokens_as_token_ids",
    "enable_prompt_tokens_details",
    "enable_log_outputs",
    "force_no_detokenize",
)
_INPUT_USERS = ("vllm_plugin/serving_tokens.py", "vllm_plugin/engine_items.py")
_CLI_ARGS_033 = (Variant(">=0.33", module="vllm.entrypoints.common.cli_args"),)


def _attrs(owner: str, upstream: str, used_in: tuple[str, ...], *names: str) -> tuple[Touchpoint, ...]:
    """Attribute rows of one class read by the same files."""
    return tuple(row(f"{owner}.{name}", "attribute", upstream, *used_in) for name in names)


# fmt: off
_ENTRY: tuple[Touchpoint, ...] = (
    # --- plugin.py: the entry point and its contract ----------------------------------------------------
    row("vllm:__version__", "constant", "vllm/_version.py", _DOOR, "vllm_plugin/preflight.py",
        "tests/plugin/test_plugin.py",
        key="vllm.__version__", accessor="vllm_version"),
    row("vllm.plugins:ENDPOINT_PLUGINS_GROUP", "constant", "vllm/plugins/__init__.py", "pyproject.toml",
        side="plugin", spelled="vllm.endpoint_plugins",
        reached_as='the entry-point group mmref registers under ("vllm.endpoint_plugins")'),
    row("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.name", "attribute",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py"),
    row("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.required_tasks", "attribute",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py"),
    row("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.attach_router", "method",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py",
        reached_as="vLLM calls MMRefEndpointPlugin.attach_router(app)", positional=1,
        positional_names=("app",)),
    row("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.init_state", "method",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py",
        reached_as="vLLM awaits MMRefEndpointPlugin.init_state(engine_client, state, args)", positional=3,
        positional_names=("engine_client", "state", "args")),
    row("vllm.envs:VLLM_SERVER_DEV_MODE", "constant", "vllm/envs.py", "vllm_plugin/plugin.py",
        key="envs.VLLM_SERVER_DEV_MODE"),
    # --- preflight.py: the settings checked while vLLM builds its argument parser --------------------------
    row("vllm.plugins:DEFAULT_PLUGINS_GROUP", "constant", "vllm/plugins/__init__.py", "pyproject.toml",
        side="plugin", spelled="vllm.general_plugins",
        reached_as='the entry-point group of the start-up check ("vllm.general_plugins"), called by '
                   "load_general_plugins() from AsyncEngineArgs.add_cli_args, uncaught"),
    row("vllm.envs:VLLM_PLUGINS", "constant", "vllm/envs.py", "vllm_plugin/preflight.py",
        key="envs.VLLM_PLUGINS"),
    row(f"{_LLM}.get_supported_tasks", "method", _LLM_FILE, "vllm_plugin/plugin.py",
        "vllm_plugin/serving_tokens.py", reached_as="await engine_client.get_supported_tasks()",
        positional=0),
    # --- startup.py, seeds.py: the serving object from the running engine -------------------------------
    row("vllm.platforms:current_platform", "constant", "vllm/platforms/__init__.py",
        "vllm_plugin/startup.py"),
    row("vllm.platforms.interface:Platform.is_cpu", "method", "vllm/platforms/interface.py",
        "vllm_plugin/startup.py", reached_as="current_platform.is_cpu()", positional=0),
    row(f"{_LLM}.vllm_config", "attribute", _LLM_FILE, "vllm_plugin/startup.py",
        reached_as="engine_client.vllm_config"),
    row("vllm.config:VllmConfig.model_config", "attribute", "vllm/config/vllm.py", "vllm_plugin/startup.py",
        "vllm_plugin/seeds.py"),
    *_attrs("vllm.config:VllmConfig", "vllm/config/vllm.py", ("vllm_plugin/seeds.py",), "scheduler_config",
            "cache_config"),
    row("vllm.config:VllmConfig.ec_transfer_config", "attribute", "vllm/config/vllm.py",
        "vllm_plugin/startup.py"),
    *_attrs("vllm.config:ModelConfig", "vllm/config/model.py", ("vllm_plugin/startup.py",), "hf_config",
            "multimodal_config", "allowed_local_media_path"),
    row("vllm.config:ModelConfig.max_model_len", "attribute", "vllm/config/model.py",
        "vllm_plugin/startup.py",
        "vllm_plugin/seeds.py"),
    row("vllm.config:ModelConfig.is_hybrid", "attribute", "vllm/config/model.py", "vllm_plugin/seeds.py"),
    row("vllm.config:ModelConfig.get_diff_sampling_param", "method", "vllm/config/model.py",
        "vllm_plugin/seeds.py", reached_as="model_config.get_diff_sampling_param().get('temperature', 1.0)",
        positional=0),
    row("vllm.config:MultiModalConfig.mm_device_do_normalize", "attribute", "vllm/config/multimodal.py",
        "vllm_plugin/startup.py", reached_as="model_config.multimodal_config.mm_device_do_normalize"),
    row("vllm.config:MultiModalConfig.mm_processor_kwargs", "attribute", "vllm/config/multimodal.py",
        "vllm_plugin/startup.py",
        reached_as="getattr(model_config.multimodal_config, 'mm_processor_kwargs', None)"),
    *_attrs("vllm.config:SchedulerConfig", "vllm/config/scheduler.py", ("vllm_plugin/seeds.py",),
            "max_num_batched_tokens", "max_num_scheduled_tokens", "enable_chunked_prefill",
            "long_prefill_token_threshold", "max_num_seqs", "max_num_encoder_input_tokens",
            "encoder_cache_size"),
    *_attrs("vllm.config:CacheConfig", "vllm/config/cache.py", ("vllm_plugin/seeds.py",), "mamba_cache_mode",
            "block_size"),
    row("vllm.envs:VLLM_ALLOW_INSECURE_SERIALIZATION", "constant", "vllm/envs.py", "vllm_plugin/preflight.py",
        key="envs.VLLM_ALLOW_INSECURE_SERIALIZATION"),
    row(f"{_LLM}.get_weight_version", "method", _LLM_FILE, "vllm_plugin/startup.py", positional=0),
    # --- startup.py and the door: the renderer, its processor, its sender cache and worker ----------------
    row(f"{_LLM}.renderer", "attribute", _LLM_FILE, "vllm_plugin/startup.py",
        reached_as="engine_client.renderer"),
    row("vllm.renderers.base:BaseRenderer.get_mm_processor", "method", "vllm/renderers/base.py",
        "vllm_plugin/startup.py", reached_as="engine_client.renderer.get_mm_processor()", positional=0),
    row("vllm.multimodal.processing:BaseMultiModalProcessor.info", "attribute",
        "vllm/multimodal/processing/processor.py", _DOOR, "vllm_plugin/startup.py",
        reached_as="mm_processor.info", accessor="served_image_processor"),
    row("vllm.multimodal.processing:BaseProcessingInfo.get_hf_processor", "method",
        "vllm/multimodal/processing/context.py", _DOOR, "vllm_plugin/startup.py",
        reached_as="mm_processor.info.get_hf_processor().image_processor", accessor="served_image_processor",
        positional=0),
    row("vllm.model_executor.models.kimi_k25:KimiK25ProcessingInfo.image_processor", "attribute",
        "vllm/model_executor/models/kimi_k25.py", _DOOR, "vllm_plugin/startup.py",
        reached_as="getattr(mm_processor.info, 'image_processor', None)", accessor="served_image_processor"),
    row("vllm.multimodal.processing:BaseMultiModalProcessor._get_mm_fields_config", "method",
        "vllm/multimodal/processing/processor.py", _DOOR, "vllm_plugin/startup.py", "bench/item_check.py",
        "tests/plugin/conftest.py",
        reached_as="mm_processor._get_mm_fields_config(hf_inputs, {})", accessor="mm_fields_config",
        positional=2,
        positional_names=("hf_inputs", "hf_processor_mm_kwargs"), private=True,
        why=("the served model's field layout (which tensor is flat over which grid) is declared only here; "
             "MultiModalKwargsItems.from_hf_inputs needs it to build an item exactly as vLLM's processor "
             "does, and no public method returns it")),
    row("vllm.renderers.base:BaseRenderer._mm_executor", "attribute", "vllm/renderers/base.py", _DOOR,
        "vllm_plugin/startup.py", reached_as="getattr(renderer, '_mm_executor', None)", accessor="mm_worker",
        private=True,
        why=("every sender-cache (P0) operation of vLLM runs on this single worker thread; the hand-off must "
             "run on it (parked) to stay in order with vLLM's own processing and cache clears, and no public "
             "API exposes it (read with getattr: without it items travel with data)")),
    row("vllm.renderers.base:BaseRenderer._drain_mm_cache_invalidations", "method", "vllm/renderers/base.py",
        _DOOR, "vllm_plugin/startup.py", key="renderer._drain_mm_cache_invalidations",
        accessor="invalidation_drain", positional=0, private=True, since=">=0.33",
        why=("0.33 defers the invalidation of an engine cache miss in P0 (queue_mm_cache_invalidations) "
             "until vLLM's own multimodal processing drains the queue; the plugin's hand-off and null-slot "
             "lookups must drain it too, with vLLM's worker parked, and no public method does")),
    row("vllm.renderers.base:BaseRenderer.mm_processor_cache", "attribute", "vllm/renderers/base.py",
        "vllm_plugin/startup.py", reached_as="engine_client.renderer.mm_processor_cache"),
    row("vllm.renderers.base:BaseRenderer.update_mm_cache_stats", "method", "vllm/renderers/base.py",
        "vllm_plugin/startup.py", positional=0),
    row(f"{_LLM}.is_paused", "method", _LLM_FILE, "vllm_plugin/startup.py", positional=0),
)

_TOKENS: tuple[Touchpoint, ...] = (
    # --- serving_tokens.py: vLLM's ServingTokens over the hand-off client -----------------------------------
    row(f"{_TIT}.serving:ServingTokens", "class", f"{_TIT_FILE}/serving.py", "vllm_plugin/serving_tokens.py"),
    row(f"{_TIT}.serving:ServingTokens.__init__", "method", f"{_TIT_FILE}/serving.py",
        "vllm_plugin/serving_tokens.py", _DOOR, accessor="serving_tokens_keywords", positional=3,
        positional_names=("engine_client", "models", "online_renderer"), keywords=_SERVING_TOKENS_KEYWORDS,
        variants=(Variant(">=0.33", keywords=("online_derenderer", *_SERVING_TOKENS_KEYWORDS),
                          note="online_derenderer: a required keyword-only parameter "
                          "(state.online_derenderer)"),)),
    row(f"{_TIT}.serving:ServingTokens.serve_tokens", "method", f"{_TIT_FILE}/serving.py",
        "vllm_plugin/serving.py",
        positional=2, positional_names=("request", "raw_request")),
    row(f"{_TIT}.serving:ServingTokens.request_logger", "attribute",
        "vllm/entrypoints/serve/engine/serving.py",
        "vllm_plugin/serving_tokens.py", reached_as="app.state.serving_tokens.request_logger"),
    row("vllm.entrypoints.scale_out.factories:init_scale_out_state", "assigned",
        "vllm/entrypoints/scale_out/factories.py", "vllm_plugin/serving_tokens.py",
        reached_as="getattr(app.state, 'serving_tokens', None)", attr="serving_tokens", optional=True),
    *(row("vllm.entrypoints.launchers.api_server.app_state:init_app_state", "assigned",
          "vllm/entrypoints/launchers/api_server/app_state.py", *users, reached_as=f"app.state.{attr}",
          attr=attr, accessor=accessor)
      for attr, users, accessor in (
          ("openai_serving_models", ("vllm_plugin/serving_tokens.py",), ""),
          ("online_renderer", ("vllm_plugin/serving_tokens.py",), ""),
          ("online_derenderer", (_DOOR, "vllm_plugin/serving_tokens.py"), "serving_tokens_keywords"))),
    *(row(f"vllm.entrypoints.launchers.cli_args:BaseFrontendArgs.{name}", "attribute",
          "vllm/entrypoints/launchers/cli_args.py", "vllm_plugin/serving_tokens.py", key=f"args.{name}",
          reached_as=f"args.{name}", variants=_CLI_ARGS_033)
      for name in ("return_tokens_as_token_ids", "enable_prompt_tokens_details", "enable_log_outputs",
                   "tokens_only")),
    row(f"{_LLM}.generate", "method", _LLM_FILE, "vllm_plugin/serving_tokens.py",
        reached_as=("HandOffClient.generate(engine_input, sampling_params, request_id, **kwargs): args[:2] "
                    "are "
                    "read as (sampling_params, request_id)"),
        positional=3, positional_names=("prompt", "sampling_params", "request_id"),
        keywords=("lora_request", "priority", "data_parallel_rank", "session_id")),
    *(row(f"vllm.inputs.engine:MultiModalInput.{key}", "attribute", "vllm/inputs/engine.py", *users,
          reached_as=f'engine_input["{key}"]')
      for key, users in (("mm_kwargs", _INPUT_USERS), ("mm_hashes", _INPUT_USERS),
                         ("mm_placeholders", ("vllm_plugin/engine_items.py",)))),
    row(f"{_LLM}.input_processor", "attribute", _LLM_FILE, "vllm_plugin/serving_tokens.py",
        reached_as="engine_client.input_processor"),
    row("vllm.v1.engine.input_processor:InputProcessor.process_inputs", "method",
        "vllm/v1/engine/input_processor.py",
        "vllm_plugin/serving_tokens.py", reached_as="engine_client.input_processor.process_inputs(...)",
        positional=3, positional_names=("request_id", "prompt", "params"),
        keywords=("supported_tasks", "lora_request", "priority", "data_parallel_rank", "session_id")),
    row(f"{_LLM}.check_admission", "method", _LLM_FILE, "vllm_plugin/serving_tokens.py",
        reached_as="engine_client.check_admission(n)", positional=1, positional_names=("n",)),
    row("vllm.sampling_params:SamplingParams.n", "attribute", "vllm/sampling_params.py",
        "vllm_plugin/serving_tokens.py", reached_as="getattr(sampling_params, 'n', 1)"),
    *_attrs("vllm.sampling_params:SamplingParams", "vllm/sampling_params.py", ("vllm_plugin/seeds.py",),
            "seed",
            "temperature", "max_tokens"),
    # --- updates.py: the weight-update routes -------------------------------------------------------------
    row(f"{_LLM}.pause_generation", "method", _LLM_FILE, "vllm_plugin/updates.py", positional=0,
        keywords=("mode", "clear_cache"), named=("mode", "clear_cache")),
    *(row(f"{_LLM}.{name}", "method", _LLM_FILE, "vllm_plugin/updates.py", positional=0)
      for name in ("resume_generation", "reset_encoder_cache", "reset_prefix_cache")),
    row(f"{_LLM}.update_weight_version", "method", _LLM_FILE, "vllm_plugin/updates.py", positional=1),
    row(f"{_LLM}.collective_rpc", "method", _LLM_FILE, "vllm_plugin/updates.py", positional=1,
        positional_names=("method",), keywords=("kwargs",), named=("kwargs",)),
    row("vllm.v1.worker.gpu_worker:Worker.reload_weights", "method", "vllm/v1/worker/gpu_worker.py",
        "vllm_plugin/updates.py", reached_as="collective_rpc('reload_weights', kwargs={'weights_path': ...})",
        positional=0, keywords=("weights_path",)),
    row("vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights", "method",
        "vllm/v1/worker/gpu_model_runner.py", "vllm_plugin/updates.py", key="GPUModelRunner.reload_weights",
        reached_as="Worker.reload_weights(**kwargs) passes them on (CPUModelRunner inherits it)",
        positional=0,
        keywords=("weights_path",), named=("weights_path",)),
)

_ITEMS: tuple[Touchpoint, ...] = (
    # --- engine_items.py: the sender cache (P0) -----------------------------------------------------------
    row(f"{_CACHE}:LruKeyReplicatedSenderCache", "class", "vllm/multimodal/cache/lru.py",
        "vllm_plugin/engine_items.py", "tests/plugin/test_engine_items.py"),
    row(f"{_CACHE}:ShmObjectStoreSenderCache", "class", "vllm/multimodal/cache/shm.py",
        "vllm_plugin/engine_items.py"),
    row(f"{_CACHE}:MultiModalProcessorOnlyCache", "class", "vllm/multimodal/cache/base.py",
        "vllm_plugin/engine_items.py", "tests/plugin/test_engine_items.py"),
    row(f"{_CACHE}:LruKeyReplicatedSenderCache.is_cached_item", "method", "vllm/multimodal/cache/lru.py",
        "vllm_plugin/engine_items.py", key="sender.is_cached_item",
        reached_as="renderer.mm_processor_cache.is_cached_item(mm_hash)", positional=1),
    row(f"{_CACHE}:ShmObjectStoreSenderCache.is_cached_item", "method", "vllm/multimodal/cache/shm.py",
        "vllm_plugin/engine_items.py", key="shm.is_cached_item",
        reached_as="renderer.mm_processor_cache.is_cached_item(mm_hash)", positional=1),
    row(f"{_CACHE}:LruKeyReplicatedSenderCache.get_and_update_item", "method", "vllm/multimodal/cache/lru.py",
        "vllm_plugin/engine_items.py", key="sender.get_and_update_item",
        reached_as="renderer.mm_processor_cache.get_and_update_item((item, []), mm_hash)", positional=2,
        positional_names=("mm_item", "mm_hash")),
    row(f"{_CACHE}:LruKeyReplicatedSenderCache.touch_sender_cache_item", "method",
        "vllm/multimodal/cache/lru.py",
        "vllm_plugin/engine_items.py", key="sender.touch_sender_cache_item", positional=1),
    row(f"{_CACHE}:LruKeyReplicatedSenderCache.release_sender_touches", "method",
        "vllm/multimodal/cache/base.py",
        "vllm_plugin/engine_items.py", key="sender.release_sender_touches", positional=0),
    row(f"{_CACHE}:LruKeyReplicatedSenderCache.invalidate", "method", "vllm/multimodal/cache/lru.py",
        "vllm_plugin/engine_items.py", key="sender.invalidate", positional=1),
    row("vllm.multimodal.processing.processor:ResolvedPromptUpdate.content", "attribute",
        "vllm/multimodal/processing/processor.py", "vllm_plugin/engine_items.py",
        reached_as="the prompt updates P0 recorded for an item (get_and_update_item(None, mm_hash)[1])"),
    *_attrs("vllm.multimodal.processing:PromptUpdateDetails", "vllm/multimodal/processing/processor.py",
            ("vllm_plugin/engine_items.py",), "full", "is_embed"),
    row("vllm.utils.cache:LRUCache", "class", "vllm/utils/cache.py", "vllm_plugin/engine_items.py",
        positional=1),
    row("vllm.utils.cache:LRUCache.put", "method", "vllm/utils/cache.py", "vllm_plugin/engine_items.py",
        positional=2),
    row("vllm.utils.cache:LRUCache.get", "method", "vllm/utils/cache.py", "vllm_plugin/engine_items.py",
        positional=1),
    row("vllm.multimodal.utils:argsort_mm_positions", "function", "vllm/multimodal/utils.py",
        "vllm_plugin/engine_items.py", "tests/plugin/test_engine_items.py", positional=1),
    row(f"{_INPUTS}:MultiModalFieldElem", "class", _INPUTS_FILE, "vllm_plugin/engine_items.py", positional=0,
        keywords=("data", "field")),
    row(f"{_INPUTS}:MultiModalSharedField", "class", _INPUTS_FILE, "vllm_plugin/engine_items.py",
        positional=0,
        keywords=("batch_size",)),
    row(f"{_INPUTS}:MultiModalKwargsItem", "class", _INPUTS_FILE, "vllm_plugin/engine_items.py",
        "vllm_plugin/items.py", "vllm_plugin/feature_positions.py", "tests/plugin/test_engine_items.py",
        positional=1),
    # --- items.py, resolver.py: vLLM's item codec and field layout ---------------------------------------
    row("vllm.v1.serial_utils:MsgpackEncoder", "class", "vllm/v1/serial_utils.py", "vllm_plugin/items.py",
        positional=0, keywords=("size_threshold",)),
    row("vllm.v1.serial_utils:MsgpackEncoder.encode", "method", "vllm/v1/serial_utils.py",
        "vllm_plugin/items.py",
        positional=1),
    row("vllm.v1.serial_utils:MsgpackDecoder", "class", "vllm/v1/serial_utils.py", "vllm_plugin/items.py",
        positional=0, keywords=("t",)),
    row("vllm.v1.serial_utils:MsgpackDecoder.decode", "method", "vllm/v1/serial_utils.py",
        "vllm_plugin/items.py",
        positional=1),
    row(f"{_INPUTS}:MultiModalKwargsItems.from_hf_inputs", "method", _INPUTS_FILE, "vllm_plugin/items.py",
        "vllm_plugin/resolver.py", "bench/server.py", "bench/item_check.py", "tests/plugin/test_items.py",
        positional=2),
    row(f"{_INPUTS}:MultiModalFlatField", "class", _INPUTS_FILE, "vllm_plugin/items.py"),
    *_attrs(f"{_INPUTS}:MultiModalFlatField", _INPUTS_FILE, ("vllm_plugin/items.py",), "dim", "slices"),
    row(f"{_INPUTS}:BaseMultiModalField.reduce_data", "method", _INPUTS_FILE, "vllm_plugin/items.py",
        reached_as="elem.field.reduce_data([elem])", positional=1),
    row(f"{_INPUTS}:MultiModalFieldElem.data", "attribute", _INPUTS_FILE, "vllm_plugin/items.py",
        "vllm_plugin/resolver.py"),
    row(f"{_INPUTS}:MultiModalFieldElem.field", "attribute", _INPUTS_FILE, "vllm_plugin/items.py"),
    row("vllm.utils.torch_utils:set_default_torch_num_threads", "function", "vllm/utils/torch_utils.py",
        "vllm_plugin/resolver.py", positional=0),
)

_ROUTE: tuple[Touchpoint, ...] = (
    # --- protocol.py, serving.py, resolution.py, feature_positions.py, seeds.py: the token schema ---
    row(f"{_TIT}.protocol:GenerateRequest", "class", f"{_TIT_FILE}/protocol.py", "vllm_plugin/protocol.py",
        reached_as="subclassed by MMRefGenerateRequest (adds mm_refs)"),
    row(f"{_TIT}.protocol:GenerateRequest.token_ids", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/serving.py", "vllm_plugin/seeds.py"),
    row(f"{_TIT}.protocol:GenerateRequest.features", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/serving.py", "vllm_plugin/seeds.py"),
    row(f"{_TIT}.protocol:GenerateRequest.content_parts", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/serving.py", "vllm_plugin/seeds.py"),
    row(f"{_TIT}.protocol:GenerateRequest.cache_salt", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/serving.py"),
    row(f"{_TIT}.protocol:GenerateRequest.sampling_params", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/seeds.py"),
    row(f"{_TIT}.protocol:GenerateRequest.is_sampling_param_provided", "method", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/seeds.py", positional=1),
    row(f"{_TIT}.protocol:MultiModalFeatures", "class", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/resolution.py", positional=0,
        keywords=("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata")),
    *_attrs(f"{_TIT}.protocol:MultiModalFeatures", f"{_TIT_FILE}/protocol.py",
            ("vllm_plugin/serving.py", "vllm_plugin/resolution.py", "vllm_plugin/feature_positions.py"),
            "mm_hashes", "kwargs_data", "mm_metadata"),
    row(f"{_TIT}.protocol:MultiModalFeatures.mm_placeholders", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/resolution.py", "vllm_plugin/feature_positions.py", "vllm_plugin/seeds.py"),
    row(f"{_TIT}.protocol:PlaceholderRangeInfo.offset", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/resolution.py"),
    row(f"{_TIT}.protocol:PlaceholderRangeInfo.length", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/resolution.py", "vllm_plugin/seeds.py"),
    # --- serving.py, api_router.py, weights.py: the answer --------------------------------------------------
    row(f"{_TIT}.protocol:GenerateResponseBase", "class", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/serving.py",
        "vllm_plugin/api_router.py"),
    row(f"{_TIT}.protocol:GenerateTokensResponse.choices", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/weights.py", reached_as="getattr(result, 'choices', None)"),
    row(f"{_TIT}.protocol:GenerateChoiceBase.weight_versions", "attribute", f"{_TIT_FILE}/protocol.py",
        "vllm_plugin/weights.py", reached_as="getattr(choice, 'weight_versions', None)"),
    row("vllm.outputs:WeightVersionSpan.version", "attribute", "vllm/outputs.py", "vllm_plugin/weights.py",
        "tests/plugin/test_weights.py"),
    row("vllm.entrypoints.serve.engine.protocol:ErrorResponse", "class",
        "vllm/entrypoints/serve/engine/protocol.py",
        "vllm_plugin/serving.py", "vllm_plugin/api_router.py", "tests/helpers/servers.py"),
    row("vllm.entrypoints.serve.engine.protocol:ErrorResponse.error", "attribute",
        "vllm/entrypoints/serve/engine/protocol.py", "vllm_plugin/api_router.py"),
    row("vllm.entrypoints.serve.engine.protocol:ErrorInfo.code", "attribute",
        "vllm/entrypoints/serve/engine/protocol.py", "vllm_plugin/api_router.py",
        reached_as="result.error.code"),
    row("vllm.entrypoints.serve.utils.api_utils:load_aware_call", "function",
        "vllm/entrypoints/serve/utils/api_utils.py", "vllm_plugin/api_router.py", positional=1),
    row("vllm.entrypoints.serve.utils.api_utils:with_cancellation", "function",
        "vllm/entrypoints/serve/utils/api_utils.py", "vllm_plugin/api_router.py", positional=1),
    row("vllm.entrypoints.serve.exception_handling.utils:sanitize_message", "function",
        "vllm/entrypoints/serve/exception_handling/utils.py", "vllm_plugin/http_edge.py", positional=1),
)

_CONNECTOR: tuple[Touchpoint, ...] = (
    # --- connector.py, chat_refs.py: refs in image URLs (vLLM's media connector registry) ------------------
    row(f"{_MEDIA}:MEDIA_CONNECTOR_REGISTRY", "constant", _MEDIA_FILE, "vllm_plugin/connector.py"),
    row("vllm.utils.registry:ExtensionManager.register", "method", "vllm/utils/registry.py",
        "vllm_plugin/connector.py", reached_as="MEDIA_CONNECTOR_REGISTRY.register('mmref')(cls)",
        positional=1, positional_names=("name",)),
    row("vllm.envs:VLLM_MEDIA_CONNECTOR", "constant", "vllm/envs.py", "vllm_plugin/connector.py",
        "vllm_plugin/plugin.py", key="envs.VLLM_MEDIA_CONNECTOR",
        reached_as="read per request by vLLM's chat parser (MEDIA_CONNECTOR_REGISTRY.load(...))"),
    row(f"{_MEDIA}:MediaConnector", "class", _MEDIA_FILE, "vllm_plugin/connector.py", "bench/server.py",
        reached_as="subclassed by MMRefMediaConnector; bench/server.py: MediaConnector()", positional=0),
    *(row(f"{_MEDIA}:MediaConnector.{name}", "method", _MEDIA_FILE, "vllm_plugin/connector.py", *users,
          reached_as=f"overridden by MMRefMediaConnector; vLLM's chat parser calls {name}(url)", positional=1,
          positional_names=("image_url",), keywords=("image_mode",), named=("image_mode",))
      for name, users in (("fetch_image", ("bench/server.py",)), ("fetch_image_async", ()))),
    *(row(f"{_MEDIA}:MediaConnector.{name}", "method", _MEDIA_FILE, "vllm_plugin/connector.py",
          reached_as=f"overridden by MMRefMediaConnector; chat parser calls {name}(url, video_processor=)",
          positional=1, positional_names=("video_url",), keywords=("image_mode", "video_processor"),
          named=("image_mode", "video_processor"))
      for name in ("fetch_video", "fetch_video_async")),
    row("vllm.multimodal.media.base:MediaWithBytes", "class", "vllm/multimodal/media/base.py",
        "vllm_plugin/chat_refs.py", positional=3, positional_names=("media", "original_bytes", "io_config")),
    row("vllm.renderers.chat_utils:CustomChatCompletionContentSimpleImageParam.uuid", "attribute",
        "vllm/renderers/chat_utils.py", "vllm_plugin/chat_refs.py",
        reached_as="part['uuid'] of an image part, which vLLM's chat parser passes as the item's uuid"),
    row("vllm.multimodal.processing.inputs:ProcessorInputs.get_mm_hashes", "method",
        "vllm/multimodal/processing/inputs.py", "vllm_plugin/chat_refs.py",
        reached_as="vLLM keys an item by its uuid in place of its content hash (unless media_io_kwargs or "
        "mm_processor_kwargs are given: then by both)"),
)
# fmt: on

PLUGIN: tuple[Touchpoint, ...] = (*_ENTRY, *_TOKENS, *_ITEMS, *_ROUTE, *_CONNECTOR)
"""Every vLLM name ``vllm_plugin/`` relies on."""
