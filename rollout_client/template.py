"""The model's own chat template and tokenizer, and the placeholder arithmetic of a prompt.

transformers imports torch when it is imported, so the tokenizer is loaded on first use
(``AutoTokenizer.from_pretrained(model_dir)``, local files only), never at import of this package.
Prompts are rendered to text by the tokenizer's own ``apply_chat_template`` with every image item
written as ``{"type": "image"}`` (the template emits one placeholder per image, e.g. Qwen's
``<|vision_start|><|image_pad|><|vision_end|>``; a video item as ``{"type": "video"}``, Qwen's
``<|vision_start|><|video_pad|><|vision_end|>``), then tokenized without added special tokens:
the tokens vLLM's ``/v1/chat/completions`` renders for the same messages.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["ChatTemplate", "Message", "template_messages"]

Message = Mapping[str, Any]
"""A chat message: ``{"role": str, "content": str | list[item]}``, items ``{"type": "text",
"text": str}``, ``{"type": "image", "image": bytes | PIL image | path}`` or ``{"type": "video",
"video": bytes | path}`` (after offloading, ``{"type": "image" | "video", "ref": RawMMRef}``)."""


def template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """``messages`` as the chat template takes them: each image item replaced by ``{"type": "image"}``
    and each video item by ``{"type": "video"}`` (the template only counts them), every other item
    and field kept.

    Raises:
        ValueError: a message without ``role``, or content that is neither a string nor a list.
    """
    out = []
    for message in messages:
        if "role" not in message:
            raise ValueError(f"a message needs a role: {dict(message)!r:.200}")
        content = message.get("content")
        if isinstance(content, str) or content is None:
            out.append(dict(message))
            continue
        if not isinstance(content, Sequence):
            raise ValueError(f"content must be a string or a list of items, got {type(content).__name__}")
        items = [{"type": _media(item)} if _media(item) else dict(item) for item in content]
        out.append({**message, "content": items})
    return out


def _media(item: Any) -> str | None:
    """``"image"`` or ``"video"`` for a media item (the template only counts them), else None."""
    kind = item.get("type") if isinstance(item, Mapping) else None
    return kind if kind in ("image", "video") else None


class ChatTemplate:
    """A model folder's tokenizer and chat template (loaded lazily, thread-safe).

    Args:
        model_dir: the served model's folder (``tokenizer*``, ``chat_template.jinja``, ``config.json``).
        tokenizer: a tokenizer already loaded (default: ``AutoTokenizer`` of ``model_dir``).
        trust_remote_code: passed to ``AutoTokenizer`` (Kimi tokenizers are remote code).
        chat_template_kwargs: extra variables for the template (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        trust_remote_code: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self._tokenizer = tokenizer
        self._trust_remote_code = trust_remote_code
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (first use imports transformers, hence torch)."""
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(
                    self.model_dir, local_files_only=True, trust_remote_code=self._trust_remote_code
                )
            return self._tokenizer

    def hf_config(self) -> SimpleNamespace:
        """The top level of the model's ``config.json`` as attributes (what an adapter's
        ``placeholder_token_id`` reads), without transformers' config classes."""
        return SimpleNamespace(**json.loads((self.model_dir / "config.json").read_text()))

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The chat template's text for ``messages`` (media items as ``{"type": "image" | "video"}``)."""
        return self.tokenizer.apply_chat_template(
            template_messages(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special tokens written in it are parsed; none added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` (special tokens dropped)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
