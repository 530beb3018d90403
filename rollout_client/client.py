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
import threading
import time
from collections.abc import Awaitable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import httpx

from rollout_client.core import Answer, Blocking, ClientCore, Concurrent, Flow, Post, Sleep, T, step
from rollout_client.result import Rollout

__all__ = ["AsyncRolloutClient", "RolloutClient"]


class _Abandoned(Exception):
    """A flow of a group stopped because another one failed (never leaves the client)."""


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
        max_concurrency: a group's requests in flight at once (the client's own connection pool
            has no cap: groups run side by side).
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

    def _drive(self, flow: Flow[T], stop: threading.Event | None = None) -> T:
        done, item = step(flow, None)
        while not done:
            if stop is not None and stop.is_set():  # another flow of its group failed
                flow.close()
                raise _Abandoned
            done, item = step(flow, self._perform(item, stop))
        return item

    def _perform(self, effect: Any, stop: threading.Event | None) -> Any:
        if isinstance(effect, Post):
            try:
                response = effect.send(self.http)
            except httpx.TransportError as e:
                response = e
            return Answer(response, time.monotonic())
        if isinstance(effect, Sleep):
            return stop.wait(effect.seconds) if stop is not None else time.sleep(effect.seconds)
        if isinstance(effect, Concurrent):
            return self._concurrent(effect.flows)
        assert isinstance(effect, Blocking)
        return effect.fn(*effect.args)

    def _concurrent(self, flows: list[Flow[Any]]) -> list[Any]:
        """The flows on threads; at the first error the others stop before their next attempt or
        wait (one in flight finishes in the background) and the error is raised at once."""
        stop = threading.Event()
        pool = ThreadPoolExecutor(max_workers=max(1, min(len(flows), self.max_concurrency)))
        futures = [pool.submit(self._drive, flow, stop) for flow in flows]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f.done() and f.exception() is not None]
        stop.set()
        pool.shutdown(wait=not failed, cancel_futures=True)
        if failed:
            raise failed[0].exception()  # type: ignore[misc]
        return [f.result() for f in futures]


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
                    response = await effect.send(self.http)
                except httpx.TransportError as e:
                    response = e
                return Answer(response, time.monotonic())
        if isinstance(effect, Sleep):
            return await asyncio.sleep(effect.seconds)
        if isinstance(effect, Concurrent):
            return await self._concurrent(effect.flows)
        assert isinstance(effect, Blocking)
        return await asyncio.to_thread(effect.fn, *effect.args)

    async def _concurrent(self, flows: list[Flow[Any]]) -> list[Any]:
        """The flows as tasks; at the first error the others are cancelled (their requests in
        flight too) and the error is raised."""
        gate = asyncio.Semaphore(max(1, self.max_concurrency))
        tasks = [asyncio.ensure_future(self._drive(flow, gate)) for flow in flows]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
