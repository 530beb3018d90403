"""Placeholder-run arithmetic: the one implementation the server plugin and the trainer import.

A processed-feature prompt carries each image as a run of ``num_placeholders`` copies of the
model's placeholder token (``<|image_pad|>`` for Qwen). vLLM neither expands nor checks such
prompts, and transformers scatters image rows into placeholder positions by token id, so both
sides must agree, token for token, on where each image sits::

    ids    = [T, P, P, P, P, P, T, P, P]      P = placeholder id, T = text
    counts = [2, 3, 2]                        placeholders per image, prompt order
    locate_image_runs(ids, [], P, counts=counts) == [(1, 2), (3, 3), (7, 2)]

Adjacent images share one run and are split by their counts in order; an image never spans two
runs. All functions raise :class:`~protocol.errors.PlaceholderMismatch` (HTTP 422
``placeholder_mismatch``) naming the token id and both counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from protocol.errors import InvalidRequest, PlaceholderMismatch
from protocol.structs import RawMMRef

__all__ = [
    "check_length",
    "check_no_typed_images",
    "check_placeholder_counts",
    "check_range",
    "expand_image_placeholders",
    "grid_placeholder_count",
    "locate_image_runs",
    "locate_video_runs",
    "video_token_runs",
]


def expand_image_placeholders(
    token_ids: Sequence[int], refs: Sequence[RawMMRef], placeholder_token_id: int
) -> list[int]:
    """Repeat the i-th placeholder token ``refs[i].num_placeholders`` times (chat-template prompt
    -> processed-feature prompt).

    Args:
        token_ids: a prompt with exactly one placeholder token per image (chat-template output).
        refs: the images, in prompt order.
        placeholder_token_id: e.g. the id of ``<|image_pad|>``.

    Returns:
        A new list of token ids, ``len(token_ids) - len(refs) + sum(num_placeholders)`` long.

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


def locate_image_runs(
    input_ids: Sequence[int],
    refs: Sequence[RawMMRef],
    placeholder_token_id: int,
    *,
    mm_token_type_ids: Sequence[int] | None = None,
    counts: Sequence[int] | None = None,
    sample: int | None = None,
) -> list[tuple[int, int]]:
    """Each image's placeholder run in one prompt: ``[(start, length)]`` in prompt order.

    Image positions are where ``mm_token_type_ids == 1`` when given (a text token that happens to
    equal the placeholder id is then not an image), else where ``input_ids == placeholder_token_id``.
    Each contiguous run is split by the images' counts in order (vLLM's placeholder ranges do the
    same for adjacent images).

    Args:
        input_ids: ``[L]`` token ids (list, tuple or 1-D array).
        refs: the images in prompt order (their ``num_placeholders`` are the default counts; the
            error carries the offending image's ref).
        placeholder_token_id: e.g. the id of ``<|image_pad|>``.
        mm_token_type_ids: optional ``[L]`` 0 (text) / 1 (image).
        counts: placeholder tokens per image, prompt order, each >= 1; default
            ``[r.num_placeholders for r in refs]`` (a server passes its resolved items' counts).
        sample: the sample's position in a batch, named in error messages.

    Raises:
        PlaceholderMismatch: a count < 1; typed positions that are not the placeholder token;
            placeholder tokens typed as text in a prompt with images (transformers scatters by
            token id and would fill them too); a total that differs from ``sum(counts)``; or runs
            that do not split into the counts.
    """
    counts = [r.num_placeholders for r in refs] if counts is None else list(counts)
    fast = _runs_fast(input_ids, mm_token_type_ids, placeholder_token_id, counts)
    if fast is not None:
        return fast
    where = f"sample {sample}: " if sample is not None else ""
    ref = refs[0].ref if refs else None
    bad_count = next((c for c in counts if c < 1), None)
    if bad_count is not None:
        raise PlaceholderMismatch(
            f"{where}an image has a placeholder count of {bad_count}; counts must be >= 1", ref=ref
        )
    mask = _image_mask(input_ids, mm_token_type_ids, placeholder_token_id, bool(counts), where, ref)
    n_image = int(mask.sum())
    if n_image != sum(counts):
        raise PlaceholderMismatch(
            f"{where}{n_image} image placeholder tokens (id {placeholder_token_id}) for {len(counts)} "
            f"image(s) needing {sum(counts)} ({counts}); send expanded placeholders, one run of "
            "num_placeholders per image",
            ref=ref,
        )
    return _split_runs(mask, counts, refs, placeholder_token_id, where)


