"""Prompts from chat messages, single- and multi-turn: :class:`PromptBuilder`, :class:`Conversation`.

A turn's prompt is built once, in tokens, and never re-rendered:

- turn 1: the chat template's text for the messages (each image and each video one placeholder),
  tokenized, each image's and each video's placeholder expanded to its ``num_placeholders``
  (:func:`expand_placeholders`: vLLM's chat route expands a Qwen2.5-VL video the same way, one
  run of ``<|video_pad|>``; a Qwen3-VL video, one run per frame between timestamp text, is the
  chat route's only, and refused here);
- turn k > 1: turn k-1's prompt + the tokens the model sampled + the template's text between that
  assistant turn and the next generation prompt (its end-of-turn, the new messages, the generation
  prompt), found by rendering the conversation with a sentinel assistant message and taking what
  follows the sentinel. An end-of-turn token the model sampled itself (``finish_reason == "stop"``)
  is not added twice.

So every turn's prompt starts with the previous turn's prompt and completion, token for token: the
server's prefix cache and the trainer see exactly what was sampled (no detokenize-retokenize
drift), the earlier images are re-sent as the refs they already are (nothing re-read, nothing
offloaded again), and the whole conversation is one :class:`~protocol.structs.TrainingSample` with
loss on every assistant turn (:meth:`Conversation.training_sample`). A template that rewrites earlier
turns when a new one is added (e.g. one that strips earlier reasoning) is refused with a message.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import PlaceholderMismatch
from protocol.structs import MMRefs, RawMMRef, TrainingSample
from rollout_client.images import ImageInput, Offloader
from rollout_client.result import Rollout
from rollout_client.template import ChatTemplate, Message

__all__ = ["Conversation", "PreparedPrompt", "PromptBuilder", "expand_placeholders"]

_SENTINEL = "\u2063mmref-turn-sentinel\u2063"
"""An assistant message's stand-in while finding the text between turns (invisible separators
around a name no template or tokenizer gives meaning to)."""


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready to send: ``P`` token ids with each image's and video's placeholders expanded,
    and its refs (images and videos) in prompt order."""

    prompt_ids: list[int]
    images: tuple[RawMMRef, ...]


class PromptBuilder:
    """The model's chat template + the asset store + the placeholder token: messages -> tokens.

    Args:
        template: the model's :class:`ChatTemplate`.
        offloader: the asset store writer (:class:`Offloader`).
    """

    def __init__(self, template: ChatTemplate, offloader: Offloader) -> None:
        self.template = template
        self.offloader = offloader
        self._placeholder: int | None = None
        self._video: tuple[int | None] | None = None

    @property
    def placeholder_token_id(self) -> int:
        """The family's image placeholder id (``adapter.placeholder_token_id`` of ``config.json``)."""
        if self._placeholder is None:
            self._placeholder = self.offloader.adapter.placeholder_token_id(self.template.hf_config())
        return self._placeholder

    @property
    def video_token_id(self) -> int | None:
        """The family's video placeholder id (``config.video_token_id``); None where the adapter
        has no video path (e.g. Qwen2-VL)."""
        if self._video is None:
            adapter = self.offloader.adapter
            has_video = getattr(adapter, "video_processor", None) is not None
            self._video = (adapter.video_token_id(self.template.hf_config()) if has_video else None,)
        return self._video[0]

    def offload_images(self, messages: list[dict[str, Any]]) -> list[RawMMRef]:
        """Replace every ``{"type": "image", "image": ...}`` item of ``messages`` (in place) by
        ``{"type": "image", "ref": RawMMRef}`` and every ``{"type": "video", "video": ...}`` item
        by ``{"type": "video", "ref": RawMMRef}``; return the refs of all media items, in order.

        Raises:
            ValueError: an image (video) item with neither ``image`` (``video``) nor ``ref``.
            VideoUnreadable, UnsupportedFamily: see :meth:`Offloader.offload_video`.
        """
        refs = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, str) or content is None:
                continue
            items = list(content)
            for i, item in enumerate(items):
                kind = item.get("type") if isinstance(item, dict) else None
                if kind not in ("image", "video"):
                    continue
                ref = item.get("ref")
                if ref is None:
                    if kind not in item:
                        raise ValueError(f"a {kind} item needs `{kind}` (bytes or a path; an image: or PIL)")
                    offload = self.offloader.offload if kind == "image" else self.offloader.offload_video
                    ref = offload(item[kind])
                    items[i] = {"type": kind, "ref": ref}
                refs.append(ref)
            message["content"] = items
        return refs

    def expand(self, token_ids: Sequence[int], refs: Sequence[RawMMRef]) -> list[int]:
        """``token_ids`` (one placeholder per image and video) with every placeholder expanded
        (:func:`expand_placeholders`).

        Raises:
            PlaceholderMismatch: see :func:`expand_placeholders`.
            ValueError: a video of a family whose video placeholders are not one run (Qwen3-VL).
        """
        videos = [r for r in refs if r.modality == "video"]
        video_id = self.video_token_id if videos else None
        if videos:
            from protocol.adapters import VIDEO_FAMILIES

            family = self.offloader.adapter.family
            if VIDEO_FAMILIES[family].per_frame_runs:
                raise ValueError(
                    f"a {family} video's placeholders are one run per frame between timestamp text, "
                    "which the token route cannot take: send it as a video_url part on /v1/chat/completions"
                )
        return expand_placeholders(token_ids, refs, self.placeholder_token_id, video_id)

    def first_turn(self, messages: Sequence[Message], *, in_place: bool = False) -> PreparedPrompt:
        """The prompt of ``messages`` (a new conversation), images and videos offloaded
        (``in_place``: the media items of ``messages``, a list of dicts, are replaced by their
        refs; else a copy is)."""
        owned = messages if in_place else _own(messages)
        refs = self.offload_images(owned)  # type: ignore[arg-type]
        text = self.template.render(owned, add_generation_prompt=True)
        return PreparedPrompt(self.expand(self.template.encode(text), refs), tuple(refs))


