"""The fewest micro-batches per rank a data-parallel plan's rules allow (docs/PACKING.md §3.2, §3.6).

:func:`min_micro_batches` is the lower bound on the slot count that
:mod:`trainer_lib.planning.partition` plans against (step 4 stops there) and ``bench/pack.py``
prints as the floor; :func:`slot_floor` and :func:`slots_needed` compute it on a mini-batch's
:class:`~trainer_lib.planning.items.MiniBatchItems`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from trainer_lib.planning.items import TEXT, VISION, MiniBatchItems

__all__ = ["min_micro_batches", "slot_floor", "slots_needed"]


def min_micro_batches(
    lengths: Sequence[int],
    *,
    dp_size: int,
    cap: int,
    keys: Sequence[Hashable] | None = None,
    kinds: Sequence[int] | None = None,
    reserve: int = 0,
) -> int:
    """A lower bound on the micro-batches per rank of any plan under the rules of
    :func:`~trainer_lib.planning.partition.partition_mini_batch`.

    ``ceil(bins / dp_size)``, where per isolation key a sample above the cap fills a bin alone and
    the others fill bins completely; with images, at least the vision slots plus the text slots
    this bound gives each section (a slot runs the vision tower on every rank or none).

    Raises:
        ValueError: what :class:`~trainer_lib.planning.items.MiniBatchItems` refuses.
    """
    items = MiniBatchItems(lengths, dp=dp_size, cap=cap, keys=keys, kinds=kinds, reserve=reserve)
    return slot_floor(items, range(items.n))


def slots_needed(items: MiniBatchItems, section: Iterable[int], cap: int) -> int:
    """``ceil(bins / dp)`` for the samples ``section``, bins counted per key: one per sample above
    ``cap``, the rest full."""
    lengths, keys, dp = items.lengths, items.keys, items.dp
    if items.one_key:
        sizes = list(map(lengths.__getitem__, section))
        over = sum(n > cap for n in sizes)
        fit_tokens = sum(sizes) - sum(n for n in sizes if n > cap)
        return -(-(over + -(-fit_tokens // cap)) // dp)
    over, fit = 0, {}
    for i in section:
        if lengths[i] > cap:
            over += 1
        else:
            fit[keys[i]] = fit.get(keys[i], 0) + lengths[i]
    return -(-(over + sum(-(-tokens // cap) for tokens in fit.values())) // dp)


def slot_floor(items: MiniBatchItems, section: Sequence[int]) -> int:
    """:func:`min_micro_batches` of the samples ``section`` from their places."""
    total = slots_needed(items, section, items.cap)
    pix = [i for i in section if items.place[i] == VISION]
    if not pix:
        return total
    text = [i for i in section if items.place[i] == TEXT]
    return max(
        total, slots_needed(items, pix, items.cap - items.reserve) + slots_needed(items, text, items.cap)
    )
