"""Weight updates with requests in flight: one procedure that cannot kill the engine, and what it
guarantees every answer (docs/WEIGHT-UPDATES.md, "Updating a serving engine").

vLLM 0.32's own recipe for an asynchronous loop (``/pause?mode=keep``, reload, cache resets,
``/resume``) kills the engine under image traffic. The cause (confirmed, docs/WEIGHT-UPDATES.md):
``pause_generation`` clears the prefix cache with ``reset_running_requests=True`` even in
``keep`` mode, which preempts running requests; a request whose image the prefix cache covered
when it was scheduled reached the worker with its pixel data stripped
(``multimodal/utils.py``, ``strip_covered_mm_data``), and, its cached blocks gone, is scheduled
to encode the image again: the worker runs the vision tower on an item without ``pixel_values``
(``AssertionError: Expected number of multimodal embeddings to match number of input items``).
Resetting caches or reloading weights under requests that hold state is the hazard.

:class:`WeightUpdates` never does either:

1. **hold**: the gate closes (``admission.py``: new requests of this API process wait before
   vLLM reads them), then every request it admitted runs to its end under the old weights
   (``drain``), then the engine is paused with ``mode="wait"`` and no cache clear (requests of
   other API processes finish; new ones queue in the engine);
2. the weights change (``reload_weights`` from a checkpoint folder, or any of vLLM's own weight
   routes between ``hold`` and ``release``), with nothing running;
3. **release**: the encoder cache and the prefix cache are reset (nothing holds them: safe, and
   vLLM's own routes get no embedding or KV block of the old weights), the new version is set,
   the engine resumes, the gate opens.

So an answer is generated under one set of weights and is labelled with it
(``x-mmref-weight-version``); a request that arrives during an update waits and runs under the
new weights. Never a 5xx, never a mix, nothing cut short. The cost: an update waits for the
longest request in flight (``timeout_s`` bounds it: ``DrainTimeout``, nothing changed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from protocol.errors import DrainTimeout, InvalidRequest, UpdateConflict
from vllm_plugin.admission import Admission
from vllm_plugin.weights import version_header

__all__ = ["WeightUpdates"]

logger = logging.getLogger("vllm.mmref")


class WeightUpdates:
    """Holds, updates and releases the served weights (see the module doc).

    Args:
        engine_client: vLLM's ``EngineClient`` (``AsyncLLM``).
        admission: this API process's gate.
        versions: reads the engine's weight version.
    """

    def __init__(
        self, engine_client: Any, admission: Admission, versions: Callable[[], Awaitable[str]]
    ) -> None:
        self.engine = engine_client
        self.admission = admission
        self.versions = versions
        self._state: Literal["idle", "holding", "held", "updating"] = "idle"
        """``holding``: a hold (or an update's) drains; ``held``: a hold holds, until ``release``;
        ``updating``: an update reloads (it releases the server itself)."""
        self._held_since = 0.0

    @property
    def held(self) -> bool:
        """Whether a hold or an update has the server (from its drain to its release)."""
        return self._state != "idle"

    async def settled(self) -> None:
        """Wait until no hold drains and no update runs (the server is held or not)."""
        while self._state in ("holding", "updating"):
            await asyncio.sleep(_SETTLE_POLL_S)

    async def hold(self, *, timeout_s: float | None = None, abort: bool = False) -> dict[str, Any]:
        """Close the gate, drain this process's requests, pause the engine once it is idle.

        ``abort``: vLLM aborts the requests in flight first (``pause_generation(mode="abort")``,
        no cache cleared: they end with ``finish_reason: abort``), as vLLM's ``/pause`` does.

        Raises:
            UpdateConflict: the server is already held, or a hold or an update is under way.
            DrainTimeout: requests still ran after ``timeout_s`` (gate open again, engine running).
        """
        if self.held:
            raise UpdateConflict("the server is already held for a weight update: release it first")
        self._state, self._held_since = "holding", time.monotonic()
        start, admitted = self._held_since, self.admission.admitted
        try:
            if abort:
                self.admission.close()
                await self.engine.pause_generation(mode="abort", clear_cache=False)
            await self.admission.drain(timeout_s)
            left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
            try:
                await asyncio.wait_for(self.engine.pause_generation(mode="wait", clear_cache=False), left)
            except BaseException as e:  # the pause may have reached the engine: undo it
                with contextlib.suppress(Exception):
                    await self.engine.resume_generation()
                if isinstance(e, TimeoutError):
                    raise DrainTimeout(
                        f"the engine still ran other API processes' requests after {timeout_s} s; "
                        "nothing was changed"
                    ) from None
                raise
        except BaseException:
            if abort:  # vLLM's abort paused the engine
                with contextlib.suppress(Exception):
                    await self.engine.resume_generation()
            self.admission.open()
            self._state = "idle"
            raise
        self._state = "held"
        drained_s = time.monotonic() - start
        logger.info("mmref: weights held (%d requests drained in %.3f s)", admitted, drained_s)
        return {"held": True, "drained_requests": admitted, "drain_seconds": round(drained_s, 6)}

    async def release(self, *, version: str | None) -> dict[str, Any]:
        """Reset the encoder and prefix caches, set ``version`` (if given), resume, open the gate.

        Raises:
            UpdateConflict: the server is not held: no hold, a hold still draining, or an update
                (it releases the server itself).
            InvalidRequest: ``version`` has a control character (no header could name it).
            Exception: vLLM's cache reset or version call failed: the server stays held (send
                ``release`` again); or resuming failed: the gate is open all the same.
        """
        if self._state != "held":
            raise UpdateConflict(_NOT_HELD[self._state])
        if version is not None:
            _check_version(version)
        return await self._release(version)

    async def release_after_call(self) -> dict[str, Any]:
        """Release a hold taken around one call of vLLM's (``control.py``): once more if the
        first release fails before resuming; its caller has no hold to release again."""
        return await self._release_twice(None)

    async def _release_twice(self, version: str | None) -> dict[str, Any]:
        """:meth:`_release`, once more if it fails before resuming (a transient RPC error): the
        update's caller has no hold of its own to release; failing twice, the server stays held."""
        try:
            return await self._release(version)
        except Exception:
            if self._state != "held":
                raise
            return await self._release(version)

    async def _release(self, version: str | None) -> dict[str, Any]:
        """Reset, version, resume, open. A failed reset or version leaves the server held (gate
        closed, engine paused: resuming would serve the old weights' caches or version under the
        new weights), so that ``release`` can be sent again; the gate opens whatever resuming does.
        """
        try:
            await self.engine.reset_encoder_cache()
            prefix_reset = bool(await self.engine.reset_prefix_cache())
            if not prefix_reset:  # nothing runs: vLLM refuses only while blocks are in use
                logger.warning("mmref: vLLM did not reset its prefix cache during a weight update")
            if version is not None:
                await self.engine.update_weight_version(version)
        except BaseException:
            self._state = "held"
            logger.exception("mmref: a weight release failed before resuming: still held, release again")
            raise
        try:
            await self.engine.resume_generation()
        finally:
            self.admission.open()
            held_s = time.monotonic() - self._held_since
            self._state = "idle"
        current = await self.versions()
        logger.info("mmref: weights released under version %r after %.3f s held", current, held_s)
        return {
            "weight_version": current,
            "held_seconds": round(held_s, 6),
            "prefix_cache_reset": prefix_reset,
        }

    async def update(
        self, *, weights_path: str, version: str, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Hold, ``reload_weights`` from ``weights_path``, release under ``version``.

        Raises:
            InvalidRequest: ``weights_path`` is not a folder, or ``version`` is empty or has a
                control character (no header could name it).
            UpdateConflict, DrainTimeout: see :meth:`hold`.
            Exception: vLLM's ``reload_weights`` failed (the server is released under its old
                version; vLLM may have loaded some of the new weights: push again).
        """
        if not version:
            raise InvalidRequest("version must be a non-empty string, new for every set of weights")
        _check_version(version)
        if not Path(weights_path).is_dir():
            raise InvalidRequest(f"weights_path {weights_path!r} is not a folder on this server")
        held = await self.hold(timeout_s=timeout_s)
        self._state = "updating"  # no release but this update's own from here
        try:
            start = time.monotonic()
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
            reload_s = time.monotonic() - start
        except BaseException:
            logger.exception("mmref: reload_weights failed; released under the old version")
            await self._release_twice(None)
            raise
        released = await self._release_twice(version)
        return {**held, **released, "reload_seconds": round(reload_s, 6)}


_SETTLE_POLL_S = 0.01

_NOT_HELD = {
    "idle": "the server is not held for a weight update",
    "holding": "a hold or an update is still draining the server: release it once it is held",
    "updating": "an update holds the server: it releases the server itself",
}


def _check_version(version: str) -> None:
    """Refuse a version no response header can carry (``weights.version_header``).

    Raises:
        InvalidRequest: a control character (CR, LF, NUL...) in ``version``.
    """
    if version_header(version) is None:
        raise InvalidRequest(f"version {version[:80]!r} has a control character: no header can name it")
