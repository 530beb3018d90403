"""The server's check of a placeholder range a request states (vLLM's ``PlaceholderRange``:
``{"offset", "length"}``): as long as its item, in bounds, every token the placeholder.

The ``features`` form of ``/inference/v1/generate`` states each item's range itself (the ``mm_refs``
form has them located, :func:`protocol.placeholders.locate_image_runs`); both functions raise
:class:`~protocol.errors.PlaceholderMismatch` (HTTP 422 ``placeholder_mismatch``) naming the
offset and both lengths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from protocol.errors import InvalidRequest, PlaceholderMismatch

__all__ = ["check_length", "check_range"]


def check_range(
    token_ids: Sequence[int],
    placeholder: Mapping[str, Any],
    placeholder_token_id: int,
    expected: int,
    ref: str | None,
) -> None:
    """Check one ``{"offset", "length"}`` range (vLLM's ``PlaceholderRange`` as a request states it):
    ``expected`` long, in bounds, every token the placeholder.

    Args:
        token_ids: the prompt.
        placeholder: ``{"offset": int, "length": int}``.
        placeholder_token_id: e.g. the id of ``<|image_pad|>``.
        expected: the item's feature count (its ``num_placeholders``).
        ref: the item's ref (or hash), carried by the error.

    Raises:
        InvalidRequest: offset or length missing or not integers.
        PlaceholderMismatch: naming the offset, both lengths and the token id.
    """
    offset, length = placeholder.get("offset"), placeholder.get("length")
    if type(offset) is not int or type(length) is not int:
        raise InvalidRequest(
            f"mm_placeholders entries need integer offset and length, got {offset!r}, {length!r}"
        )
    check_length(placeholder, expected, ref=ref)
    window = token_ids[offset : offset + length] if offset >= 0 else []
    if len(window) != length or any(t != placeholder_token_id for t in window):
        raise PlaceholderMismatch(
            f"tokens {offset}..{offset + length} are not all placeholder id {placeholder_token_id}", ref=ref
        )


def check_length(
    placeholder: Mapping[str, Any], expected: int, where: str = "", ref: str | None = None
) -> None:
    """Check that one ``{"offset", "length"}`` range (integers) is ``expected`` long: the one copy
    of the rule that a range covers exactly its item's features (:func:`check_range` adds the
    token check).

    Args:
        placeholder: ``{"offset": int, "length": int}``.
        expected: the item's feature count (its ``num_placeholders``).
        where: the item, for the message (e.g. ``"image item 2"``).
        ref: the item's ref (or hash), carried by the error.

    Raises:
        PlaceholderMismatch: naming the offset and both lengths.
    """
    offset, length = placeholder["offset"], placeholder["length"]
    if length != expected:
        prefix = f"{where}: " if where else ""
        raise PlaceholderMismatch(
            f"{prefix}placeholder range at {offset} has length {length}, the item needs {expected}", ref=ref
        )
