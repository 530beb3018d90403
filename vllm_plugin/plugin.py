"""The ``vllm.endpoint_plugins`` entry point (``mmref = vllm_plugin.plugin:MMRefEndpointPlugin``).

Loaded by the stock vLLM API server when ``VLLM_PLUGINS`` names ``mmref``. vLLM logs and swallows
a plugin that fails to import or to instantiate, so this module imports nothing from vLLM (its
vLLM names come through ``upstream``, the door, when called). The settings and the
supported vLLM range are checked before the engine starts by ``preflight.py`` (a
``vllm.general_plugins`` entry point), and again here: the version in
:meth:`MMRefEndpointPlugin.attach_router`, the settings in ``init_state`` (a launch path that
skipped the early check still stops: their exceptions stop the server instead of leaving the
route missing).
"""

from __future__ import annotations

import asyncio
import logging
from argparse import Namespace
from typing import Any

from upstream import load
from vllm_plugin.preflight import SUPPORTED_VLLM, check_vllm_version

__all__ = ["MMRefEndpointPlugin"]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger


class MMRefEndpointPlugin:
    """Replaces ``POST /inference/v1/generate``, adds ``POST /inference/v1/resolve``, and resolves
    refs in image URLs on vLLM's own routes (the media connector ``mmref``, ``connector.py``)."""

    name = "mmref"
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        """Check the vLLM version, then attach the routes and the admission middleware (an
        exception here stops the server).

        Raises:
            RuntimeError: unsupported vLLM (see :func:`check_vllm_version`).
        """
        version = check_vllm_version()
        from vllm_plugin import api_router, connector
        from vllm_plugin.admission import AdmissionMiddleware
        from vllm_plugin.control import ControlMiddleware

        dev_mode = bool(load("envs.VLLM_SERVER_DEV_MODE"))
        api_router.attach_router(app, dev_mode=dev_mode)
        app.add_middleware(AdmissionMiddleware)
        app.add_middleware(ControlMiddleware)
        connector.register()  # in this API-server process, where vLLM's chat parser loads it
        chat_refs = connector.enable()
        logger.info("mmref: routes attached (vLLM %s, supported %s)", version, SUPPORTED_VLLM)
        logger.info(
            "mmref: refs in image URLs %s",
            "on (media connector mmref)" if chat_refs else "off (VLLM_MEDIA_CONNECTOR names another)",
        )
        logger.info(
            "mmref: weight-update routes /mmref/v1/weights/* %s",
            "on" if dev_mode else "off (VLLM_SERVER_DEV_MODE unset)",
        )

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Build the serving object from the served model: its adapter wraps vLLM's own image processor.

        Raises:
            protocol.settings.SettingError: bad ``MMREF_*`` settings (e.g. no ``MMREF_ASSET_ROOT``).
            UnsupportedFamily: the served model has no adapter.
            RuntimeError: settings under which refs would be unsafe or silently processed
                differently from vLLM (see ``startup.refuse_unsafe_settings``).
        """
        if engine_client is None:  # vLLM's CPU-only render server: no engine, no route
            state.mmref_serving = None
            return
        from vllm_plugin import chat_refs, request_scope
        from vllm_plugin.admission import Admission
        from vllm_plugin.connector import CONNECTOR_NAME
        from vllm_plugin.control import ControlGate
        from vllm_plugin.hold_state import SharedHold
        from vllm_plugin.startup import build_serving
        from vllm_plugin.updates import WeightUpdates

        serving = build_serving(engine_client, state, args)
        on = load("envs.VLLM_MEDIA_CONNECTOR") == CONNECTOR_NAME
        request_scope.activate(chat_refs.ChatRefs(serving.resolver) if on else None)
        admission = Admission(serving.weight_version, serving.split_rule, serving.max_body_bytes)
        # cached by vLLM's engine client: no request's hand-off then waits on the engine before
        # its send (``engine_items.py``: the send follows the hand-off in the same step)
        await engine_client.get_supported_tasks()
        state.mmref_serving = serving
        state.mmref_admission = admission
        dev_mode = bool(load("envs.VLLM_SERVER_DEV_MODE"))  # the update routes exist
        shared = SharedHold.for_server(args.port) if dev_mode else None
        updates = WeightUpdates(
            engine_client, admission, serving.weight_version, shared, lease_s=serving.config.hold_timeout_s
        )
        state.mmref_updates = updates
        if dev_mode:  # vLLM's control routes through the gate; the hold followed across processes
            state.mmref_control = ControlGate(updates, engine_client)
            state.mmref_watch = asyncio.get_running_loop().create_task(updates.watch())
        resolver = serving.resolver
        logger.info(
            "mmref: serving refs for %s (fingerprint %s, %s pixels, backend %s) from asset roots %s "
            "(v1 refs and feature files under %s); body limit %d bytes, grids of at most %d patches, "
            "engine item cache %s (items as cache handles: %s)",
            serving.adapter.family,
            serving.adapter.fingerprint,
            resolver.pixel_mode,
            serving.adapter.backend,
            resolver.store.describe(),  # as configured: never a credential (protocol/roots.py)
            serving.config.asset_root,
            serving.max_body_bytes,
            serving.adapter.grid_limits()[1],
            serving.engine_items.mode.value,
            "yes" if serving.engine_items.mirrors else "no",
        )
