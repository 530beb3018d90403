"""Prompt helpers for clients that tokenize chats themselves.

vLLM's processed-feature path needs the image placeholder token repeated
``num_placeholders`` times per image (vLLM does not expand, and does not check);
a chat template emits one per image. :func:`expand_image_placeholders` bridges the two.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.errors import PlaceholderMismatch
from protocol.structs import RawMMRef

__all__ = ["expand_image_placeholders"]


def expand_image_placeholders(
    token_ids: Sequence[int], refs: Sequence[RawMMRef], placeholder_token_id: int
) -> list[int]:
    """Repeat the i-th placeholder token ``refs[i].num_placeholders`` times.

    Args:
        token_ids: a prompt with exactly one placeholder token per image (chat-template output).
        refs: the images, in prompt order.
        placeholder_token_id: e.g. the id of ``<|image_pad|>``.

    Returns:
        A new list of token ids.

    Raises:
        PlaceholderMismatch: the prompt's placeholder count differs from ``len(refs)``.
    """
    found = sum(1 for t in token_ids if t == placeholder_token_id)
    if found != len(refs):
        raise PlaceholderMismatch(
            f"prompt has {found} placeholder tokens (id {placeholder_token_id}) for {len(refs)} image(s)"
        )
    out: list[int] = []
    images = iter(refs)
    for t in token_ids:
        out.extend([t] * next(images).num_placeholders if t == placeholder_token_id else [t])
    return out
