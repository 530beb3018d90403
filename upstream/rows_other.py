"""The vLLM rows of every other side: ``protocol/`` (the Kimi-K2.5 adapter's vLLM processor, which
the trainer loads too), ``scripts/``, ``bench/`` and ``tests/`` (oracles, fixtures); and the standard
library's private names (:data:`STDLIB_SURFACE`). transformers' rows: ``rows_hf.py``. Files only in
``used_in``: line numbers drift."""

from __future__ import annotations

from upstream.model import Touchpoint, Variant, row

__all__ = ["BENCH", "PROTOCOL", "SCRIPTS", "STDLIB_SURFACE", "TESTS"]

_MROPE_ORACLE_WHY = (
    "test oracle only: vLLM's own MRoPE positions of one prompt, which the public "
    "get_mrope_input_positions computes on a model instance (weights) only"
)

# fmt: off
PROTOCOL: tuple[Touchpoint, ...] = (
    row("vllm.transformers_utils.processors.kimi_k25_vision_fused:KimiK25FusedVisionProcessor", "class",
        "vllm/transformers_utils/processors/kimi_k25_vision_fused.py", "protocol/adapters/kimi_k25.py"),
    row("vllm.transformers_utils.processors.kimi_k25_vision_fused:"
        "KimiK25FusedVisionProcessor.from_pretrained",
        "method", "vllm/transformers_utils/processors/kimi_k25_vision_fused.py",
        "protocol/adapters/kimi_k25.py", positional=1, keywords=("local_files_only",)),
    row("vllm.utils.import_utils:is_numba_available", "function", "vllm/utils/import_utils.py",
        "protocol/adapters/kimi_k25.py", positional=0),
    row("vllm.multimodal.video:VIDEO_LOADER_REGISTRY", "constant", "vllm/multimodal/video.py",
        "protocol/videos.py", "tests/test_video.py"),
    row("vllm.utils.registry:ExtensionManager.load", "method", "vllm/utils/registry.py", "protocol/videos.py",
        "tests/test_video.py", key="VIDEO_LOADER_REGISTRY.load",
        reached_as="VIDEO_LOADER_REGISTRY.load(loader)",
        positional=1),
    row("vllm.multimodal.video:Qwen2VLVideoBackend.compute_frames_index_to_sample", "method",
        "vllm/multimodal/video.py", "protocol/videos.py",
        reached_as="VIDEO_LOADER_REGISTRY.load('qwen2_vl').compute_frames_index_to_sample(src, tgt, **kw)",
        positional=2, keywords=("min_frames", "max_frames", "temporal_patch_size")),
    row("vllm.multimodal.video:Qwen3VLVideoBackend.compute_frames_index_to_sample", "method",
        "vllm/multimodal/video.py", "protocol/videos.py",
        reached_as="VIDEO_LOADER_REGISTRY.load('qwen3_vl').compute_frames_index_to_sample(src, tgt, **kw)",
        positional=2, keywords=("min_frames", "max_frames", "temporal_patch_size")),
    row("vllm.multimodal.video:VideoLoader._prepare_source", "method", "vllm/multimodal/video.py",
        "upstream/door.py", "protocol/videos.py", reached_as="loader._prepare_source(source)",
        accessor="video_source", positional=1, private=True,
        why=("the loader's own adjustment of the container's metadata before sampling (Qwen3-VL: an "
             "unknown fps is 24, and the frame timestamps use it); vLLM's decoder calls it, no public "
             "method applies it")),
    row("vllm.multimodal.video_decoders:VideoSourceMetadata", "class",
        "vllm/multimodal/video_decoders/base.py", "protocol/videos.py", "tests/test_video.py", positional=3),
    row("vllm.multimodal.video_decoders:VideoTargetMetadata", "class",
        "vllm/multimodal/video_decoders/base.py", "protocol/videos.py", "tests/test_video.py", positional=0,
        keywords=("num_frames", "fps", "max_duration")),
    row("vllm.multimodal.video_decoders.opencv:OpenCVVideoBackendMixin.get_video_metadata", "method",
        "vllm/multimodal/video_decoders/opencv.py", "protocol/videos.py", positional=1),
    row("vllm.multimodal.video_decoders.opencv:OpenCVVideoBackendMixin.get_cv2_video_api", "method",
        "vllm/multimodal/video_decoders/opencv.py", "protocol/videos.py", positional=0),
)

