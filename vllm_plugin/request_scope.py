"""State that crosses the layers of one request, or the process, in one place.

vLLM calls back into the plugin from places where no argument can carry the plugin's state (its
chat parser loads the media connector by name; its ``serve_tokens`` calls the engine client it was
built with). What those calls need rides here, each with who sets it and who reads it:

- **the chat service** (process-wide, one per API-server process): set by ``plugin.py``'s
  ``init_state`` (:func:`activate`); read by ``admission.py``, ``content_parts.py`` and the media
  connector ``connector.py`` (:func:`active`): refs in image URLs are off where it is None;
- **pinned images** (per request, a context variable): set by ``chat_refs.bind_body`` and
  ``content_parts.bind_content_refs`` (:func:`pin`) before vLLM parses the body; read by the
  connector (:func:`pinned`), which hands vLLM's parser the very image whose bytes named the uuid;
- **connector refusals** (per request): the record opened by the admission middleware
  (:func:`errors_scope`), filled by the connector (:func:`record_error`) for a ref it refused
  inside vLLM's parser, answered by the middleware as the plugin's typed 4xx;
- **pending items** (per request): set by ``serving.MMRefServing.serve`` around vLLM's
  ``serve_tokens`` (:func:`pending_items`); read by ``serving_tokens.HandOffClient.generate``
  (:func:`pending`), which puts the resolved refs' items into the engine input;
- **the admission ticket** (per request): set by the admission middleware once the gate admitted
  the request (:func:`admitted`); used by ``serving.MMRefServing.prepare`` (:func:`run_alone`)
  for a seeded request that must run alone (``seeds.py``).

Context variables follow the request's task (asyncio copies the context into each task), so no
request sees another's.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from protocol.errors import SeedUnsupported

if TYPE_CHECKING:
    from protocol.errors import MMRefError
    from vllm_plugin.admission import Ticket
    from vllm_plugin.chat_refs import ChatImage, ChatRefs
    from vllm_plugin.serving_tokens import ResolvedSlot

__all__ = [
    "Pending",
    "activate",
    "active",
    "admitted",
    "errors_scope",
    "pending",
    "pending_items",
    "pin",
    "pinned",
    "record_error",
    "run_alone",
]

Pending = tuple[tuple["ResolvedSlot", ...], Callable[[], None] | None]
"""The resolved refs of the request being served, and what to call at its first output."""

_SERVICE: list[ChatRefs] = []
_PINNED: contextvars.ContextVar[Mapping[str, ChatImage]] = contextvars.ContextVar("mmref_pinned")
_ERRORS: contextvars.ContextVar[list[MMRefError]] = contextvars.ContextVar("mmref_connector_errors")
_PENDING: contextvars.ContextVar[Pending] = contextvars.ContextVar("mmref_pending_items", default=((), None))
_TICKET: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("mmref_ticket", default=None)


def activate(service: ChatRefs | None) -> None:
    """Make ``service`` the one the connector and the middleware use in this process (None: off)."""
    _SERVICE[:] = [service] if service is not None else []


def active() -> ChatRefs | None:
    """The process's chat service, or None where refs on image URLs are off."""
    return _SERVICE[0] if _SERVICE else None


def pin(images: Mapping[str, ChatImage]) -> None:
    """Hold ``images`` (by ref) for the rest of the current request (its context)."""
    _PINNED.set({**_PINNED.get({}), **images})


def pinned(ref: str) -> ChatImage | None:
    """The image the current request pinned for ``ref``, if any."""
    return _PINNED.get({}).get(ref)


def errors_scope() -> list[MMRefError]:
    """Start recording the connector's refusals for the current request; returns the record."""
    record: list[MMRefError] = []
    _ERRORS.set(record)
    return record


def record_error(error: MMRefError) -> None:
    """Record a refusal raised inside vLLM's parser for the request's middleware (if it listens)."""
    record = _ERRORS.get(None)
    if record is not None:
        record.append(error)


@contextlib.contextmanager
def pending_items(
    slots: tuple[ResolvedSlot, ...], on_output: Callable[[], None] | None = None
) -> Iterator[None]:
    """The resolved refs of the request ``serve_tokens`` is about to serve (in this task), and
    what to call once the engine has answered it (its first output: the engine accepted it and
    holds its items, streamed or not; never for a request refused before)."""
    token = _PENDING.set((slots, on_output))
    try:
        yield
    finally:
        _PENDING.reset(token)


def pending() -> Pending:
    """What :func:`pending_items` set for the current request (``((), None)`` outside one)."""
    return _PENDING.get()


@contextlib.contextmanager
def admitted(ticket: Ticket | None) -> Iterator[None]:
    """The current request's admission ticket, while the middleware runs it (None: not gated)."""
    token = _TICKET.set(ticket)
    try:
        yield
    finally:
        _TICKET.reset(token)


async def run_alone() -> None:
    """Wait until the current request is the only one running, and keep others out until it ends
    (``admission.Ticket.run_alone``).

    Raises:
        SeedUnsupported: the request was not admitted through the gate (nothing can keep others out).
    """
    ticket = _TICKET.get()
    if ticket is None:
        raise SeedUnsupported(
            "a seeded request that must run alone reached the route without the admission gate"
        )
    await ticket.run_alone()
