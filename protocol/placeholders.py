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

This module writes and finds the runs in a prompt; beside it, one job each:
:mod:`protocol.placeholder_counts` (how many tokens a grid takes, a video's runs, a sample's claimed
counts) and :mod:`protocol.placeholder_ranges` (the server's check of a range a request states).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protocol.errors import InvalidRequest, PlaceholderMismatch
from protocol.structs import RawMMRef

__all__ = ["expand_image_placeholders", "locate_image_runs", "locate_video_runs"]


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
        runs: per video, its runs' token counts (``adapter.video_token_runs(grid)``,
            :func:`protocol.placeholder_counts.video_token_runs`).

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
