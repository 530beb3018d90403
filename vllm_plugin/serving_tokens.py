"""vLLM's own ``ServingTokens`` serving the plugin's requests, with resolved refs handed to the
engine as ``MultiModalKwargsItem`` s, never through vLLM's base64/msgpack wire format.

The plugin uses upstream's class unchanged (``vllm/entrypoints/scale_out/token_in_token_out/
serving.py``, vLLM 0.32): its request validation, sampling defaults, streaming, cancellation,
logprobs and error bodies are vLLM's. It is built the way vLLM builds it
(``scale_out/factories.py``, the same settings as the app's own instance) with one difference, the
engine client it hands requests to: :class:`HandOffClient` wraps vLLM's ``EngineClient``
and changes only ``generate``, only for requests whose ``features`` carry resolved refs:

1. ``serving.py`` leaves each resolved ref's ``kwargs_data`` slot ``null`` (vLLM's form of a cache
   handle), so ``serve_tokens`` builds the engine input exactly as for any ``features`` request,
   cheaply, with ``None`` at those positions (its ``mm_kwargs_from_features`` decodes nothing for
   them; its ``_validate_mm_cache_handles`` checks the client's own items only).
2. When ``serve_tokens`` calls ``engine_client.generate(engine_input, ...)``, the wrapper puts the
   resolved items (:class:`ResolvedSlot`, carried from the route by ``request_scope.pending_items``) into
   those positions, and, where the API process's sender cache mirrors an engine-side store, gives
   them to that cache the way vLLM's processor gives its own items (``engine_items.py``): an item
   the engine holds travels as a cache handle (``None``), and the request is sent in the same
   event-loop step. The hand-off runs when vLLM starts the generation (for a streamed answer,
   when the stream starts).
3. Before the sender cache is touched, vLLM's own checks of ``AsyncLLM.add_request`` (its input
   processor's ``process_inputs`` and ``check_admission``) are run on the filled engine input: a
   request they refuse goes to vLLM's ``generate`` with its items as data and no sender-cache
   change, and vLLM refuses it with its own error. (These checks thus run twice for every request
   with resolved refs when the sender cache mirrors the engine's; py-spy puts the second run under
   1% of the API server's time, docs/PERFORMANCE.md §2.)

Every other request (no resolved refs) goes to vLLM's ``generate`` untouched. The app's own
``ServingTokens`` (``app.state.serving_tokens``) stays as vLLM built it; only the plugin's generate
route uses this second instance. Answers, status codes and error bodies are upstream's; the one
visible difference is timing: a resolved item is no longer encoded and decoded in process, and a
repeated one crosses to the engine core as a handle (with vLLM's ``lru`` processor cache).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from upstream import load, serving_tokens_keywords
from vllm_plugin import request_scope
from vllm_plugin.engine_items import EngineItems

__all__ = ["HandOffClient", "ResolvedSlot", "build_serving_tokens"]


@dataclass(frozen=True)
class ResolvedSlot:
    """A ``features`` position whose item the route resolved (its slot is ``null`` in the request)."""

    modality: str
    index: int
    """Position within the modality's lists (``mm_hashes[modality][index]``)."""
    engine_hash: str
    item: Any
    """vLLM's ``MultiModalKwargsItem``."""


