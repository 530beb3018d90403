"""The generate request, checked and resolved into what vLLM's own ``ServingTokens`` serves.

Differences from upstream ``vllm/entrypoints/scale_out/token_in_token_out/serving.py`` (vLLM
0.32), and nothing else (the request then goes to vLLM's own ``serve_tokens``):

- **Refs.** ``mm_refs`` (prompt order) become ``features``; a ``kwargs_data`` slot holding a ref
  string becomes the resolved item (``resolver.py``), its hash the ``mmref-`` engine hash, its
  ``mm_metadata`` dropped (the resolved item is complete). The item never takes vLLM's wire format:
  the slot is left empty in ``features`` and the item enters vLLM's engine input as a
  ``MultiModalKwargsItem`` (or a cache handle) when the request is handed to the engine
  (:class:`~vllm_plugin.serving_tokens.ResolvedSlot`, ``serving_tokens.py``, which lists every
  difference from upstream's ``ServingTokens``). The ``mmref-`` namespace is reserved: an inline
  item or a ``content_parts`` uuid may not claim it.
- **Weights.** Engine hashes and the ``cache_salt`` are bound to the weight version the engine
  reports at :meth:`MMRefServing.prepare` (``weights.py``).
- **Checks vLLM does not make, on what reaches the engine** (each a 4xx where stock would crash
  the engine, answer 500 or answer silently wrong; stock's answer everywhere else):
  ``features`` modality keys must be the served one; every item's placeholder range must be as
  long as the item's features (inline items and ``mm_metadata`` merged over them as vLLM merges
  them, ``null`` slots whose item this route sent, refs; a ref's range must also cover placeholder
  tokens only); inline items must have the served model's layout (``items.py``); a ``null`` slot
  the engine certainly lacks is a 404 (``engine_items.py``); a prompt with placeholder tokens and
  no image at all is a 422; a ``content_parts`` ``file://`` URL is refused when the server loads no
  local files, and under ``--allowed-local-media-path`` when it names no file (stock: 500) or
  something other than a regular file (a FIFO blocks vLLM's loader thread for good); on a vLLM
  CPU server, a seeded request whose prefill may be split is a 400 (``seeds.py``: it kills the
  engine).
- Placeholder tokens outside every range (e.g. a literal ``<|image_pad|>`` in user text beside a
  correctly ranged image) pass: vLLM merges embeddings by the ranges, not by token id.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import PlaceholderMismatch
from upstream import load
from vllm_plugin.content_parts import bind_content_refs, check_content_parts
from vllm_plugin.engine_items import EngineItems, RecordedItem
from vllm_plugin.items import encode_item
from vllm_plugin.protocol import MMRefGenerateRequest, parse_request
from vllm_plugin.request_scope import pending_items, run_alone
from vllm_plugin.resolution import FeatureForm, Resolution
from vllm_plugin.resolver import MMRefResolver
from vllm_plugin.seeds import SplitRule
from vllm_plugin.weights import (
    served_by,
    version_salt,
)

logger = logging.getLogger("vllm.mmref")

__all__ = ["MMRefServing", "Prepared"]


@dataclass(frozen=True)
class Prepared:
    """A request ready for vLLM's ``serve_tokens``."""

    request: MMRefGenerateRequest
    """The request vLLM serves: ``features`` with the resolved refs' slots empty (``null``), the
    ``cache_salt`` bound to the weight version."""
    resolution: Resolution
    """Its images: the items it gives the engine, the resolved refs' slots, the version."""


