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

With several API processes the hold is one state for the whole server (``hold_state.py``): every
process's gate follows it, the drain waits for every process's admitted requests, and a release
reaching any process ends it. A hold not released within its lease (``MMREF_HOLD_TIMEOUT_S``) is
released by whichever process sees it first, and logged: a lost client never freezes generation.

So an answer is generated under one set of weights and is labelled with it
(``x-mmref-weight-version``); a request that arrives during an update waits and runs under the
new weights. Never a 5xx, never a mix, nothing cut short. The cost: an update waits for the
longest request in flight (``timeout_s`` bounds it: ``DrainTimeout``, nothing changed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from protocol.errors import DrainTimeout, InvalidRequest, UpdateConflict
from vllm_plugin.admission import Admission
from vllm_plugin.hold_state import HoldRecord, SharedHold, new_token, now
from vllm_plugin.weights import version_header

__all__ = ["DEFAULT_LEASE_S", "WeightUpdates"]

logger = logging.getLogger("vllm.mmref")

DEFAULT_LEASE_S = 300.0
"""A hold's lease when ``MMREF_HOLD_TIMEOUT_S`` is unset (seconds)."""
_POLL_S = 0.02
"""How often a process looks at the shared hold (its watcher; a drain waiting for the others)."""


class WeightUpdates:
    """Holds, updates and releases the served weights (see the module doc).

    Args:
        engine_client: vLLM's ``EngineClient`` (``AsyncLLM``).
        admission: this API process's gate.
        versions: reads the engine's weight version.
        shared: the server's hold, shared by its API processes (default: this process's own).
        lease_s: how long a hold may last unreleased (seconds; :meth:`watch` enforces it).
    """

    def __init__(
        self,
        engine_client: Any,
        admission: Admission,
        versions: Callable[[], Awaitable[str]],
        shared: SharedHold | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.engine = engine_client
        self.admission = admission
        self.versions = versions
        if shared is None:
            shared = SharedHold(Path(tempfile.mkstemp(prefix="mmref-hold-")[1]))
        self.shared = shared
        self.lease_s = lease_s
        shared.join()

    @property
    def held(self) -> bool:
        """Whether a hold or an update has the server (from its drain to its release)."""
        return self.shared.read().state != "idle"

    async def settled(self) -> None:
        """Wait until no hold drains, no update reloads and no release runs."""
        while self.shared.read().state not in ("idle", "held"):
            await asyncio.sleep(_POLL_S)

    async def hold(self, *, timeout_s: float | None = None, abort: bool = False) -> dict[str, Any]:
        """Close every gate, drain every process's requests, pause the engine once it is idle.

        ``abort``: vLLM aborts the requests in flight first (``pause_generation(mode="abort")``,
        no cache cleared: they end with ``finish_reason: abort``), as vLLM's ``/pause`` does; the
        engine then runs again for the drain (a request admitted before the gate closed but not
        yet in the engine would otherwise wait in the paused engine for good).

        Raises:
            UpdateConflict: the server is already held, or a hold or an update is under way.
            DrainTimeout: requests still ran after ``timeout_s`` (gates open again, engine running).
        """
        token = self._take()
        start = time.monotonic()
        try:
            if abort:
                await self.engine.pause_generation(mode="abort", clear_cache=False)
                await self.engine.resume_generation()
            drained = await self._drain(token, timeout_s)
            left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
            await self._pause(left, timeout_s)
        except BaseException:
            if abort:  # vLLM's abort may have paused the engine
                with contextlib.suppress(Exception):
                    await self.engine.resume_generation()
            self._end(token)
            raise
        with self.shared.edit() as record:
            record.state = "held"
        drained_s = time.monotonic() - start
        logger.info("mmref: weights held (%d requests drained in %.3f s)", drained, drained_s)
        return {"held": True, "drained_requests": drained, "drain_seconds": round(drained_s, 6)}

    def _take(self) -> str:
        """Mark the server ``closing`` for a new hold and close this process's gate.

        Raises:
            UpdateConflict: the server is not idle.
        """
        with self.shared.edit() as record:
            if record.state != "idle":
                raise UpdateConflict(
                    "the server is already held for a weight update: release it first"
                    if record.state == "held"
                    else _NOT_HELD[record.state]
                )
            token = new_token()
            record.state, record.owner, record.token, record.since = "closing", self.shared.pid, token, now()
        self.admission.close()
        return token

    async def _drain(self, token: str, timeout_s: float | None) -> int:
        """Wait until every API process has closed its gate for ``token`` and has no admitted
        request; returns the most requests seen in flight.

        Raises:
            DrainTimeout: not within ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        most = 0
        while True:
            self.shared.report(self.admission.admitted, token)
            record = self.shared.read()
            counts = [n for n, ack in record.members.values() if ack == token]
            most = max(most, sum(counts))
            if len(counts) == len(record.members) and not any(counts):
                return most
            if deadline is not None and time.monotonic() > deadline:
                raise DrainTimeout(
                    f"{sum(counts)} requests admitted before the update still run after {timeout_s} s; "
                    "nothing was changed"
                )
            await asyncio.sleep(_POLL_S)

    async def _pause(self, left: float | None, timeout_s: float | None) -> None:
        """Pause the engine (``wait``, no cache clear); undone if it fails or times out."""
        try:
            await asyncio.wait_for(self.engine.pause_generation(mode="wait", clear_cache=False), left)
        except BaseException as e:  # the pause may have reached the engine: undo it
            with contextlib.suppress(Exception):
                await self.engine.resume_generation()
            if isinstance(e, TimeoutError):
                raise DrainTimeout(
                    f"the engine still ran requests after {timeout_s} s; nothing was changed"
                ) from None
            raise

    def _end(self, token: str | None) -> None:
        """The hold ``token`` is over (None: whichever): the server idle, this process's gate open."""
        with self.shared.edit() as record:
            if token is None or record.token == token:
                record.state, record.owner, record.token = "idle", None, None
        self.admission.open()

    async def release(self, *, version: str | None) -> dict[str, Any]:
        """Reset the encoder and prefix caches, set ``version`` (if given), resume, open the gates.

        Raises:
            UpdateConflict: the server is not held: no hold, a hold still draining, or an update
                (it releases the server itself).
            InvalidRequest: ``version`` has a control character (no header could name it).
            Exception: vLLM's cache reset or version call failed: the server stays held (send
                ``release`` again); or resuming failed: the gates open all the same.
        """
        if version is not None:
            _check_version(version)
        return await self._release(version, expect="held")

    async def release_after_call(self) -> dict[str, Any]:
        """Release a hold taken around one call of vLLM's (``control.py``): once more if the
        first release fails before resuming; its caller has no hold to release again."""
        return await self._release_twice(None, expect="held")

    async def _release_twice(self, version: str | None, expect: str) -> dict[str, Any]:
        """:meth:`_release`, once more if it fails before resuming (a transient RPC error): the
        update's caller has no hold of its own to release; failing twice, the server stays held."""
        try:
            return await self._release(version, expect=expect)
        except UpdateConflict:
            raise
        except Exception:
            return await self._release(version, expect="held")

    async def _release(self, version: str | None, *, expect: str, token: str | None = None) -> dict[str, Any]:
        """Reset, version, resume, open. A failed reset or version leaves the server held (gates
        closed, engine paused: resuming would serve the old weights' caches or version under the
        new weights), so that ``release`` can be sent again; the gates open whatever resuming does.

        Raises:
            UpdateConflict: the server is not in state ``expect`` (or not under hold ``token``).
        """
        with self.shared.edit() as record:
            if record.state != expect:
                raise UpdateConflict(_NOT_HELD.get(record.state, _NOT_HELD["updating"]))
            if token is not None and record.token != token:
                raise UpdateConflict("the hold to release was released already")
            record.state, held_token, since = "releasing", record.token, record.since
        try:
            await self.engine.reset_encoder_cache()
            prefix_reset = bool(await self.engine.reset_prefix_cache())
            if not prefix_reset:  # nothing runs: vLLM refuses only while blocks are in use
                logger.warning("mmref: vLLM did not reset its prefix cache during a weight update")
            if version is not None:
                await self.engine.update_weight_version(version)
        except BaseException:
            with self.shared.edit() as record:
                record.state = "held"
            logger.exception("mmref: a weight release failed before resuming: still held, release again")
            raise
        try:
            await self.engine.resume_generation()
        finally:
            self._end(held_token)
            held_s = now() - since
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
        with self.shared.edit() as record:
            record.state = "updating"  # no release but this update's own from here
        try:
            start = time.monotonic()
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
            reload_s = time.monotonic() - start
        except BaseException:
            logger.exception("mmref: reload_weights failed; released under the old version")
            await self._release_twice(None, expect="updating")
            raise
        released = await self._release_twice(version, expect="updating")
        return {**held, **released, "reload_seconds": round(reload_s, 6)}

    async def watch(self) -> None:
        """Follow the server's hold, forever (a task per API process): this process's gate is
        closed while the server is not idle and open once it is; its admitted requests are reported
        while a hold drains; a hold held past its lease is released (logged)."""
        while True:
            try:
                await self._follow(self.shared.read())
            except Exception:  # never let the watcher die: the next look tries again
                logger.exception("mmref: the weight-update watcher failed; looking again")
            await asyncio.sleep(_POLL_S)

    async def _follow(self, record: HoldRecord) -> None:
        if record.state == "idle":
            if not self.admission.is_open:
                self.admission.open()
            return
        if self.admission.is_open:
            self.admission.close()
        mine = record.members.get(str(self.shared.pid))
        if mine != [self.admission.admitted, record.token]:
            self.shared.report(self.admission.admitted, record.token)
        if record.state == "held" and now() - record.since > self.lease_s:
            with contextlib.suppress(UpdateConflict):  # another process released it first
                await self._release(None, expect="held", token=record.token)
                logger.warning(
                    "mmref: a weight hold (process %s) was not released within its lease of %.0f s "
                    "(MMREF_HOLD_TIMEOUT_S): released",
                    record.owner,
                    self.lease_s,
                )


_NOT_HELD = {
    "idle": "the server is not held for a weight update",
    "closing": "a hold or an update is still draining the server: release it once it is held",
    "updating": "an update holds the server: it releases the server itself",
    "releasing": "a release of the server is under way",
}


def _check_version(version: str) -> None:
    """Refuse a version no response header can carry (``weights.version_header``).

    Raises:
        InvalidRequest: a control character (CR, LF, NUL...) in ``version``.
    """
    if version_header(version) is None:
        raise InvalidRequest(f"version {version[:80]!r} has a control character: no header can name it")