def locate_video_runs(
    input_ids: Sequence[int],
    refs: Sequence[RawMMRef],
    video_token_id: int,
    *,
    runs: Sequence[Sequence[int]],
    mm_token_type_ids: Sequence[int] | None = None,
    sample: int | None = None,
) -> list[list[tuple[int, int]]]:
    """Each video's placeholder runs in one prompt: per video, ``[(start, length)]`` in prompt order.

    :func:`locate_image_runs` under the video token: video positions are where
    ``mm_token_type_ids == 2`` when given (transformers' convention: 0 text, 1 image, 2 video), else
    where ``input_ids == video_token_id``; each contiguous run is split by the videos' runs in
    order, then the runs are grouped back per video.

    Example (Qwen2.5-VL: one run per video; Qwen3-VL: one per temporal patch, text between)::

        ids = [T, V, V, V, T, V, V]                      V = video_token_id
        locate_video_runs(ids, refs, V, runs=[[3], [2]]) == [[(1, 3)], [(5, 2)]]
        locate_video_runs(ids, refs, V, runs=[[3, 2]]) == [[(1, 3), (5, 2)]]

    Args:
        refs: the videos in prompt order (named in errors).
        runs: per video, its runs' token counts (``adapter.video_token_runs(grid)``).

    Raises:
        PlaceholderMismatch: see :func:`locate_image_runs` (its messages say "image" for the
            token id they name).
    """
    types = None if mm_token_type_ids is None else [1 if int(t) == 2 else 0 for t in mm_token_type_ids]
    flat = [int(c) for per in runs for c in per]
    found = iter(
        locate_image_runs(
            input_ids, refs, video_token_id, mm_token_type_ids=types, counts=flat, sample=sample
        )
    )
    return [[next(found) for _ in per] for per in runs]


def _split_runs(
    mask: np.ndarray, counts: list[int], refs: Sequence[RawMMRef], tok: int, where: str
) -> list[tuple[int, int]]:
    """Cut each run of ``mask`` into the next images' counts, in order (their total is checked)."""
    edges = np.flatnonzero(np.diff(np.concatenate(([False], mask, [False])).astype(np.int8)))
    spans: list[tuple[int, int]] = []
    for run_start, run_end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        pos = run_start
        while pos < run_end:
            k = len(spans)
            if pos + counts[k] > run_end:
                raise PlaceholderMismatch(
                    f"{where}a run of {run_end - run_start} placeholder tokens (id {tok}) "
                    f"at {run_start} does not split into the images' counts {counts}",
                    ref=refs[k if k < len(refs) else 0].ref if refs else None,
                )
            spans.append((pos, counts[k]))
            pos += counts[k]
    return spans


def _image_mask(
    input_ids: Sequence[int],
    types: Sequence[int] | None,
    tok: int,
    has_images: bool,
    where: str,
    ref: str | None,
) -> np.ndarray:
    """Boolean ``[L]`` image positions, after checking ``types`` against the ids.

    Raises:
        InvalidRequest: an id or type outside the 64-bit range (no token id is).
        PlaceholderMismatch: see :func:`locate_image_runs`.
    """
    try:
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        typed = None if types is None else np.asarray(types, dtype=np.int64).reshape(-1)
    except OverflowError as e:
        raise InvalidRequest(f"{where}a token id or type is outside the 64-bit integer range", ref=ref) from e
    is_tok = ids == tok
    if typed is None:
        return is_tok
    if typed.shape != ids.shape:
        raise PlaceholderMismatch(f"{where}{typed.size} mm_token_type_ids for {ids.size} input ids", ref=ref)
    mask = typed == 1
    bad = np.flatnonzero(mask & ~is_tok)
    if bad.size:
        raise PlaceholderMismatch(
            f"{where}mm_token_type_ids marks position {int(bad[0])} as image but its id is "
            f"{int(ids[bad[0]])}, not the placeholder token {tok}",
            ref=ref,
        )
    stray = np.flatnonzero(is_tok & ~mask)
    if stray.size and has_images:
        raise PlaceholderMismatch(
            f"{where}{stray.size} placeholder token(s) (id {tok}) typed as text (first at "
            f"{int(stray[0])}) in a sample with images: the model locates images by token id and "
            f"would scatter {int(is_tok.sum())} rows for {int(mask.sum())} image tokens",
            ref=ref,
        )
    return mask


def _runs_fast(
    input_ids: Sequence[int], types: Sequence[int] | None, tok: int, counts: list[int]
) -> list[tuple[int, int]] | None:
    """:func:`locate_image_runs` for well-formed list inputs with C-level list operations; None
    when anything is off (the numpy path then finds and names the problem).

    Each image takes the first unconsumed image token and the ``count`` tokens after it, which
    must all be image tokens; with the totals equal, the blocks tile every run exactly.
    """
    if not isinstance(input_ids, list) or (types is not None and not isinstance(types, list)):
        return None
    total = sum(counts)
    if types is None:
        mask, on = input_ids, tok
    else:
        if len(types) != len(input_ids) or input_ids.count(tok) != total:
            return None
        mask, on = types, 1
    if mask.count(on) != total:
        return None
    spans = []
    pos = 0
    for c in counts:
        if c < 1:
            return None
        try:
            i = mask.index(on, pos)
        except ValueError:
            return None
        if mask[i : i + c].count(on) != c or (types is not None and input_ids[i : i + c].count(tok) != c):
            return None
        spans.append((i, c))
        pos = i + c
    return spans


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