class MMRefServing:
    """Checks and resolves generate requests for the served model.

    Args:
        resolver: resolves refs (and owns the adapter, the item layout and the worker pool).
        engine_items: what the engine may hold, for ``null`` slots.
        placeholder_token_id: the model's image placeholder token id.
        serving_tokens: vLLM's ``ServingTokens`` (``app.state.serving_tokens``).
        weight_version: returns the engine's current weight version (``weights.VersionReader``).
        allowed_local_media_path: vLLM's ``--allowed-local-media-path`` (None: no local files).
        ec_transfer: whether the server has an encoder-cache connector (metadata-only items).
        max_body_bytes: the request body limit (``MMREF_MAX_BODY_BYTES`` or its derived default).
        split_rule: seeded requests this server refuses (``seeds.py``; None: none).
        video_token_id: the model's video placeholder token id (video refs in ``mm_refs``).
    """

    def __init__(
        self,
        resolver: MMRefResolver,
        engine_items: EngineItems,
        *,
        placeholder_token_id: int,
        serving_tokens: Any,
        allowed_local_media_path: str | None,
        ec_transfer: bool,
        max_body_bytes: int,
        weight_version: Callable[[], Awaitable[str]],
        split_rule: SplitRule | None = None,
        video_token_id: int | None = None,
    ) -> None:
        self.resolver = resolver
        self.adapter = resolver.adapter
        self.config = resolver.config
        self.engine_items = engine_items
        self.placeholder_token_id = placeholder_token_id
        self.form = FeatureForm(
            resolver,
            engine_items,
            placeholder_token_id=placeholder_token_id,
            ec_transfer=ec_transfer,
            video_token_id=video_token_id,
        )
        self.serving_tokens = serving_tokens
        self.local_media = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None
        self.max_body_bytes = max_body_bytes
        self.weight_version = weight_version
        self.split_rule = split_rule

    async def serve(self, body: Any, raw_request: Any) -> tuple[Any, str]:
        """A generate request's life: validated, prepared (:meth:`prepare`), served by vLLM's
        ``serve_tokens`` with the resolved items handed to the engine (``serving_tokens.py``), the
        items it carried recorded, and generated once more, under the version then current, if
        vLLM's ``weight_versions`` show it was not generated under the version it was bound to
        (non-streamed answers; ``weights.served_by``).

        Returns:
            ``(result, version)``: vLLM's ``ErrorResponse``, its response, or its stream, and the
            weight version the request was bound to.

        Raises:
            RequestValidationError: stock's refusal of the body (``protocol.parse_request``).
            MMRefError: the plugin's refusals (see :meth:`prepare`).
        """
        error_response, response = load("ErrorResponse"), load("GenerateResponseBase")
        for attempt in (1, 2):
            prepared = await self.prepare(parse_request(body))  # parsed again: vLLM mutates requests
            resolution = prepared.resolution
            # the items it carried are recorded once the engine has answered (streamed or not)
            with pending_items(resolution.slots, functools.partial(self.record, resolution.sent)):
                result = await self.serving_tokens.serve_tokens(prepared.request, raw_request)
            if isinstance(result, error_response):
                break
            if not isinstance(result, response) or served_by(result, resolution.version):
                break
            if attempt == 1:
                logger.info(
                    "mmref: not generated under weights %r alone; generating again", resolution.version
                )
        return result, resolution.version

    async def resolved_features(self, body: Any) -> tuple[dict[str, Any], str]:
        """A generate request's ``features`` as the engine would get them (``/inference/v1/resolve``):
        ``kwargs_data`` items are vLLM's base64 msgpack encoding (made in the worker pool) of the
        exact tensors the generate route feeds the model; no sampling parameters needed.

        Returns:
            ``({"features", "fingerprint", "pixel_mode"}, version)``.

        Raises:
            RequestValidationError, MMRefError: as :meth:`serve`.
        """
        if isinstance(body, dict):
            body.setdefault("sampling_params", {})
        prepared = await self.prepare(parse_request(body))
        features, slots = prepared.request.features, prepared.resolution.slots
        dumped = features.model_dump() if features is not None else None
        if slots:
            loop = asyncio.get_running_loop()
            pool = self.resolver.pool
            encoded = await asyncio.gather(*(loop.run_in_executor(pool, encode_item, s.item) for s in slots))
            kwargs = dumped.get("kwargs_data") or {}  # null: vLLM's form of "every item cached"
            dumped["kwargs_data"] = kwargs
            for slot, data in zip(slots, encoded, strict=True):
                items = kwargs.get(slot.modality) or [None] * len(dumped["mm_hashes"][slot.modality])
                items[slot.index] = data
                kwargs[slot.modality] = items
        content = {
            "features": dumped,
            "fingerprint": self.adapter.fingerprint,
            "pixel_mode": self.resolver.pixel_mode,
        }
        return content, prepared.resolution.version

    async def prepare(self, request: MMRefGenerateRequest) -> Prepared:
        """Resolve refs and run the checks above, bound to the engine's current weight version.

        Raises:
            InvalidRequest, PlaceholderMismatch, NotCached: see the module doc.
            SeedUnsupported: a seeded request that could kill the engine (``seeds.py``).
            MMRefError subclasses: a ref that cannot be used (``resolver.py``).
        """
        token_ids = request.token_ids
        if self.split_rule is not None and self.split_rule.check_generate(request, self.placeholder_token_id):
            await run_alone()
        version = await self.weight_version()
        if request.content_parts:
            check_content_parts(request.content_parts, self.local_media)
            await bind_content_refs(request.content_parts, version)
        if request.mm_refs is not None:
            resolution = await self.form.from_refs(request.mm_refs, token_ids, version)
        elif request.features is not None:
            resolution = await self.form.check(request.features, token_ids, version)
        else:
            resolution = Resolution(None, (), (), version)
        features = resolution.features
        if not request.content_parts and not (features and any(features.mm_hashes.values())):
            self._refuse_unclaimed(token_ids)
        for mm_hash, item in resolution.sent:  # resolved refs' counts, for null slots while it runs
            self.engine_items.note(mm_hash, item)
        salt = version_salt(request.cache_salt, version)
        served = request.model_copy(update={"features": features, "mm_refs": None, "cache_salt": salt})
        return Prepared(served, resolution)

    def record(self, sent: tuple[tuple[str, RecordedItem], ...]) -> None:
        """The engine accepted a request: mirror its receiver cache for the items it carried."""
        for mm_hash, item in sent:
            self.engine_items.sent(mm_hash, item)

    # --- checks ------------------------------------------------------------------------

    def _refuse_unclaimed(self, token_ids: list[int]) -> None:
        found = token_ids.count(self.placeholder_token_id)
        if found:
            raise PlaceholderMismatch(
                f"prompt has {found} image placeholder tokens (id {self.placeholder_token_id}) and the "
                "request carries no image (mm_refs, features or content_parts; vLLM ignores unknown keys)"
            )
