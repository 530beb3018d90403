"""What the sync and the async client share: everything but the transport.

Each call is a *flow*: a generator holding all of the call's logic (the prompt, the body, retries
and backoff, weight versions, a group's redraws) that yields the I/O it needs as effects and gets
their results back: :class:`Post` (one HTTP attempt: its ``httpx.Response``, or the transport
error), :class:`Sleep`, :class:`Blocking` (prompt building: template, image decode and write, which
must not run on an event loop) and :class:`Concurrent` (several flows at once, their results in
order). :class:`~rollout_client.client.RolloutClient` runs the effects with ``httpx.Client``,
``time.sleep`` and threads, :class:`~rollout_client.client.AsyncRolloutClient` with
``httpx.AsyncClient``, ``asyncio.sleep``, ``asyncio.to_thread`` and tasks. The public methods are
defined here, once: each returns ``self._drive(flow)``, the result (sync) or an awaitable of it
(async).
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import httpx

from protocol.structs import RawMMRef
from rollout_client.conversation import Conversation, PreparedPrompt, PromptBuilder
from rollout_client.errors import RolloutTimeout
from rollout_client.images import Offloader
from rollout_client.result import WEIGHT_VERSION_HEADER, Rollout, parse_choices
from rollout_client.retry import RetryPolicy
from rollout_client.sampling import Sampling
from rollout_client.template import ChatTemplate, Message
from rollout_client.versions import VersionClock
from rollout_client.wire import GENERATE_PATH, Retry, encode_body, read_answer, request_headers

__all__ = [
    "Answer",
    "Blocking",
    "Call",
    "ClientCore",
    "Concurrent",
    "Flow",
    "Post",
    "Prompt",
    "Sleep",
    "step",
]

logger = logging.getLogger("rollout_client")

T = TypeVar("T")
One = TypeVar("One")
"""What a single call returns: ``Rollout`` (sync) or an awaitable of it (async)."""
Many = TypeVar("Many")
"""What a group call returns: ``list[Rollout]`` or an awaitable of it."""

Flow = Generator[Any, Any, T]
Prompt = Conversation | PreparedPrompt | Sequence[Message]
"""What a call samples from: a conversation (its next turn), a prompt already prepared
(:meth:`ClientCore.prepare`: tokens and refs, sent as they are) or a list of chat messages."""


class Post(NamedTuple):
    """One HTTP attempt; the driver sends back an :class:`Answer`."""

    url: str
    body: bytes
    headers: dict[str, str]
    timeout: httpx.Timeout

    def send(self, http: httpx.Client | httpx.AsyncClient) -> Any:
        """``http.post(...)``: the response, or (an ``AsyncClient``) an awaitable of it."""
        return http.post(self.url, content=self.body, headers=self.headers, timeout=self.timeout)


class Answer(NamedTuple):
    """What one :class:`Post` got: the ``httpx.Response`` or the ``httpx.TransportError``, and
    ``time.monotonic()`` when the driver got it back (what orders weight versions)."""

    result: Any
    received_at: float


class Sleep(NamedTuple):
    seconds: float


class Blocking(NamedTuple):
    """``fn(*args)`` off the event loop (the async driver runs it in a worker thread)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()


class Call(NamedTuple):
    """A call's settings, as its flow carries them."""

    sampling: Sampling
    session_id: str | None
    expected_version: str | None
    extra_body: Mapping[str, Any] | None


class Concurrent(NamedTuple):
    """Run the flows at once (at most ``max_concurrency`` in flight); their results, in order.
    The first flow to raise ends the others (no attempt or wait of theirs starts after it; the
    async client cancels their requests in flight) and its error is raised."""

    flows: list[Flow[Any]]


def step(flow: Flow[T], value: Any) -> tuple[bool, Any]:
    """Send ``value`` into ``flow``: ``(False, its next effect)`` or ``(True, its result)``."""
    try:
        return False, flow.send(value)
    except StopIteration as stop:
        return True, stop.value