SCRIPTS: tuple[Touchpoint, ...] = (
    row("vllm.entrypoints.openai.api_server:", "module", "vllm/entrypoints/openai/api_server.py",
        "scripts/vllm_server.py", key="api_server module",
        reached_as="python -m vllm.entrypoints.openai.api_server"),
    row("vllm.entrypoints.cli.main:", "module", "vllm/entrypoints/cli/main.py", "scripts/vllm_server.py",
        key="cli main module", reached_as="python -m vllm.entrypoints.cli.main serve"),
    row("vllm.entrypoints.cli.serve:ServeSubcommand", "class", "vllm/entrypoints/cli/serve.py",
        "scripts/vllm_cli.py", positional=0),
    row("vllm.entrypoints.cli.serve:ServeSubcommand.subparser_init", "method",
        "vllm/entrypoints/cli/serve.py", "scripts/vllm_cli.py", positional=1),
    row("vllm.entrypoints.cli.serve:ServeSubcommand.cmd", "method", "vllm/entrypoints/cli/serve.py",
        "scripts/vllm_cli.py", positional=1),
    row("vllm.entrypoints.cli.serve:ServeSubcommand.validate", "method", "vllm/entrypoints/cli/serve.py",
        "scripts/vllm_cli.py", positional=1),
    row("vllm.entrypoints.serve.utils.api_utils:VLLM_SUBCMD_PARSER_EPILOG", "constant",
        "vllm/entrypoints/serve/utils/api_utils.py", "scripts/vllm_cli.py",
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.startup",
                          note="moved with cli_env_setup"),)),
    row("vllm.entrypoints.serve.utils.api_utils:cli_env_setup", "function",
        "vllm/entrypoints/serve/utils/api_utils.py", "scripts/vllm_cli.py",
        positional=0,
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.startup",
                          note="moved to vllm/entrypoints/common/startup.py"),)),
    row("vllm.logger:configure_logging_from_args", "function", "vllm/logger.py", "scripts/vllm_cli.py",
        positional=1),
    row("vllm.utils.argparse_utils:FlexibleArgumentParser", "class", "vllm/utils/argparse_utils.py",
        "scripts/vllm_cli.py", positional=0, keywords=("description", "epilog")),
    row("vllm.entrypoints.scale_out.token_in_token_out.mm_serde:decode_mm_kwargs_item", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py", "scripts/demo.py",
        "tests/plugin/test_items.py", "tests/plugin/test_route_attacks.py",
        "tests/plugin/test_route_parity.py", "tests/test_server.py", "tests/test_server_qwen35.py",
        positional=1),
    row("vllm.entrypoints.scale_out.token_in_token_out.mm_serde:encode_mm_kwargs_item", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py", "tests/plugin/test_route_attacks.py",
        "tests/plugin/test_route_parity.py", "tests/test_server.py", positional=1),
)

BENCH: tuple[Touchpoint, ...] = (
    row("vllm.entrypoints.scale_out.token_in_token_out.mm_features:extract_mm_features", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_features.py", "bench/request_bytes.py",
        positional=1),
    row("vllm.entrypoints.scale_out.token_in_token_out.mm_features:mm_kwargs_from_features", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_features.py", "bench/_miss_profile.py",
        "bench/server.py", positional=1),
    row("vllm.multimodal.hasher:MultiModalHasher.hash_kwargs", "method", "vllm/multimodal/hasher.py",
        "bench/server.py", positional=1, keywords=("model_id", "image")),
    row("vllm.config:ModelConfig", "class", "vllm/config/model.py", "bench/_common.py",
        "tests/plugin/conftest.py", "tests/helpers/oracles.py",
        "tests/plugin/test_engine_items.py", "tests/plugin/test_seeds.py", positional=0,
        keywords=("model", "dtype", "max_model_len", "limit_mm_per_prompt", "mm_device_do_normalize",
                  "trust_remote_code", "mm_processor_cache_gb")),
    row("vllm.multimodal:MULTIMODAL_REGISTRY", "constant", "vllm/multimodal/__init__.py",
        "bench/_common.py", "tests/plugin/conftest.py", "tests/helpers/oracles.py"),
    row("vllm.multimodal.registry:MultiModalRegistry.create_processor", "method",
        "vllm/multimodal/registry.py", "bench/_common.py", "tests/plugin/conftest.py",
        "tests/helpers/oracles.py",
        reached_as="MULTIMODAL_REGISTRY.create_processor(model_config)", positional=1),
)