class HandOffClient:
    """vLLM's engine client, with resolved refs' items put into the engine input at ``generate``.

    Everything but ``generate`` is the wrapped client's (attribute access is forwarded).

    Args:
        client: vLLM's ``EngineClient`` (``AsyncLLM``).
        engine_items: the sender-cache hand-off (``engine_items.py``).
    """

    def __init__(self, client: Any, engine_items: EngineItems) -> None:
        self._client = client
        self._items = engine_items

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def generate(self, engine_input: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        """vLLM's ``generate``; for a request with resolved refs (``request_scope.pending_items``, read when
        ``serve_tokens`` calls this), their items enter ``engine_input`` first.

        Raises:
            RuntimeError: the engine input does not have the resolved refs' hashes at their
                positions with empty slots (a vLLM that builds it differently: a server fault).
        """
        slots, on_output = request_scope.pending()
        if slots:
            _fill(engine_input, slots)
            generation = self._generate(engine_input, {(s.modality, s.index) for s in slots}, args, kwargs)
        else:
            generation = self._client.generate(engine_input, *args, **kwargs)
        return generation if on_output is None else _on_first(generation, on_output)

    async def _generate(
        self, engine_input: Any, ours: set[tuple[str, int]], args: tuple, kwargs: dict
    ) -> AsyncGenerator[Any, None]:
        items, client = self._items, self._client
        if not items.mirrors:
            async with contextlib.aclosing(client.generate(engine_input, *args, **kwargs)) as gen:
                async for output in gen:
                    yield output
            return
        tasks = await client.get_supported_tasks()  # cached by vLLM's client: no wait below
        release = await items.enter()
        try:
            recorded = [] if self._refused(engine_input, tasks, args, kwargs) else None
            if recorded is None:
                recorded = items.hand_off(engine_input, ours)
        except BaseException:
            release()
            raise
        # released after this step, by when the request is on the engine core's socket
        asyncio.get_running_loop().call_soon(release)
        generation = client.generate(engine_input, *args, **kwargs)
        try:
            async with contextlib.aclosing(generation):
                async for output in generation:  # the first step sends the request
                    yield output
        except Exception:
            if not release.done:  # refused within this step: nothing reached the engine
                items.forget(recorded)
            raise

    def _refused(self, engine_input: Any, tasks: Any, args: tuple, kwargs: dict) -> bool:
        """Whether vLLM's ``AsyncLLM.add_request`` will refuse the request before sending it: its
        own input checks (``InputProcessor.process_inputs``) and admission control
        (``check_admission``), run here first so that a refused request changes nothing in the
        sender cache (vLLM then refuses it again, with its own error)."""
        sampling_params, request_id = args[:2]
        try:
            self._client.input_processor.process_inputs(
                request_id,
                engine_input,
                sampling_params,
                supported_tasks=tasks,
                lora_request=kwargs.get("lora_request"),
                priority=kwargs.get("priority", 0),
                data_parallel_rank=kwargs.get("data_parallel_rank"),
                session_id=kwargs.get("session_id"),
            )
            self._client.check_admission(max(getattr(sampling_params, "n", 1), 1))
        except Exception:
            return True
        return False


async def _on_first(
    generation: AsyncGenerator[Any, None], call: Callable[[], None]
) -> AsyncGenerator[Any, None]:
    """``generation``'s outputs, ``call()`` once the first has arrived."""
    first = True
    async with contextlib.aclosing(generation):
        async for output in generation:
            if first:
                first = False
                call()
            yield output


def _fill(engine_input: Any, slots: tuple[ResolvedSlot, ...]) -> None:
    kwargs, hashes = engine_input.get("mm_kwargs"), engine_input.get("mm_hashes")
    for slot in slots:
        try:
            ok = hashes[slot.modality][slot.index] == slot.engine_hash
            ok = ok and kwargs[slot.modality][slot.index] is None
        except (KeyError, IndexError, TypeError):
            ok = False
        if not ok:
            raise RuntimeError(
                "mmref: vLLM's engine input does not have the resolved ref at "
                f"{slot.modality}[{slot.index}] (supported vLLM: see vllm_plugin.plugin)"
            )
        kwargs[slot.modality][slot.index] = slot.item


def build_serving_tokens(engine_client: Any, engine_items: EngineItems, state: Any, args: Any) -> Any:
    """vLLM's ``ServingTokens`` over :class:`HandOffClient`, with the app's own instance's settings
    (vLLM 0.32 builds one for every generate server) or, without one, those vLLM's
    ``scale_out/factories.py`` derives from the CLI arguments. vLLM 0.33's constructor also
    requires an ``online_derenderer`` (the door's version-keyed ``serving_tokens_keywords``)."""
    app = getattr(state, "serving_tokens", None)
    settings = {
        "request_logger": getattr(app, "request_logger", getattr(state, "request_logger", None)),
        "return_tokens_as_token_ids": args.return_tokens_as_token_ids,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_log_outputs": args.enable_log_outputs,
        "force_no_detokenize": args.tokens_only,
        **serving_tokens_keywords(state),
    }
    return load("ServingTokens")(
        HandOffClient(engine_client, engine_items),
        state.openai_serving_models,
        state.online_renderer,
        **settings,
    )
