"""One mini-batch's samples as the partition sees them, checked once (docs/PACKING.md §3.2, §3.7).

:class:`MiniBatchItems` is the one data object every step of the data-parallel plan reads
(:mod:`~trainer_lib.planning.partition`, :mod:`~trainer_lib.planning.grouped`,
:mod:`~trainer_lib.planning.heavy_slot`, :mod:`~trainer_lib.planning.refine`, and the bound of
:mod:`~trainer_lib.planning.slot_bound`): per sample its tokens, isolation key, bin kind, place,
image set and costs, with the mini-batch's cap, reserve, rank count and ``stretch`` rule.
:func:`~trainer_lib.planning.ranks.deal_mini_batch` builds it from the samples' analyses; the
per-sample lists are checked for equal length here and trusted everywhere after.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from trainer_lib.planning.bins import NEUTRAL, PIXELS, STRAY

__all__ = ["EITHER", "TEXT", "VISION", "MiniBatchItems", "places"]

VISION, TEXT, EITHER = 0, 1, 2
"""Where a sample may go: vision slots only (pixels), text slots only, either (plain text)."""


def places(lengths: Sequence[int], kinds: Sequence[int], cap: int, reserve: int) -> list[int]:
    """Per sample: :data:`VISION` (pixels), :data:`TEXT` (a stray placeholder, or text within
    ``reserve`` tokens of the cap: no room for an image pad) or :data:`EITHER` (step 1 of
    :mod:`trainer_lib.planning.partition`)."""
    return [
        VISION if k == PIXELS else TEXT if k == STRAY or n > cap - reserve else EITHER
        for n, k in zip(lengths, kinds, strict=True)
    ]


@dataclass(frozen=True)
class MiniBatchItems:
    """One mini-batch's per-sample inputs and the rules every partition step applies to them.

    Per-sample sequences are indexed by the sample's position in the mini-batch (``0..n-1``);
    ``None`` takes the default given. ``__post_init__`` fills the defaults, checks the lengths
    and values once, and derives :attr:`place`.

    Example: two text samples and one with an image on 2 ranks, cap 100::

        MiniBatchItems([30, 60, 40], dp=2, cap=100, kinds=[NEUTRAL, NEUTRAL, PIXELS], reserve=6)
        # .place == [EITHER, EITHER, VISION]; .reserve == 6

    Raises:
        ValueError: ``dp`` or ``cap`` below 1, ``reserve`` outside ``[0, cap)``, ``unit_seconds``
            not above 0, a length below 1,
            a kind other than ``NEUTRAL``, ``PIXELS``, ``STRAY``, or a per-sample sequence of
            another length than ``lengths``.
    """

    lengths: Sequence[int]
    """Tokens per sample (``len(input_ids)``), each >= 1."""
    dp: int
    """Data-parallel ranks."""
    cap: int
    """Micro-batch token cap (``micro_batch_max_tokens``); a longer sample runs alone."""
    keys: Sequence[Hashable] | None = None
    """Isolation key per sample (``(run_id, lora_id)``); keys never share a micro-batch. Default:
    one key."""
    kinds: Sequence[int] | None = None
    """:data:`~trainer_lib.planning.bins.NEUTRAL`, ``PIXELS`` or ``STRAY`` per sample. Default:
    all ``NEUTRAL``."""
    vision: Sequence[float] | None = None
    """Vision-tower cost per sample, any unit (``CostModel.vision`` of its images' placeholder
    counts; a group's samples all carry their set's cost). Default: all 0."""
    language: Sequence[float] | None = None
    """Language-model cost per sample (``CostModel.language``). Default: ``lengths``."""
    groups: Sequence[Hashable | None] | None = None
    """Per sample, a key of its image set (equal keys: the same images; None: no image). Given,
    the plan is balanced by compute with each set kept together; None (the default): by tokens."""
    reserve: int = 0
    """Tokens a vision-slot bin keeps free for a synthetic-image pad (``[pad] + placeholders +
    [pad]`` of the smallest grid: 6 for Qwen2-VL). Set to 0 where no slot can run the tower
    without an image: one rank, or no sample with pixels."""
    stretch: bool = False
    """``stretch_cap``: the samples above the cap get slots of their own, whose other bins fill up
    to the slot's longest sample instead of the cap."""
    unit_seconds: float | None = None
    """Seconds of forward+backward on the card per unit of ``vision`` and ``language``
    (:attr:`~trainer_lib.planning.cost.CostModel.seconds_per_unit`); None: the costs are not time
    (tokens). The plan's search budget reads it (:mod:`~trainer_lib.planning.refine`)."""
    place: Sequence[int] = field(init=False)
    """Per sample :data:`VISION`, :data:`TEXT` or :data:`EITHER` (:func:`places`; all
    :data:`EITHER` without pixels)."""

    def __post_init__(self) -> None:
        n = len(self.lengths)
        if self.unit_seconds is not None and not self.unit_seconds > 0:
            raise ValueError(f"unit_seconds must be > 0 or None, got {self.unit_seconds}")
        if self.dp < 1 or self.cap < 1 or not 0 <= self.reserve < self.cap:
            raise ValueError(
                f"need dp, cap >= 1 and 0 <= reserve < cap; got {self.dp}, {self.cap}, {self.reserve}"
            )
        filled = {
            "keys": [None] * n if self.keys is None else self.keys,
            "kinds": [NEUTRAL] * n if self.kinds is None else self.kinds,
            "vision": [0.0] * n if self.vision is None else self.vision,
            "language": self.lengths if self.language is None else self.language,
        }
        sizes = {name: len(seq) for name, seq in filled.items()}
        sizes["groups"] = n if self.groups is None else len(self.groups)
        if any(size != n for size in sizes.values()):
            raise ValueError(
                f"{n} lengths but " + ", ".join(f"{size} {name}" for name, size in sizes.items())
            )
        kinds = filled["kinds"]
        if (n and min(self.lengths) < 1) or not set(kinds) <= {NEUTRAL, PIXELS, STRAY}:
            raise ValueError("every length must be >= 1 and every kind NEUTRAL, PIXELS or STRAY")
        pixels = PIXELS in kinds
        reserve = self.reserve if self.dp > 1 and pixels else 0
        filled["place"] = places(self.lengths, kinds, self.cap, reserve) if pixels else [EITHER] * n
        for name, value in {**filled, "reserve": reserve}.items():
            object.__setattr__(self, name, value)

    @property
    def n(self) -> int:
        """Samples in the mini-batch."""
        return len(self.lengths)

    @cached_property
    def one_key(self) -> bool:
        """Every sample has the same isolation key (the usual case: bins need no grouping)."""
        keys = list(self.keys or ())
        return not keys or keys.count(keys[0]) == len(keys)

    @cached_property
    def image_sets(self) -> list[Hashable | None]:
        """:attr:`groups` where a sample goes to vision slots only (:data:`VISION`), None elsewhere
        and without ``groups``: the image sets the vision section is planned around."""
        groups = self.groups if self.groups is not None else [None] * self.n
        return [g if p == VISION else None for g, p in zip(groups, self.place, strict=True)]
