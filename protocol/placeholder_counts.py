"""Placeholder counts: how many placeholder tokens an item's grid takes, and a sample's claims
checked against them (the trainer's sample checks, the video adapters' runs).

- :func:`grid_placeholder_count`: an adapter's ``num_placeholders(grid)``, a grid it cannot read
  refused as :class:`~protocol.errors.PlaceholderMismatch`;
- :func:`video_token_runs`: a video's ``<|video_pad|>`` runs from its ``video_grid_thw`` (one run,
  or one per temporal patch);
- :func:`check_placeholder_counts`, :func:`check_no_typed_images`: a sample's refs claim the
  counts their grids give; a sample without images types no token as an image.

Where those runs sit in a prompt is :mod:`protocol.placeholders`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from protocol.errors import PlaceholderMismatch
from protocol.structs import RawMMRef

__all__ = ["check_no_typed_images", "check_placeholder_counts", "grid_placeholder_count", "video_token_runs"]


def grid_placeholder_count(
    num_placeholders: Callable[[Sequence[int]], int],
    grid: Sequence[int],
    *,
    sample: int | None = None,
    ref: str | None = None,
) -> int:
    """``num_placeholders(grid)`` (an adapter's ``num_placeholders``), as an int.

    Raises:
        PlaceholderMismatch: a grid the function cannot read (wrong length, not ints).
    """
    try:
        return int(num_placeholders(grid))
    except (TypeError, ValueError) as e:
        where = f"sample {sample}: " if sample is not None else ""
        raise PlaceholderMismatch(
            f"{where}grid {list(grid)} gives no placeholder count ({e})", ref=ref
        ) from e


def video_token_runs(grid: Sequence[int], merge_size: int, *, per_frame: bool) -> list[int]:
    """The ``<|video_pad|>`` runs of one video with ``video_grid_thw`` ``grid = [t, h, w]``, in
    prompt order: ``t*h*w // merge_size**2`` tokens in all (vLLM's ``get_replacement_qwen2vl``).

    Qwen2-VL / Qwen2.5-VL place them as one run (``per_frame=False``); Qwen3-VL as ``t`` runs of
    ``h*w // merge_size**2``, one per temporal patch, each after its timestamp text
    (``<t.t seconds><|vision_start|>...<|vision_end|>``: vLLM ``Qwen3VLMultiModalProcessor.get_video_repl``).

    Example::

        video_token_runs([2, 10, 8], 2, per_frame=False) == [40]
        video_token_runs([2, 10, 8], 2, per_frame=True) == [20, 20]

    Raises:
        PlaceholderMismatch: a grid that is not three positive ints, or a frame whose patches do
            not merge into whole tokens.
    """
    values = [int(g) for g in grid]
    if len(values) != 3 or min(values) < 1 or (values[1] * values[2]) % merge_size**2:
        raise PlaceholderMismatch(f"video grid {values} gives no placeholder count (merge size {merge_size})")
    t, h, w = values
    per = h * w // merge_size**2
    return [per] * t if per_frame else [t * per]


def check_no_typed_images(mm_token_type_ids: Sequence[int] | None, *, sample: int | None = None) -> None:
    """A sample without images may hold the placeholder id as text (a stray placeholder), but
    ``mm_token_type_ids`` may not mark any token as an image.

    Raises:
        PlaceholderMismatch: ``mm_token_type_ids`` marks an image token.
    """
    if mm_token_type_ids is not None and any(mm_token_type_ids):
        raise PlaceholderMismatch(
            f"sample {sample}: mm_token_type_ids marks {sum(mm_token_type_ids)} image token(s) but the "
            f"sample has no images"
        )


def check_placeholder_counts(
    refs: Sequence[RawMMRef], num_placeholders: Callable[[Sequence[int]], int], *, sample: int | None = None
) -> None:
    """Each ref's ``num_placeholders`` must be what its ``grid`` gives.

    Args:
        refs: the images of one prompt.
        num_placeholders: the adapter's ``num_placeholders`` (grid -> placeholder tokens).
        sample: the sample's position in a batch, named in error messages.

    Raises:
        PlaceholderMismatch: naming the ref, both counts and the grid (also a grid that
            :func:`grid_placeholder_count` cannot read).
    """
    for r in refs:
        want = grid_placeholder_count(num_placeholders, r.grid, sample=sample, ref=r.ref)
        if want != r.num_placeholders:
            where = f"sample {sample}: " if sample is not None else ""
            raise PlaceholderMismatch(
                f"{where}ref claims {r.num_placeholders} placeholders, its grid {r.grid} gives {want}",
                ref=r.ref,
            )