def expand_placeholders(
    token_ids: Sequence[int], refs: Sequence[RawMMRef], image_token_id: int, video_token_id: int | None
) -> list[int]:
    """Repeat the i-th image placeholder ``images[i].num_placeholders`` times and the j-th video
    placeholder ``videos[j].num_placeholders`` times (``refs`` in prompt order, split by
    ``modality``): the chat template's prompt -> the prompt vLLM's processor builds, for families
    whose video is one run of its token (Qwen2.5-VL's ``<|video_pad|>``). With no video among
    ``refs``, :func:`protocol.placeholders.expand_image_placeholders`.

    Returns:
        A new list, ``len(token_ids) - len(refs) + sum(num_placeholders)`` long.

    Raises:
        PlaceholderMismatch: the prompt's image or video placeholder count differs from the refs'.
    """
    images = [r for r in refs if r.modality != "video"]
    videos = [r for r in refs if r.modality == "video"]
    wanted = {image_token_id: images}
    if video_token_id is not None:
        wanted[video_token_id] = videos
    elif videos:
        raise PlaceholderMismatch(f"{len(videos)} video(s) for a prompt whose family has no video token")
    for token, items in wanted.items():
        found = sum(1 for t in token_ids if t == token)
        if found != len(items):
            kind = "image" if token == image_token_id else "video"
            raise PlaceholderMismatch(
                f"prompt has {found} placeholder tokens (id {token}) for {len(items)} {kind}(s)"
            )
    queues = {token: iter(items) for token, items in wanted.items()}
    out: list[int] = []
    for t in token_ids:
        out.extend([t] * next(queues[t]).num_placeholders if t in queues else [t])
    return out