class ClientCore(Generic[One, Many]):
    """The clients' shared state and calls (the arguments: :class:`~rollout_client.RolloutClient`)."""

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
        http_client: Any = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.template = template or ChatTemplate(model_dir)
        self.offloader = offloader or Offloader(model_dir, asset_root)
        """The asset-store writer (its ``stats`` count offloads and content hits)."""
        self.builder = PromptBuilder(self.template, self.offloader)
        self.retry = retry or RetryPolicy()
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.suppress_placeholders = suppress_placeholders
        self.extra_suppressed = tuple(int(t) for t in suppress_token_ids)
        self.headers = dict(headers or {})
        self.max_concurrency = max_concurrency
        self.versions = VersionClock()
        self._rng = random.Random(seed)
        # No cap on connections: max_concurrency bounds one group's requests, not the client's
        # (many groups at once is the usual rollout; a capped pool would queue them).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max(20, max_concurrency))
        self._owns_http = http_client is None
        self.http = http_client or self._new_http(limits)

    def _new_http(self, limits: httpx.Limits) -> Any:
        raise NotImplementedError

    def _drive(self, flow: Flow[T]) -> Any:
        """Run ``flow``'s effects: its result (sync) or an awaitable of it (async)."""
        raise NotImplementedError

    @property
    def latest_weight_version(self) -> str | None:
        """The version named by the latest answer this client received (the newest it knows)."""
        return self.versions.latest

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """The token ids every request biases out: the image placeholder and, for a family with a
        video path, the video placeholder (unless ``suppress_placeholders=False``) and
        ``suppress_token_ids``."""
        ids = list(self.extra_suppressed)
        if self.suppress_placeholders:
            ids.append(self.builder.placeholder_token_id)
            if self.builder.video_token_id is not None:
                ids.append(self.builder.video_token_id)
        return tuple(sorted(set(ids)))

    def conversation(
        self, messages: Sequence[Message] = (), *, session_id: str | None = None
    ) -> Conversation:
        """A new :class:`Conversation` (its own ``X-Session-ID``) whose turns this client generates."""
        return Conversation(self.builder, messages, session_id=session_id)

    def prepare(self, prompt: Prompt) -> PreparedPrompt:
        """The prompt's tokens and refs (images offloaded; a conversation is not changed; a
        prepared prompt is returned as it is)."""
        if isinstance(prompt, PreparedPrompt):
            return prompt
        if isinstance(prompt, Conversation):
            return prompt.prepare()
        return self.builder.first_turn(prompt)

    def body(
        self, prepared: PreparedPrompt, sampling: Sampling, extra_body: Mapping[str, Any] | None = None
    ) -> bytes:
        """The request body of ``prepared`` (:func:`rollout_client.wire.encode_body`)."""
        return encode_body(prepared, sampling.params(self.suppressed_token_ids()), extra_body)

    def generate(
        self,
        prompt: Prompt,
        sampling: Sampling | None = None,
        *,
        session_id: str | None = None,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> One:
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
        call = Call(sampling or Sampling(), session_id, expected_weight_version, extra_body)
        return self._drive(self._generate(prompt, call))

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        images: Sequence[RawMMRef | str] = (),
        sampling: Sampling | None = None,
        *,
        session_id: str | None = None,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> One:
        """One completion of a prompt already in tokens (each image's placeholders expanded) with
        its refs (``RawMMRef`` or ref strings, prompt order; a rollout of bare strings cannot become
        a ``TrainingSample``: it has no grids). Raises as :meth:`generate`."""
        prepared = PreparedPrompt(list(prompt_ids), tuple(images))  # type: ignore[arg-type]
        call = Call(sampling or Sampling(), session_id, expected_weight_version, extra_body)
        return self._drive(self._tokens(prepared, call))

    def sample_group(
        self,
        prompt: Prompt,
        n: int,
        sampling: Sampling | None = None,
        *,
        expected_weight_version: str | None = None,
        extra_body: Mapping[str, Any] | None = None,
        one_version: bool = True,
    ) -> Many:
        """``n`` completions of one prompt, one ``X-Session-ID`` (a new uuid) for all of them.

        The prompt is built and its images offloaded once; the ``n`` requests run at once, at most
        ``max_concurrency`` in flight. A conversation is not changed (record one of the rollouts
        with ``conversation.record`` to continue it). With ``one_version`` (default), samples
        answered under another weight version than the newest (:mod:`rollout_client.versions`)
        are drawn again.

        Raises:
            WeightVersionMismatch: the group did not come under one version within the retry
                policy's attempts.
            Otherwise as :meth:`generate`.
        """
        call = Call(sampling or Sampling(), None, expected_weight_version, extra_body)
        return self._drive(self._group(prompt, n, one_version, call))

    # --- the flows ---------------------------------------------------------------------------------

    def _prepare_all(self, prompt: Prompt) -> PreparedPrompt:
        """:meth:`prepare`, and the suppressed ids known (the adapter loaded): blocking work."""
        self.suppressed_token_ids()
        return self.prepare(prompt)

    def _generate(self, prompt: Prompt, call: Call) -> Flow[Rollout]:
        prepared = yield Blocking(self._prepare_all, (prompt,))
        if isinstance(prompt, Conversation):
            call = call._replace(session_id=call.session_id or prompt.session_id)
        rollout = yield from self._send(prepared, call)
        if isinstance(prompt, Conversation):
            yield Blocking(prompt.record, (rollout,))
        return rollout

    def _tokens(self, prepared: PreparedPrompt, call: Call) -> Flow[Rollout]:
        if self.suppress_placeholders:  # first use loads the adapter: blocking
            yield Blocking(self.suppressed_token_ids)
        return (yield from self._send(prepared, call))

    def _group(self, prompt: Prompt, n: int, one_version: bool, call: Call) -> Flow[list[Rollout]]:
        started = time.monotonic()
        prepared = yield Blocking(self._prepare_all, (prompt,))
        call = call._replace(session_id=uuid.uuid4().hex)

        def draw(k: int) -> Concurrent:
            return Concurrent([self._send(prepared, call, started) for _ in range(k)])

        group = list((yield draw(n)))
        for _ in range(self.retry.max_attempts - 1):  # at most max_attempts draws in all
            stale = self.versions.stale(group) if one_version else []
            if not stale:
                return group
            logger.info("rollout_client: %d of a group of %d under older weights: drawn again", len(stale), n)
            for i, rollout in zip(stale, (yield draw(len(stale))), strict=True):
                group[i] = rollout
        if one_version and self.versions.stale(group):
            raise self.versions.unsettled(group)
        return group

    def _send(self, prepared: PreparedPrompt, call: Call, started: float | None = None) -> Flow[Rollout]:
        """One request, sent again on retryable answers until the policy gives up (its attempts,
        or the deadline of the call that began at ``started``, default now)."""
        headers = request_headers(self.headers, call.session_id)
        body = self.body(prepared, call.sampling, call.extra_body)
        post = Post(self.base_url + GENERATE_PATH, body, headers, httpx.Timeout(None))
        started, failures = time.monotonic() if started is None else started, 0
        while True:
            timeout = self._attempt_timeout(self.retry.deadline_s - (time.monotonic() - started))
            answer, received_at = yield post._replace(timeout=timeout)
            if isinstance(answer, httpx.Response) and answer.status_code == 200:
                self.versions.observe(answer.headers.get(WEIGHT_VERSION_HEADER), received_at)
            outcome = read_answer(
                answer,
                expected_version=call.expected_version,
                retry_statuses=self.retry.statuses,
                read_timeout=timeout.read,
            )
            if not isinstance(outcome, Retry):
                (rollout,) = parse_choices(
                    outcome,
                    answer.headers,
                    prepared,
                    temperature=call.sampling.temperature,
                    session_id=call.session_id,
                    attempts=failures + 1,
                )
                return rollout
            failures += 1
            yield Sleep(self._next_delay(failures, outcome, started))

    def _attempt_timeout(self, remaining: float) -> httpx.Timeout:
        if remaining <= 0:
            raise RolloutTimeout(f"the call's deadline ({self.retry.deadline_s} s) passed")
        read = min(self.timeout, remaining)
        return httpx.Timeout(read, connect=min(self.connect_timeout, read))

    def _next_delay(self, failures: int, outcome: Retry, started: float) -> float:
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
