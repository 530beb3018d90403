"""Sync and async clients of ``POST /inference/v1/generate`` (httpx): messages in, :class:`Rollout` out.

One call: chat messages (or a :class:`~rollout_client.conversation.Conversation`) -> the model's
chat template -> images offloaded once per content -> placeholders expanded -> the request (refs
as strings, the image placeholder suppressed, ``logprobs: 0``) -> retries -> a parsed
:class:`~rollout_client.result.Rollout` (``.to_training_sample()``). Groups of ``n`` samples of one
prompt share one ``X-Session-ID`` (a router keeps them on one server: one prefill in its prefix
cache, one resolve of each image); a conversation's turns share its own.

The calls themselves (``generate``, ``generate_tokens``, ``sample_group``) are written once, in
:mod:`rollout_client.core`; this module holds the two transports that run them. The request and the
answer: :mod:`rollout_client.wire`; which weight version is the newest:
:mod:`rollout_client.versions`; when to send again: :mod:`rollout_client.retry`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from rollout_client.core import Blocking, ClientCore, Concurrent, Flow, Post, Sleep, T, step
from rollout_client.result import Rollout

__all__ = ["AsyncRolloutClient", "RolloutClient"]


class RolloutClient(ClientCore[Rollout, list[Rollout]]):
    """Synchronous client (``httpx.Client``). Thread-safe; a group's requests run on threads.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        model_dir: the served model's folder (tokenizer, chat template, image processor config).
        asset_root: the run's asset store (inside the server's ``MMREF_ASSET_ROOT``).
        retry: the :class:`RetryPolicy` (default: 6 attempts, full-jitter backoff from 0.25 s to 8 s,
            900 s per call).
        timeout: seconds one attempt may wait for its answer (generation included, and the wait of a
            request sent during a weight update).
        connect_timeout: seconds to connect.
        suppress_placeholders: bias the image placeholder token out of every sample (default on).
        suppress_token_ids: more token ids to bias out.
        template, offloader: share a :class:`ChatTemplate` / :class:`Offloader` between clients.
        headers: sent with every request (e.g. an ``Authorization`` for vLLM's ``--api-key``).
        max_concurrency: a group's requests in flight at once.
        seed: seeds the backoff jitter (tests).
        http_client: an ``httpx.Client`` to use (its base URL is ignored; the client does not close it).
    """

    def _new_http(self, limits: httpx.Limits) -> httpx.Client:
        return httpx.Client(limits=limits)

    def close(self) -> None:
        """Close the HTTP connections (when the client made them)."""
        if self._owns_http:
            self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drive(self, flow: Flow[T]) -> T:
        done, item = step(flow, None)
        while not done:
            done, item = step(flow, self._perform(item))
        return item

    def _perform(self, effect: Any) -> Any:
        if isinstance(effect, Post):
            try:
                return effect.send(self.http)
            except httpx.TransportError as e:
                return e
        if isinstance(effect, Sleep):
            return time.sleep(effect.seconds)
        if isinstance(effect, Concurrent):
            with ThreadPoolExecutor(max_workers=max(1, min(len(effect.flows), self.max_concurrency))) as pool:
                return list(pool.map(self._drive, effect.flows))
        assert isinstance(effect, Blocking)
        return effect.fn(*effect.args)


class AsyncRolloutClient(ClientCore[Awaitable[Rollout], Awaitable[list[Rollout]]]):
    """Asynchronous client (``httpx.AsyncClient``); the arguments and methods of
    :class:`RolloutClient` (``http_client``: an ``httpx.AsyncClient``), awaited. Prompt building
    (template, image decode and write) runs in a worker thread (``asyncio.to_thread``), off the
    event loop; a group's requests run as tasks, at most ``max_concurrency`` at once.
    """

    def _new_http(self, limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(limits=limits)

    async def aclose(self) -> None:
        """Close the HTTP connections (when the client made them)."""
        if self._owns_http:
            await self.http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _drive(self, flow: Flow[T], gate: asyncio.Semaphore | None = None) -> T:
        done, item = step(flow, None)
        while not done:
            done, item = step(flow, await self._perform(item, gate))
        return item

    async def _perform(self, effect: Any, gate: asyncio.Semaphore | None) -> Any:
        if isinstance(effect, Post):
            async with gate or contextlib.nullcontext():
                try:
                    return await effect.send(self.http)
                except httpx.TransportError as e:
                    return e
        if isinstance(effect, Sleep):
            return await asyncio.sleep(effect.seconds)
        if isinstance(effect, Concurrent):
            inner = asyncio.Semaphore(max(1, self.max_concurrency))
            return list(await asyncio.gather(*(self._drive(f, inner) for f in effect.flows)))
        assert isinstance(effect, Blocking)
        return await asyncio.to_thread(effect.fn, *effect.args)
