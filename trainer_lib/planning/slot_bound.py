"""The rules a data-parallel plan keeps, and the fewest micro-batches per rank they allow
(docs/PACKING.md §3.2, §3.6).

:func:`places` says which slots a sample may join (vision, text, either); :class:`SlotRules`
carries one mini-batch's per-sample inputs with its cap, reserve and rank count;
:func:`min_micro_batches` is the lower bound on the slot count that :mod:`trainer_lib.planning.partition`
plans against (step 4 stops there) and ``bench/pack.py`` prints as the floor.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY

__all__ = [
    "EITHER",
    "TEXT",
    "VISION",
    "SlotRules",
    "min_micro_batches",
    "places",
    "slot_floor",
    "slots_needed",
]

VISION, TEXT, EITHER = 0, 1, 2
"""Where a sample may go: vision slots only (pixels), text slots only, either (plain text)."""


@dataclass(frozen=True)
class SlotRules:
    """One mini-batch's per-sample inputs and the rules every partition step applies to them."""

    lengths: Sequence[int]
    keys: Sequence[Hashable]
    kinds: Sequence[int]
    place: Sequence[int]
    """Per sample: :data:`VISION`, :data:`TEXT` or :data:`EITHER` (:func:`places`)."""
    cap: int
    reserve: int
    dp: int
    stretch: bool = False

    @property
    def n(self) -> int:
        return len(self.lengths)

    @cached_property
    def one_key(self) -> bool:
        """Every sample has the same isolation key (the usual case: bins need no grouping)."""
        return not self.keys or list(self.keys).count(self.keys[0]) == len(self.keys)


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
    """
    keys = [None] * len(lengths) if keys is None else keys
    kinds = [NEUTRAL] * len(lengths) if kinds is None else kinds
    reserve = reserve if dp_size > 1 else 0  # one rank: no slot to align, no pad to make room for
    mb = SlotRules(lengths, keys, kinds, places(lengths, kinds, cap, reserve), cap, reserve, dp_size)
    return slot_floor(mb, range(len(lengths)))


def places(lengths: Sequence[int], kinds: Sequence[int], cap: int, reserve: int) -> list[int]:
    """Per sample: :data:`VISION`, :data:`TEXT` or :data:`EITHER` (step 1 of
    :mod:`trainer_lib.planning.partition`)."""
    return [
        VISION if k == PIXELS else TEXT if k == STRAY or n > cap - reserve else EITHER
        for n, k in zip(lengths, kinds, strict=True)
    ]


def slots_needed(mb: SlotRules, items: Iterable[int], cap: int) -> int:
    """``ceil(bins / dp)``, bins counted per key: one per sample above ``cap``, the rest full."""
    lengths, keys, dp = mb.lengths, mb.keys, mb.dp
    if mb.one_key:
        sizes = list(map(lengths.__getitem__, items))
        over = sum(n > cap for n in sizes)
        fit_tokens = sum(sizes) - sum(n for n in sizes if n > cap)
        return -(-(over + -(-fit_tokens // cap)) // dp)
    over, fit = 0, {}
    for i in items:
        if lengths[i] > cap:
            over += 1
        else:
            fit[keys[i]] = fit.get(keys[i], 0) + lengths[i]
    return -(-(over + sum(-(-tokens // cap) for tokens in fit.values())) // dp)


def slot_floor(mb: SlotRules, items: Sequence[int]) -> int:
    """:func:`min_micro_batches` of ``items`` from the samples' places."""
    total = slots_needed(mb, items, mb.cap)
    pix = [i for i in items if mb.place[i] == VISION]
    if not pix:
        return total
    text = [i for i in items if mb.place[i] == TEXT]
    return max(total, slots_needed(mb, pix, mb.cap - mb.reserve) + slots_needed(mb, text, mb.cap))