def _own(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Shallow copies (content lists copied) that offloading may rewrite."""
    out = []
    for m in messages:
        copy = dict(m)
        if isinstance(copy.get("content"), list | tuple):
            copy["content"] = [dict(i) if isinstance(i, dict) else i for i in copy["content"]]
        out.append(copy)
    return out


class Conversation:
    """A multi-turn chat whose turns are sampled one after the other (see the module doc).

    Add messages (:meth:`add_user`, :meth:`add`), then let a client generate the next assistant turn
    (``client.generate(conversation)``), which records it here; repeat. Images are offloaded
    when the turn that first shows them is prepared, and kept as refs.

    Args:
        builder: the client's :class:`PromptBuilder`.
        messages: opening messages (e.g. a system prompt).
        session_id: the ``X-Session-ID`` every turn is sent with (default: a new uuid), so a router
            keeps the conversation on one server (its prefix cache holds the earlier turns).
    """

    def __init__(
        self, builder: PromptBuilder, messages: Sequence[Message] = (), *, session_id: str | None = None
    ) -> None:
        self._builder = builder
        self.session_id = session_id or uuid.uuid4().hex
        self.messages: list[dict[str, Any]] = _own(messages)
        """Every message so far; image items as ``{"type": "image", "ref": RawMMRef}`` once offloaded,
        assistant turns as ``{"role": "assistant", "content": <decoded text>}``."""
        self.turns: list[Rollout] = []
        """The recorded assistant turns, in order."""
        self._tokens: list[int] | None = None
        self._refs: tuple[RawMMRef, ...] = ()
        self._pending = 0
        """Index of the first message not yet in :attr:`token_ids`."""

    @property
    def token_ids(self) -> list[int]:
        """The conversation so far in tokens (the last turn's prompt + completion); [] before the
        first turn."""
        return list(self._tokens or [])

    @property
    def images(self) -> tuple[RawMMRef, ...]:
        """The refs of every image in :attr:`token_ids`, in order."""
        return self._refs

    def add(self, role: str, content: str | Sequence[Any]) -> Conversation:
        """Append one message (``content``: a string or a list of text/image items). Returns self."""
        self.messages.extend(
            _own([{"role": role, "content": content if isinstance(content, str) else list(content)}])
        )
        return self

    def add_user(self, text: str | None = None, images: Sequence[ImageInput] = ()) -> Conversation:
        """Append a user message: the images first (bytes, PIL images or paths), then ``text``."""
        content: list[dict[str, Any]] = [{"type": "image", "image": image} for image in images]
        if text is not None:
            content.append({"type": "text", "text": text})
        return self.add("user", content)

    def prepare(self) -> PreparedPrompt:
        """The next turn's prompt (new images offloaded; nothing else changes until :meth:`record`).

        Raises:
            ValueError: no message was added since the last turn; or the chat template rewrites
                earlier turns (not append-only).
            PlaceholderMismatch: the new messages render another number of placeholders than they
                have images (e.g. a placeholder token written in the text).
        """
        new = self.messages[self._pending :]
        if not new:
            raise ValueError("add a message before generating the next turn")
        if self._tokens is None:
            return self._builder.first_turn(self.messages, in_place=True)
        builder = self._builder
        new_refs = builder.offload_images(new)
        glue = builder.template.encode(self._between_turns(new))
        last = self.turns[-1]
        if last.finish_reason == "stop":  # the model sampled its end of turn: not twice
            glue = glue[_overlap(last.completion_ids, glue) :]
        expanded = builder.expand(glue, new_refs)
        return PreparedPrompt([*self._tokens, *expanded], (*self._refs, *new_refs))

    def _between_turns(self, new: list[dict[str, Any]]) -> str:
        """The template's text after the last assistant turn's content, through the generation prompt."""
        template = self._builder.template
        base = [*self.messages[: self._pending - 1], {"role": "assistant", "content": _SENTINEL}]
        base_text = template.render(base, add_generation_prompt=False)
        full_text = template.render([*base, *new], add_generation_prompt=True)
        if not full_text.startswith(base_text) or _SENTINEL not in base_text:
            raise ValueError(
                "the chat template renders earlier turns differently once a turn is added; "
                "token-append multi-turn needs an append-only template"
            )
        tail = base_text[base_text.rindex(_SENTINEL) + len(_SENTINEL) :]
        return tail + full_text[len(base_text) :]

    def record(self, rollout: Rollout) -> None:
        """Make ``rollout`` (sampled from :meth:`prepare`'s prompt) the conversation's next assistant turn.

        Raises:
            ValueError: its prompt is not this conversation's next prompt.
        """
        if self._tokens is not None and rollout.prompt_ids[: len(self._tokens)] != self._tokens:
            raise ValueError("the rollout's prompt does not continue this conversation")
        self._tokens = [*rollout.prompt_ids, *rollout.completion_ids]
        self._refs = tuple(rollout.images)
        text = self._builder.template.decode(rollout.completion_ids)
        self.messages.append({"role": "assistant", "content": text})
        self._pending = len(self.messages)
        self.turns.append(rollout)

    def training_sample(self) -> TrainingSample:
        """The whole conversation as one sample: :attr:`token_ids`, loss and the server's logprobs
        on every assistant turn's sampled tokens (the text between turns is context), advantages
        0.0, every image's ref; ``sampling_temperature`` the turns' when they all share one, else
        None (unknown: the trainer then checks nothing).

        Raises:
            ValueError: no turn recorded yet.
        """
        if not self.turns:
            raise ValueError("no turn recorded yet")
        n = len(self._tokens or [])
        loss, logprobs = [False] * n, [0.0] * n
        for turn in self.turns:
            start = len(turn.prompt_ids)
            for i, lp in enumerate(turn.logprobs):
                loss[start + i], logprobs[start + i] = True, lp
        temps = {turn.temperature for turn in self.turns}
        return TrainingSample(
            input_ids=list(self._tokens or []),
            loss_mask=loss,
            advantages=[0.0] * n,
            inference_logprobs=logprobs,
            mm_refs=MMRefs(items=list(self._refs)) if self._refs else None,
            sampling_temperature=temps.pop() if len(temps) == 1 else None,
        )


def _overlap(completion: Sequence[int], glue: Sequence[int]) -> int:
    """The longest ``k`` with ``completion[-k:] == glue[:k]``."""
    for k in range(min(len(completion), len(glue)), 0, -1):
        if list(completion[-k:]) == list(glue[:k]):
            return k
    return 0
