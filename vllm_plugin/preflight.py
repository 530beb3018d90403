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

__all__ = [
    "SUPPORTED_VLLM",
    "check_settings",
    "check_vllm_version",
    "problems",
    "refuse_insecure_serialization",
]

logger = logging.getLogger("vllm.mmref")  # a child of vLLM's configured logger

SUPPORTED_VLLM = ">=0.32.0,<0.34"
"""vLLM releases this plugin supports (the ``serve``/``serve-cuda`` extras of pyproject.toml say
the same; a test keeps them equal): exactly the releases the door's table is checked against
(``upstream.CHECKED_VLLM``: 0.32 installed and run, 0.33 statically from its wheel,
docs/VLLM-SURFACE.md)."""


def check_vllm_version(version: str | None = None) -> str:
    """Return the installed vLLM version, or refuse one outside :data:`SUPPORTED_VLLM`.

    Raises:
        RuntimeError: naming the supported range and the installed version.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        from upstream import vllm_version

        version = vllm_version()
    try:  # local tags and dev/rc suffixes do not matter: 0.33.1+cu130 and 0.33.0rc1 are 0.33.x
        ok = SpecifierSet(SUPPORTED_VLLM).contains(Version(version).base_version)
    except InvalidVersion:
        ok = False
    if not ok:
        raise RuntimeError(f"mmref supports vLLM {SUPPORTED_VLLM}; this server runs vLLM {version}")
    return version


def problems() -> list[str]:
    """What stops the server now, one line each (empty: start). Logs the unknown ``MMREF_*``
    variables (WARNING) first."""
    from protocol.settings import SettingError, warn_unknown_variables
    from vllm_plugin.config import PluginConfig

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
    from upstream import load

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
    from upstream import load

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
