"""The ``vllm.general_plugins`` entry point ``mmref`` (``vllm_plugin.preflight:check_settings``):
the plugin's settings checked in the launcher process before vLLM builds anything.

vLLM loads its general plugins while it builds its argument parser
(``AsyncEngineArgs.add_cli_args`` -> ``vllm.plugins.load_general_plugins``), i.e. once ``vllm`` is
imported and before the arguments are parsed, the model config read or the engine started; it
calls each plugin's function without catching what it raises. The endpoint plugin itself
(``plugin.py``) is instantiated only in ``build_app``, after the engine has started (measured
2 min 23 s on a CPU machine before issue 49). Here, at ~10 s from the launch on this machine
(almost all of it Python importing torch and vLLM), a server whose ``MMREF_*`` settings are bad
or missing, or whose vLLM is outside the supported range, stops with one line naming the
variable, its value and what is allowed; unknown ``MMREF_*`` variables are logged with the
closest known name. General plugins load in every vLLM process (engine core, workers, the API
servers of ``--api-server-count``): the check runs only in the launcher (no parent process) and
only when ``VLLM_PLUGINS`` names ``mmref`` (the endpoint plugin loads only then).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys

__all__ = ["check_settings", "problems", "refuse_insecure_serialization"]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger


def problems() -> list[str]:
    """What stops the server now, one line each (empty: start). Logs the unknown ``MMREF_*``
    variables (WARNING) first."""
    from protocol.settings import SettingError, warn_unknown_variables
    from vllm_plugin.config import PluginConfig
    from vllm_plugin.plugin import check_vllm_version

    warn_unknown_variables(log=logger)
    found = []
    for check in (check_vllm_version, refuse_insecure_serialization, PluginConfig):
        try:
            check()
        except (SettingError, RuntimeError) as e:
            found.append(str(e))
    return found


def refuse_insecure_serialization() -> None:
    """Stop start-up under ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``: vLLM's msgpack decoder would
    unpickle objects, and ``mmfile`` payloads come from a shared store (code execution for anyone
    who can write it). Run here and again by ``startup.refuse_unsafe_settings``.

    Raises:
        RuntimeError: naming the setting.
    """
    from vllm_plugin.vllm_surface import load

    if load("envs.VLLM_ALLOW_INSECURE_SERIALIZATION"):
        raise RuntimeError(
            "mmref refuses VLLM_ALLOW_INSECURE_SERIALIZATION=1: mmfile feature payloads from the "
            "shared store would be unpickled"
        )


def check_settings() -> None:
    """The entry point: refuse to start (exit status 1, nothing else started yet: no engine, no
    socket, no child process) on any of :func:`problems`, each logged as one ERROR line.

    Ends the process with ``os._exit`` after flushing: Python's own shutdown of torch and vLLM
    would add ~1.7 s (measured) to a server that has nothing to clean up.
    """
    from vllm_plugin.vllm_surface import load

    if "mmref" not in (load("envs.VLLM_PLUGINS") or ()) or multiprocessing.parent_process() is not None:
        return
    found = problems()
    if not found:
        return
    for line in found:
        logger.error("mmref refuses to start: %s", line)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)