TESTS: tuple[Touchpoint, ...] = (
    row("vllm.config:CacheConfig", "class", "vllm/config/cache.py", "tests/plugin/test_seeds.py",
        positional=0, keywords=("mamba_cache_mode",)),
    row("vllm.config:SchedulerConfig", "class", "vllm/config/scheduler.py", "tests/plugin/test_seeds.py",
        positional=0,
        keywords=("max_model_len", "max_num_batched_tokens", "is_encoder_decoder", "enable_chunked_prefill",
                  "long_prefill_token_threshold")),
    row("vllm.entrypoints.generate.base.protocol:validate_cache_salt", "function",
        "vllm/entrypoints/generate/base/protocol.py", "tests/plugin/test_weights.py",
        positional=1),
    row("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateTokensChoice", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "tests/plugin/test_weights.py",
        positional=0, keywords=("index", "token_ids", "weight_versions")),
    row("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateTokensResponse", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "tests/plugin/test_weights.py",
        positional=0, keywords=("choices",)),
    row("vllm.outputs:WeightVersionSpan", "class", "vllm/outputs.py", "tests/plugin/test_weights.py",
        positional=3),
    row("vllm.exceptions:VLLMError", "class", "vllm/exceptions.py", "tests/test_fuzz.py"),
    row("vllm.multimodal.cache:LruKeyReplicatedReceiverCache", "class", "vllm/multimodal/cache/lru.py",
        "tests/plugin/test_engine_items.py", positional=1),
    row("vllm.multimodal.cache:LruKeyReplicatedReceiverCache.get_and_update_item", "method",
        "vllm/multimodal/cache/lru.py", "tests/plugin/test_engine_items.py",
        key="receiver.get_and_update_item", positional=2),
    row("vllm.multimodal.cache:LruKeyReplicatedReceiverCache.get_and_update_features", "method",
        "vllm/multimodal/cache/base.py", "tests/plugin/test_engine_items.py",
        key="receiver.get_and_update_features", positional=1),
    row("vllm.multimodal.cache:MultiModalCacheMissError", "class", "vllm/multimodal/cache/base.py",
        "tests/plugin/test_engine_items.py"),
    row("vllm.multimodal.inputs:PlaceholderRange", "class", "vllm/multimodal/inputs.py",
        "tests/plugin/test_engine_items.py", positional=0,
        keywords=("offset", "length")),
    row("vllm.multimodal.inputs:MultiModalFeatureSpec", "class", "vllm/multimodal/inputs.py",
        "tests/plugin/test_engine_items.py", positional=0,
        keywords=("data", "modality", "identifier", "mm_position", "mm_hash")),
    row("vllm.model_executor.models.qwen2_vl:_create_qwen2vl_field_factory", "function",
        "vllm/model_executor/models/qwen2_vl.py", "tests/plugin/test_route_parity.py", positional=1,
        spelled="_build_qwen_vl_features",
        reached_as="renderers 0.1.12 (renderers/client.py, _build_qwen_vl_features) calls it, with "
        "mm_serde.encode_mm_kwargs_item and MultiModalKwargsItems.from_hf_inputs",
        private=True, why="not the project's choice: the released renderers client, whose feature "
        "builder the parity test runs, calls it; the project never imports it"),
    row("vllm.multimodal.inputs:MultiModalBatchedField", "class", "vllm/multimodal/inputs.py",
        "tests/plugin/test_items.py", positional=0),
    row("vllm.multimodal.media.image:ImageMediaIO.load_bytes", "method", "vllm/multimodal/media/image.py",
        "tests/test_images.py", positional=1),
    row("vllm.multimodal.media.image:ImageMediaIO", "class", "vllm/multimodal/media/image.py",
        "tests/test_images.py", "tests/test_video.py", positional=0, keywords=("image_mode",)),
    row("vllm.multimodal.media.video:VideoMediaIO", "class", "vllm/multimodal/media/video.py",
        "tests/test_video.py", positional=1, keywords=("video_backend",)),
    row("vllm.multimodal.media.video:VideoMediaIO.load_bytes", "method", "vllm/multimodal/media/video.py",
        "tests/test_video.py", positional=1),
    row("vllm.multimodal.video:get_video_loader_backend_for_processor", "function",
        "vllm/multimodal/video.py", "tests/test_video.py", positional=1),
    row("vllm.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration.get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen2_vl.py", "tests/test_forward.py",
        reached_as="called unbound with a config shim as self", positional=2),
    row("vllm.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration.iter_mm_grid_thw", "method",
        "vllm/model_executor/models/qwen2_vl.py", "tests/helpers/forward.py"),
    row("vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen2_5_vl.py", "tests/test_forward.py", positional=2),
    *(row(f"vllm.model_executor.models.{module}:{cls}._get_mrope_input_positions", "method",
          "vllm/model_executor/models/qwen3_vl.py", "tests/helpers/forward.py", positional=0,
          keywords=("input_tokens", "mm_features", "config"), private=True, why=_MROPE_ORACLE_WHY)
      for module, cls in (("qwen3_vl", "Qwen3VLForConditionalGeneration"),
                          ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
                          ("qwen3_5", "Qwen3_5ForConditionalGeneration"),
                          ("qwen3_5", "Qwen3_5MoeForConditionalGeneration"))),
)

STDLIB_SURFACE: tuple[Touchpoint, ...] = (
    row("concurrent.futures:ThreadPoolExecutor._max_workers", "attribute", "concurrent/futures/thread.py",
        "upstream/door.py", "vllm_plugin/startup.py", accessor="mm_worker", private=True,
        why=(
            "the hand-off relies on vLLM's multimodal worker being a single thread (P0 order); "
            "ThreadPoolExecutor has no public worker count"
        )),
)
"""Private standard-library names (checked at run time only)."""
# fmt: on
